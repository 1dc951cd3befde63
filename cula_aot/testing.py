"""Random KDA inputs for tests and benchmarks (like ``torch.testing``: torch only, no cutlass, no GPU
needed to import it).

``standard_inputs`` draws the inputs of docs/CONTRACT.md §8, per head of dimension 128:

* ``q``, ``k``, ``v``, ``g`` ~ N(0, 1), ``[B, T, H, 128]``, rounded to bf16;
* ``beta`` ~ N(0, 1), ``[B, T, H]``, bf16 (logits: the kernels apply the sigmoid);
* ``A_log`` = log U(1, 16), ``[H]`` fp32, and ``lower_bound`` = -5 (standard decay); with
  ``slow_decay=True`` instead ``A_log`` = -4 for every head and ``lower_bound`` = -0.05, so the
  gate stays close to 1 and a state carries over many tiles;
* ``dt_bias`` ~ 0.1·N(0, 1), ``[H, 128]`` fp32;
* optionally ``initial_state`` ~ 0.1·N(0, 1), ``[n_states, H, 128, 128]`` fp32.

``gate="softplus"`` draws the same tensors for fla's unbounded gate (no ``lower_bound``; slow
decay: A_log = -4); ``gate="precomputed"`` passes that gate's log-decay γ itself as g (bf16) with
no A_log / dt_bias.  ``extreme=True`` (softplus): A_log = log 16, dt_bias = 0 and g a mix per
element of U(20, 30) (γ ≈ −16·25 per token), −20 (γ ≈ −3e-8: no decay) and N(0, 1), so every
16-token tile has channels that forget everything next to channels that keep everything.

All draws come from one ``torch.Generator`` seeded with ``seed`` (a fresh random seed when None),
in the order q, k, v, g, β, A_log (standard decay only), dt_bias, initial state: one seed gives
the same tensors on the same kind of device.  The returned dict's keys are ``kda_prefill``'s
argument names, so ``kda_prefill(**standard_inputs(...))`` is a valid call.
"""

import math
import os

import torch

from . import reference
from .gates import DEFAULT_GATE, GATES, bounded

__all__ = ["HEAD_DIM", "cu_seqlens_of", "fresh_seed", "standard_inputs"]

HEAD_DIM = 128


def fresh_seed() -> int:
    """A new seed per call (print it on failure to reproduce): inputs are fresh random draws."""
    return int.from_bytes(os.urandom(4), "little")


def standard_inputs(
    batch,
    seq_len,
    heads,
    *,
    device="cpu",
    seed=None,
    slow_decay=False,
    n_states=None,
    generator_device=None,
    gate=DEFAULT_GATE,
    extreme=False,
) -> dict:
    """q, k, v, g ~ N(0,1) bf16, β ~ N(0,1) bf16, A_log = log U(1,16), dt_bias ~ 0.1·N(0,1)
    (the module docstring has the details), as a dict of ``kda_prefill`` keyword arguments with
    ``lower_bound``; ``n_states``: also ``initial_state`` ~ 0.1·N(0,1) fp32 for that many sequences.

    Drawn on ``generator_device`` (default: ``device`` itself, since multi-GB inputs would take
    minutes to draw on a CPU), then moved to ``device``; ``generator_device="cpu"`` gives the same
    values whatever ``device`` is."""
    draw = device if generator_device is None else generator_device
    gen = torch.Generator(device=draw).manual_seed(fresh_seed() if seed is None else seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=draw)

    shape = (batch, seq_len, heads, HEAD_DIM)
    inputs = {
        "q": randn(*shape).to(torch.bfloat16),
        "k": randn(*shape).to(torch.bfloat16),
        "v": randn(*shape).to(torch.bfloat16),
        "g": randn(*shape).to(torch.bfloat16),
        "beta": randn(batch, seq_len, heads).to(torch.bfloat16),
    }
    if slow_decay:
        inputs["A_log"], lower_bound = torch.full((heads,), -4.0, device=draw), -0.05
    else:
        inputs["A_log"], lower_bound = torch.log(torch.rand(heads, generator=gen, device=draw) * 15 + 1), -5.0
    inputs["dt_bias"] = 0.1 * randn(heads, HEAD_DIM)
    if n_states is not None:
        inputs["initial_state"] = 0.1 * randn(n_states, heads, HEAD_DIM, HEAD_DIM)
    if extreme:
        if bounded(gate):
            raise ValueError("extreme decay needs an unbounded gate ('softplus' or 'precomputed')")
        pick = torch.randint(0, 3, shape, generator=gen, device=draw)
        fast = 20.0 + 10.0 * torch.rand(*shape, generator=gen, device=draw)
        g = torch.where(pick == 0, fast, torch.where(pick == 1, torch.full_like(fast, -20.0), randn(*shape)))
        inputs["g"] = g.to(torch.bfloat16)
        inputs["A_log"] = torch.full((heads,), math.log(16.0), device=draw)
        inputs["dt_bias"] = torch.zeros(heads, HEAD_DIM, device=draw)
    inputs = {name: t.to(device) for name, t in inputs.items()}
    if gate == "safe":
        inputs["lower_bound"] = lower_bound
        return inputs
    if gate == "precomputed":
        log_decay = reference.gate(inputs["g"], inputs.pop("A_log"), inputs.pop("dt_bias"), None, "softplus")
        inputs["g"] = log_decay.to(torch.bfloat16)
    elif gate not in GATES:
        raise ValueError(f"gate must be one of {GATES}, got {gate!r}")
    inputs["gate"] = gate
    return inputs


def cu_seqlens_of(lengths, device="cpu") -> torch.Tensor:
    """``cu_seqlens`` (int32, ``[len(lengths) + 1]``) of sequences of these lengths: 0, then the running sums."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)
