"""``torch.ops.cula_aot.kda_prefill``: the prefill as a torch.library custom op.

Functional (allocates its outputs), with a fake implementation so it traces under
``torch.compile`` and ``torch.export``, and CUDA-graph capturable (the serial path reads nothing
back to the host, also with only a device ``cu_seqlens``).  The final state is always
returned; it is an empty ``[0]`` tensor unless ``output_final_state``.  ``intracard_cp``:
-1 = "auto", 0 = off, n ≥ 1 = s_split.  All three ops take ``gate`` ("safe", "softplus",
"precomputed") as ``cula_aot.kda_prefill`` does (A_log, dt_bias and lower_bound may then be None).

``torch.ops.cula_aot.kda_prefill_pool``: the serving form over a state pool, updated in place
(declared mutated, so torch.compile orders it): sequence n continues from
``state_pool[state_indices[n]]`` and writes its final state back (index < 0: zero start, no
write).  Sync-free with a device ``cu_seqlens``; returns the output.

``torch.ops.cula_aot.kda_decode``: the decode step (``cula_aot.kda_decode``) over a state pool,
updated in place (``state_pool`` and, when given, ``intermediate_states`` are declared mutated);
returns a new output shaped like ``v``.  ``intermediate_states`` is positional and required
(pass None): torch 2.11's custom-op wrapper indexes every mutated argument among the positional
ones and fails on an omitted optional one.  Sync-free and capturable like the eager entry.
"""

import torch

from .layout import D
from .ops.decode import decode
from .ops.prefill import prefill

_CP_MODES = {-1: "auto", 0: False}


@torch.library.custom_op("cula_aot::kda_prefill", mutates_args=(), device_types="cuda")
def kda_prefill_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    lower_bound: float | None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    state_layout: str = "vk",
    intracard_cp: int = 0,
    gate: str = "safe",
) -> tuple[torch.Tensor, torch.Tensor]:
    o, final_state = prefill(
        q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, scale=scale,
        initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu, state_layout=state_layout,
        intracard_cp=_CP_MODES.get(intracard_cp, intracard_cp), gate=gate)
    return o, (final_state if final_state is not None else q.new_empty(0, dtype=torch.float32))


@kda_prefill_op.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale=None, initial_state=None, output_final_state=False,
      cu_seqlens=None, cu_seqlens_cpu=None, state_layout="vk", intracard_cp=0, gate="safe"):
    heads = q.shape[2]
    num_seqs = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    final_shape = (num_seqs, heads, D, D) if output_final_state else (0,)
    return torch.empty_like(v), q.new_empty(final_shape, dtype=torch.float32)


@torch.library.custom_op("cula_aot::kda_prefill_pool", mutates_args=("state_pool",), device_types="cuda")
def kda_prefill_pool_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    lower_bound: float | None,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    state_layout: str = "vk",
    gate: str = "safe",
) -> torch.Tensor:
    o, _ = prefill(
        q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, scale=scale,
        initial_state=state_pool, final_state=state_pool, state_indices=state_indices, cu_seqlens=cu_seqlens,
        state_layout=state_layout, intracard_cp=False, gate=gate)
    return o


@kda_prefill_pool_op.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, lower_bound, state_pool, state_indices, scale=None, cu_seqlens=None,
      state_layout="vk", gate="safe"):
    return torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)


@torch.library.custom_op("cula_aot::kda_decode", mutates_args=("state_pool", "intermediate_states"),
                         device_types="cuda")
def kda_decode_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    lower_bound: float | None,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    intermediate_states: torch.Tensor | None,
    scale: float | None = None,
    num_tokens: int | None = None,
    state_layout: str = "vk",
    gate: str = "safe",
) -> torch.Tensor:
    return decode(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, scale=scale,
                  state_pool=state_pool, state_indices=state_indices, num_tokens=num_tokens,
                  state_layout=state_layout, intermediate_states=intermediate_states, gate=gate)


@kda_decode_op.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, lower_bound, state_pool, state_indices, intermediate_states, scale=None,
      num_tokens=None, state_layout="vk", gate="safe"):
    return torch.empty(v.shape, dtype=torch.bfloat16, device=v.device)
