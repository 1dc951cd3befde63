"""``torch.ops.cula_aot.kda_prefill``: the prefill as a torch.library custom op.

Functional (allocates its outputs), with a fake implementation so it traces under
``torch.compile`` and ``torch.export``, and CUDA-graph capturable (the serial path reads nothing
back to the host, also with only a device ``cu_seqlens``).  The final state is always
returned; it is an empty ``[0]`` tensor unless ``output_final_state``.  ``intracard_cp``:
-1 = "auto", 0 = off, n ≥ 1 = s_split.  All three ops take ``gate`` ("safe", "softplus",
"precomputed"), ``beta_sigmoid`` and ``qk_l2norm`` as ``cula_aot.kda_prefill`` does (A_log, dt_bias
and lower_bound may then be None).

``torch.ops.cula_aot.kda_prefill_pool``: the serving form over a state pool, updated in place
(declared mutated, so torch.compile orders it): sequence n continues from
``state_pool[state_indices[n]]`` and writes its final state back (index < 0: zero start, no
write).  Sync-free with a device ``cu_seqlens``; returns the output.  With ``checkpoint_every``
it also writes prefix-cache checkpoints into ``checkpoint_pool`` (declared mutated; see
``cula_aot.kda_prefill``).

``torch.ops.cula_aot.kda_decode``: the decode step (``cula_aot.kda_decode``) over a state pool,
updated in place (``state_pool`` and, when given, ``intermediate_states`` are declared mutated);
returns a new output shaped like ``v``.  ``intermediate_states`` is positional and required
(pass None).  Sync-free and capturable like the eager entry.

The three schemas share their leading inputs (``INPUTS``, written once); the CUDA kernels and
the fake (meta) implementations are registered on them by name.
"""

import torch

from .gates import DEFAULT_GATE
from .layout import D
from .ops import decode, prefill
from .ops.call import DecodeCall, PrefillCall

_CP_MODES = {-1: "auto", 0: False}
# The leading inputs of every op, as ``cula_aot.kda_prefill`` takes them.
INPUTS = "Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, float? lower_bound"
# The trailing options of every op: the gate and the input conventions.
CONVENTIONS = f'str gate="{DEFAULT_GATE}", bool beta_sigmoid=True, bool qk_l2norm=True'
SCHEMAS = {
    "kda_prefill": f"({INPUTS}, float? scale=None, Tensor? initial_state=None, bool output_final_state=False, "
    f'Tensor? cu_seqlens=None, Tensor? cu_seqlens_cpu=None, str state_layout="vk", '
    f"int intracard_cp=0, {CONVENTIONS}) -> (Tensor, Tensor)",
    "kda_prefill_pool": f"({INPUTS}, Tensor(a!) state_pool, Tensor state_indices, float? scale=None, "
    f'Tensor? cu_seqlens=None, str state_layout="vk", {CONVENTIONS}, int checkpoint_every=0, '
    f"Tensor(b!)? checkpoint_pool=None, Tensor? checkpoint_indices=None, "
    f"Tensor? checkpoint_offsets=None) -> Tensor",
    "kda_decode": f"({INPUTS}, Tensor(a!) state_pool, Tensor state_indices, Tensor(b!)? intermediate_states, "
    f'float? scale=None, int? num_tokens=None, str state_layout="vk", {CONVENTIONS}) -> Tensor',
}
for _name, _schema in SCHEMAS.items():
    torch.library.define(f"cula_aot::{_name}", _schema)


@torch.library.impl("cula_aot::kda_prefill", "cuda")
def kda_prefill_op(
    q,
    k,
    v,
    g,
    beta,
    A_log,
    dt_bias,
    lower_bound,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    cu_seqlens_cpu=None,
    state_layout="vk",
    intracard_cp=0,
    gate=DEFAULT_GATE,
    beta_sigmoid=True,
    qk_l2norm=True,
):
    options = locals()
    options["intracard_cp"] = _CP_MODES.get(intracard_cp, intracard_cp)
    o, final_state = prefill.run(PrefillCall.build(**options))
    return o, (final_state if final_state is not None else q.new_empty(0, dtype=torch.float32))


@torch.library.register_fake("cula_aot::kda_prefill")
def fake_prefill(
    q,
    k,
    v,
    g,
    beta,
    A_log,
    dt_bias,
    lower_bound,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    cu_seqlens_cpu=None,
    state_layout="vk",
    intracard_cp=0,
    gate=DEFAULT_GATE,
    beta_sigmoid=True,
    qk_l2norm=True,
):
    heads = q.shape[2]
    num_seqs = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    final_shape = (num_seqs, heads, D, D) if output_final_state else (0,)
    return torch.empty_like(v), q.new_empty(final_shape, dtype=torch.float32)


@torch.library.impl("cula_aot::kda_prefill_pool", "cuda")
def kda_prefill_pool_op(
    q,
    k,
    v,
    g,
    beta,
    A_log,
    dt_bias,
    lower_bound,
    state_pool,
    state_indices,
    scale=None,
    cu_seqlens=None,
    state_layout="vk",
    gate=DEFAULT_GATE,
    beta_sigmoid=True,
    qk_l2norm=True,
    checkpoint_every=0,
    checkpoint_pool=None,
    checkpoint_indices=None,
    checkpoint_offsets=None,
):
    options = locals()
    state_pool, state_indices = options.pop("state_pool"), options.pop("state_indices")
    o, _ = prefill.run(
        PrefillCall.build(
            **options,
            initial_state=state_pool,
            final_state=state_pool,
            state_indices=state_indices,
            intracard_cp=False,
        )
    )
    return o


@torch.library.register_fake("cula_aot::kda_prefill_pool")
def fake_prefill_pool(
    q,
    k,
    v,
    g,
    beta,
    A_log,
    dt_bias,
    lower_bound,
    state_pool,
    state_indices,
    scale=None,
    cu_seqlens=None,
    state_layout="vk",
    gate=DEFAULT_GATE,
    beta_sigmoid=True,
    qk_l2norm=True,
    checkpoint_every=0,
    checkpoint_pool=None,
    checkpoint_indices=None,
    checkpoint_offsets=None,
):
    return torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)


@torch.library.impl("cula_aot::kda_decode", "cuda")
def kda_decode_op(
    q,
    k,
    v,
    g,
    beta,
    A_log,
    dt_bias,
    lower_bound,
    state_pool,
    state_indices,
    intermediate_states,
    scale=None,
    num_tokens=None,
    state_layout="vk",
    gate=DEFAULT_GATE,
    beta_sigmoid=True,
    qk_l2norm=True,
):
    return decode.run(DecodeCall.build(**locals()))


@torch.library.register_fake("cula_aot::kda_decode")
def fake_decode(
    q,
    k,
    v,
    g,
    beta,
    A_log,
    dt_bias,
    lower_bound,
    state_pool,
    state_indices,
    intermediate_states,
    scale=None,
    num_tokens=None,
    state_layout="vk",
    gate=DEFAULT_GATE,
    beta_sigmoid=True,
    qk_l2norm=True,
):
    return torch.empty(v.shape, dtype=torch.bfloat16, device=v.device)


# Each op's shape-only implementation, by name (a CPU test checks the schemas with them).
FAKES = {"kda_prefill": fake_prefill, "kda_prefill_pool": fake_prefill_pool, "kda_decode": fake_decode}
