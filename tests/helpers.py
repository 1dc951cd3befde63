"""Helpers shared by the tests: the input generators of ``cula_aot.testing`` (CONTRACT §8
distributions) under the names the tests import, the kernels' tile slots, and a checked prefill."""

import torch

import cula_aot
from cula_aot import reference
from cula_aot.layout import CHUNK, varlen_slot_base
from cula_aot.ops.prefill import prefill
from cula_aot.testing import cu_seqlens_of, fresh_seed, standard_inputs

__all__ = [
    "bits",
    "cu_seqlens_of",
    "float64_prefill",
    "fresh_seed",
    "in_layout",
    "prefill_kv",
    "standard_inputs",
    "tile_slots",
]


def in_layout(state_kv, layout):
    """S ([.., K, V]) as a pool stores it, or back: "vk" keeps Sᵀ per head."""
    return state_kv.transpose(-1, -2) if layout == "vk" else state_kv


def bits(t):
    """The raw bits of a float32 or 16-bit tensor, for bitwise comparisons."""
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


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


def float64_prefill(inputs, s0, cu):
    """``reference.kda_chunked`` of ``standard_inputs`` (its gate and the gate's arguments) from
    initial states ``s0`` ([N, H, K, V], or None): prefill_kv's float64 twin."""
    return reference.kda_chunked(
        *(inputs[name] for name in ("q", "k", "v", "g", "beta")),
        A_log=inputs.get("A_log"),
        dt_bias=inputs.get("dt_bias"),
        lower_bound=inputs.get("lower_bound"),
        initial_state=s0,
        cu_seqlens=cu,
        gate_kind=inputs.get("gate", "safe"),
    )


def prefill_kv(inputs, s0, cu, intracard_cp, layout="vk", fused=None):
    """``kda_prefill`` of ``standard_inputs`` from initial states ``s0`` ([N, H, K, V], or None)
    in ``layout``, outputs and final states poisoned with NaN first; (o, final state [N, H, K, V]),
    each checked finite (every element written)."""
    init = None if s0 is None else in_layout(s0, layout).contiguous()
    out = torch.full_like(inputs["v"], float("nan"))
    n = inputs["q"].shape[0] if cu is None else cu.numel() - 1
    final = torch.full((n, inputs["q"].shape[2], 128, 128), float("nan"), device="cuda")
    # ``fused`` (a path override) is the internal entry's; the public one picks for itself.
    entry = cula_aot.kda_prefill if fused is None else prefill
    o, fs = entry(
        inputs["q"],
        inputs["k"],
        inputs["v"],
        inputs["g"],
        inputs["beta"],
        A_log=inputs["A_log"],
        dt_bias=inputs["dt_bias"],
        lower_bound=inputs["lower_bound"],
        initial_state=init,
        cu_seqlens=cu,
        cu_seqlens_cpu=None if cu is None else cu.cpu(),
        state_layout=layout,
        out=out,
        final_state=final,
        intracard_cp=intracard_cp,
        **({} if fused is None else {"fused": fused}),
    )
    torch.cuda.synchronize()
    assert torch.isfinite(o).all() and torch.isfinite(fs).all(), f"intracard_cp={intracard_cp!r}: unwritten output"
    return o, in_layout(fs, layout)
