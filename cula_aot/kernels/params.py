"""Device-side parameter groups: the runtime parameters several kernels share, each spelled once.

A kernel takes a group as one argument (``checkpoint: Checkpoints``) and its helpers take the same
bundle, where the flat list would repeat a dozen names in every kernel and helper.  The groups are
``typing.NamedTuple`` classes made with ``param_group``, each tied to the ``specs`` declaration of
its parameters (``abi``), and the kernel classes' launches build them from their flat ``*params``
with ``grouped`` (docs/DESIGN.md, Parameter groups).

What CuTeDSL 4.8.1 does with a NamedTuple argument of a ``@cute.kernel`` (checked by compiling the
kernels and comparing the cubins): it flattens the fields, depth first, into the ``.entry``'s
parameter list in field order, exactly as the same values passed flat; and it names the entry from
``str`` of every positional argument (``kernel_cutlass_<name>_<one component per argument>_<n>``,
cut at 180 characters), where a NamedTuple's own ``str`` would put
``Checkpoints(pool=ptr<...>, ...)`` in the symbol.  ``param_group`` gives each group the ``str`` of
its fields joined by ``_``, the components they contribute as flat arguments, so grouping changes
neither the parameter list, nor the symbol, nor a byte of the cubin.
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute

from ..specs.abi import CHECKPOINT_PARAMS, TOKEN_SCALARS, bound_params, state_params
from ..specs.fused_prefill import PIECE_PARAMS
from ..specs.decode import DECODE_GEOMETRY, DECODE_TENSORS, STEP_TENSORS
from ..specs.decode_layer import LAYER_CONV_GEOMETRY, LAYER_TENSORS


def _flat_str(group) -> str:
    return "_".join(map(str, group))


def param_group(abi):
    """Class decorator for a NamedTuple of kernel parameters: ``abi(name)`` is the ``specs``
    declaration of the parameters a kernel argument ``name`` of this group stands for (checked
    against the fields by ``kernels.declared_names_match``)."""

    def make(cls):
        cls.__str__ = _flat_str
        cls.abi = staticmethod(abi)
        return cls

    return make


def is_group(annotation) -> bool:
    return isinstance(annotation, type) and hasattr(annotation, "abi") and hasattr(annotation, "_fields")


def leaf_count(group: type) -> int:
    """The flat parameters a group stands for (nested groups counted by their fields)."""
    return sum(leaf_count(a) if is_group(a) else 1 for a in group.__annotations__.values())


def _build(group: type, values: list):
    fields = []
    for annotation in group.__annotations__.values():
        if is_group(annotation):
            n = leaf_count(annotation)
            fields.append(_build(annotation, values[:n]))
            values = values[n:]
        else:
            fields.append(values[0])
            values = values[1:]
    return group(*fields)


def grouped(kernel, *params) -> list:
    """``params``, the flat runtime arguments of ``kernel`` in its order, with each run a group
    parameter stands for built into that group (a kernel class's launch: ``self.kernel(*grouped(
    self.kernel, ..., *params), static and codegen arguments)``)."""
    import inspect

    values, out = list(params), []
    for parameter in inspect.signature(inspect.unwrap(kernel)).parameters.values():
        if parameter.name == "self":
            continue
        if not values:
            break
        if is_group(parameter.annotation):
            n = leaf_count(parameter.annotation)
            out.append(_build(parameter.annotation, values[:n]))
            values = values[n:]
        else:
            out.append(values.pop(0))
    return out + values


@param_group(state_params)
class StateStrides(NamedTuple):
    """A state tensor's element strides (``specs.state_params``): state ``index`` of head h at
    ``index·slot_stride + h·128·128 + k·stride_k + v·stride_v``."""

    slot_stride: cutlass.Int32
    stride_k: cutlass.Int32
    stride_v: cutlass.Int32


@param_group(lambda name: bound_params("init", "final"))
class PoolBounds(NamedTuple):
    """The caller's status word and the initial and final state pools' leading sizes
    (``specs.bound_params``): a pool index outside them is padding."""

    status: cute.Pointer
    init_slots: cutlass.Int32
    final_slots: cutlass.Int32


@param_group(lambda name: CHECKPOINT_PARAMS)
class Checkpoints(NamedTuple):
    """Prefix-cache checkpoints (``specs.CHECKPOINT_PARAMS``): the pool of ``slots`` states, its
    int32 [N, columns] slot map, the optional int32 [N] token offsets, the period in tokens."""

    pool: cute.Pointer
    indices: cute.Pointer
    offsets: cute.Pointer
    every: cutlass.Int32
    columns: cutlass.Int32
    slots: cutlass.Int32
    strides: StateStrides


@param_group(lambda name: PIECE_PARAMS)
class PieceTables(NamedTuple):
    """The fused pieces kernel's tables (``specs.PIECE_PARAMS``): the piece rows, one ready flag
    per (row, head) item and the items' published end states."""

    segments: cute.Pointer
    ready: cute.Pointer
    carries: cute.Pointer


