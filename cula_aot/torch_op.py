"""``torch.ops.cula_aot.kda_prefill``: the prefill as a torch.library custom op.

Functional (allocates its outputs), with a fake implementation so it traces under
``torch.compile`` and ``torch.export``, and CUDA-graph capturable (the serial path reads nothing
back to the host, also with only a device ``cu_seqlens``).  The final state is always
returned; it is an empty ``[0]`` tensor unless ``output_final_state``.  ``intracard_cp``:
-1 = "auto", 0 = off, n ≥ 1 = s_split.  All four ops take ``gate`` ("safe", "softplus",
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

``torch.ops.cula_aot.kda_decode_layer``: the fused layer step (``cula_aot.kda_decode_layer``)
with a packed conv weight and conv-state pool (``conv_state``, ``state_pool`` and, when given,
the draft records and marks are declared mutated); returns a new output shaped like ``v``.

The four schemas share their leading inputs (``INPUTS``, written once), and the schemas are the
one spelling of the ops' arguments: the CUDA kernels and the fake (meta) implementations take
them by name as the schema binds them (``_bind``) and hand them to ``PrefillCall.of`` /
``DecodeCall.of`` / ``DecodeLayerCall.of``.
"""

import torch

from .gates import DEFAULT_GATE
from .layout import D
from .ops import decode, decode_layer, prefill
from .ops.call import DecodeCall, DecodeLayerCall, PrefillCall

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
    f'float? scale=None, int? num_tokens=None, str state_layout="vk", {CONVENTIONS}, '
    f"Tensor? num_accepted=None) -> Tensor",
    "kda_decode_layer": f"({INPUTS}, Tensor conv_weight, Tensor(a!) conv_state, Tensor out_gate, "
    f"Tensor norm_weight, Tensor(b!) state_pool, Tensor state_indices, Tensor? conv_bias=None, "
    f'str conv_layout="dim", float norm_eps=1e-05, float? scale=None, int? num_tokens=None, '
    f'str state_layout="vk", {CONVENTIONS}, Tensor(c!)? draft_records=None, Tensor(d!)? draft_marks=None, '
    f"Tensor? num_accepted=None, bool verify=False) -> Tensor",
}
for _name, _schema in SCHEMAS.items():
    torch.library.define(f"cula_aot::{_name}", _schema)

# Each op's arguments by position, with the schema's defaults.
_ARGUMENTS = {
    name: [
        (a.name, a.default_value if a.has_default_value() else None) for a in torch._C.parse_schema(f"x{s}").arguments
    ]
    for name, s in SCHEMAS.items()
}


def _bind(op: str, args: tuple, kwargs: dict) -> dict:
    """``op``'s arguments by name, as its schema binds ``args`` and ``kwargs`` (defaults filled)."""
    names = _ARGUMENTS[op]
    bound = {name: default for name, default in names[len(args) :]}
    bound.update(zip((name for name, _ in names), args))
    bound.update(kwargs)
    return bound


def kda_prefill_op(*args, **kwargs):
    options = _bind("kda_prefill", args, kwargs)
    options["intracard_cp"] = _CP_MODES.get(options["intracard_cp"], options["intracard_cp"])
    o, final_state = prefill.run(PrefillCall.of(options))
    return o, (final_state if final_state is not None else options["q"].new_empty(0, dtype=torch.float32))


def fake_prefill(*args, **kwargs):
    a = _bind("kda_prefill", args, kwargs)
    q, cu_seqlens = a["q"], a["cu_seqlens"]
    num_seqs = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    final_shape = (num_seqs, q.shape[2], D, D) if a["output_final_state"] else (0,)
    return torch.empty_like(a["v"]), q.new_empty(final_shape, dtype=torch.float32)


def kda_prefill_pool_op(*args, **kwargs):
    options = _bind("kda_prefill_pool", args, kwargs)
    pool = options.pop("state_pool")
    o, _ = prefill.run(PrefillCall.of({**options, "initial_state": pool, "final_state": pool, "intracard_cp": False}))
    return o


def fake_prefill_pool(*args, **kwargs):
    q = _bind("kda_prefill_pool", args, kwargs)["q"]
    return torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)


def kda_decode_op(*args, **kwargs):
    return decode.run(DecodeCall.of(_bind("kda_decode", args, kwargs)))


def fake_decode(*args, **kwargs):
    v = _bind("kda_decode", args, kwargs)["v"]
    return torch.empty(v.shape, dtype=torch.bfloat16, device=v.device)


def kda_decode_layer_op(*args, **kwargs):
    options = _bind("kda_decode_layer", args, kwargs)
    records, marks = options.pop("draft_records"), options.pop("draft_marks")
    options["drafts"] = None if records is None and marks is None else (records, marks)
    return decode_layer.run(DecodeLayerCall.of(options))


def fake_decode_layer(*args, **kwargs):
    v = _bind("kda_decode_layer", args, kwargs)["v"]
    return torch.empty(v.shape, dtype=torch.bfloat16, device=v.device)


# Each op's CUDA implementation and shape-only implementation, by name (a CPU test checks the
# schemas with the fakes, and the implementations' calls against the eager entry points').
IMPLS = {
    "kda_prefill": kda_prefill_op,
    "kda_prefill_pool": kda_prefill_pool_op,
    "kda_decode": kda_decode_op,
    "kda_decode_layer": kda_decode_layer_op,
}
FAKES = {
    "kda_prefill": fake_prefill,
    "kda_prefill_pool": fake_prefill_pool,
    "kda_decode": fake_decode,
    "kda_decode_layer": fake_decode_layer,
}
for _name in SCHEMAS:
    torch.library.impl(f"cula_aot::{_name}", "cuda")(IMPLS[_name])
    torch.library.register_fake(f"cula_aot::{_name}")(FAKES[_name])
