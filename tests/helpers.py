"""Input generators shared by the tests (CONTRACT §8 distributions)."""

import os

import torch

from cula_aot.layout import CHUNK, varlen_slot_base


def fresh_seed() -> int:
    """A new seed per call (printed by the caller on failure): inputs are fresh random draws."""
    return int.from_bytes(os.urandom(4), "little")


def standard_inputs(batch, seq_len, heads, *, device="cpu", seed=None, slow_decay=False):
    """q, k, v, g ~ N(0,1) bf16, β ~ N(0,1), A_log = log U(1,16), dt_bias ~ 0.1·N(0,1).

    Drawn on ``device`` itself (multi-GB inputs would take minutes to draw on a CPU)."""
    gen = torch.Generator(device=device).manual_seed(fresh_seed() if seed is None else seed)

    def bf16(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(torch.bfloat16)

    shape = (batch, seq_len, heads, 128)
    inputs = {"q": bf16(*shape), "k": bf16(*shape), "v": bf16(*shape), "g": bf16(*shape),
              "beta": bf16(batch, seq_len, heads)}
    if slow_decay:
        a_log = torch.full((heads,), -4.0, device=device)
        lower_bound = -0.05
    else:
        a_log = torch.log(torch.rand(heads, generator=gen, device=device) * 15 + 1)
        lower_bound = -5.0
    inputs.update(A_log=a_log.float().to(device),
                  dt_bias=0.1 * torch.randn(heads, 128, generator=gen, device=device), lower_bound=lower_bound)
    return inputs


def cu_seqlens_of(lengths, device="cpu"):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def tile_slots(lengths_or_batch, seq_len=None):
    """Kernel tile slot of every reference tile (reference order: sequence by sequence)."""
    slots = []
    if seq_len is not None:  # fixed: B sequences of seq_len
        per_seq = -(-seq_len // CHUNK)
        for b in range(lengths_or_batch):
            slots.extend(b * per_seq + t for t in range(per_seq))
        return slots
    cu = cu_seqlens_of(lengths_or_batch).tolist()
    for s, n in enumerate(lengths_or_batch):
        slots.extend(varlen_slot_base(cu, s) + t for t in range(-(-n // CHUNK)))
    return slots