@param_group(lambda name: TOKEN_SCALARS)
class TokenScalars(NamedTuple):
    """The per-call scale and gate lower bound, and the flags (``specs.TOKEN_SCALARS``): K1's and
    the decode kernels' last parameters."""

    scale: cutlass.Float32
    lower_bound: cutlass.Float32
    flags: cutlass.Int32


@param_group(lambda name: STEP_TENSORS)
class StepTensors(NamedTuple):
    """The KDA step's tensors (``specs.STEP_TENSORS``), the decode kernels' and the fused layer's
    first parameters: the token inputs, the gate parameters, the slot indices and the pool."""

    q: cute.Pointer
    k: cute.Pointer
    v: cute.Pointer
    g: cute.Pointer
    beta: cute.Pointer
    a_log: cute.Pointer
    dt_bias: cute.Pointer
    state_indices: cute.Pointer
    state_pool: cute.Pointer


@param_group(lambda name: DECODE_TENSORS)
class DecodeTensors(NamedTuple):
    """The decode kernels' tensors (``specs.DECODE_TENSORS``): the step's, the intermediate states,
    the outputs, the status word and the accepted tokens per sequence."""

    step: StepTensors
    intermediate: cute.Pointer
    out: cute.Pointer
    status: cute.Pointer
    num_accepted: cute.Pointer


@param_group(lambda name: DECODE_GEOMETRY)
class DecodeGeometry(NamedTuple):
    """Sizes, strides and offsets of ``DecodeTensors`` (``specs.DECODE_GEOMETRY``): N, T, the pool's
    slot count and slot stride, each input's sequence and token strides, the element offsets of β
    and state_indices, the output's strides."""

    num_seqs: cutlass.Int32
    num_tokens: cutlass.Int32
    num_slots: cutlass.Int32
    slot_stride: cutlass.Int32
    q_stride_n: cutlass.Int32
    q_stride_t: cutlass.Int32
    k_stride_n: cutlass.Int32
    k_stride_t: cutlass.Int32
    v_stride_n: cutlass.Int32
    v_stride_t: cutlass.Int32
    g_stride_n: cutlass.Int32
    g_stride_t: cutlass.Int32
    beta_stride_n: cutlass.Int32
    beta_stride_t: cutlass.Int32
    beta_offset: cutlass.Int32
    index_offset: cutlass.Int32
    out_stride_n: cutlass.Int32
    out_stride_t: cutlass.Int32


@param_group(lambda name: LAYER_TENSORS)
class LayerTensors(NamedTuple):
    """The fused decode layer's tensors (``specs.LAYER_TENSORS``): the step's, the output and the
    status word, the output gate's input, and q's, k's and v's conv states, conv weights and
    biases, the RMSNorm weight (dtypes by ``flags``), the draft records and marks and the
    accepted tokens per sequence."""

    step: StepTensors
    out: cute.Pointer
    status: cute.Pointer
    out_gate: cute.Pointer
    conv_state_q: cute.Pointer
    conv_state_k: cute.Pointer
    conv_state_v: cute.Pointer
    conv_weight_q: cute.Pointer
    conv_weight_k: cute.Pointer
    conv_weight_v: cute.Pointer
    conv_bias_q: cute.Pointer
    conv_bias_k: cute.Pointer
    conv_bias_v: cute.Pointer
    norm_weight: cute.Pointer
    draft_records: cute.Pointer
    draft_marks: cute.Pointer
    num_accepted: cute.Pointer


@param_group(lambda name: LAYER_CONV_GEOMETRY)
class ConvGeometry(NamedTuple):
    """The conv states' element strides and the output gate's sequence and token strides
    (``specs.LAYER_CONV_GEOMETRY``)."""

    slot_stride: cutlass.Int32
    channel_stride: cutlass.Int32
    tap_stride: cutlass.Int32
    out_gate_stride_n: cutlass.Int32
    out_gate_stride_t: cutlass.Int32
