"""The parameter ABI every kernel spec declares (no cutlass, no GPU): parameter kinds, the TMA
recipe of the token inputs, the base specialization class, and the parameter groups several
kernels share.  The build cross-checks each declared list against the ``.entry`` of the PTX it
produced and writes it, with the offsets ptxas chose, into ``manifest.json``.
"""

import dataclasses
import functools
from typing import ClassVar

from ..gates import DEFAULT_GATE, GATES
from ..layout import CHUNK, D, INPUT_BLOCK_COLS

ARCH = "sm_90a"
# The CuTeDSL release the kernels, their ABI declarations and the manifest are keyed on
# (pyproject's ``build`` extra pins the same version; a test checks they agree).
CUTEDSL_VERSION = "4.8.1"

# Parameter kinds: a global pointer (element dtype, address alignment the kernel assumes), a
# scalar passed by value, or a TMA descriptor (a CUtensorMap passed by value, with the recipe
# the runtime encodes it from).  Sizes and alignments are those of the PTX ``.param`` space.
# Each parameter also declares whether a call supplies it (``per_call``): a launch template
# (``runtime.loader.LaunchTemplate``) packs the others once, from its call signature, and fills
# only these per launch.  Pointers and descriptor sources are per call; scalars are static
# unless declared otherwise (``scale`` and ``lower_bound`` are).
POINTER_ALIGN = 16
SCALAR_TYPES = {"i32": (4, ".u32"), "f32": (4, ".f32")}
TMA_DESCRIPTOR_BYTES = 128
TMA_DESCRIPTOR_ALIGN = 64


@dataclasses.dataclass(frozen=True)
class Param:
    name: str
    kind: str  # "pointer", "scalar" or "tma_descriptor"
    dtype: str  # element dtype of a pointer or descriptor, value dtype of a scalar
    recipe: tuple = ()  # tma_descriptor only: sorted (key, value) pairs, see token_tma_recipe
    # A call supplies the value (a descriptor: the tensor it is encoded from); otherwise it is
    # fixed by a launch template's call signature.
    per_call: bool = False
    # A pointer's address alignment, which the kernel is compiled to assume and the runtime checks.
    address_align: int = POINTER_ALIGN

    @property
    def size(self) -> int:
        if self.kind == "tma_descriptor":
            return TMA_DESCRIPTOR_BYTES
        return 8 if self.kind == "pointer" else SCALAR_TYPES[self.dtype][0]

    @property
    def align(self) -> int:
        return TMA_DESCRIPTOR_ALIGN if self.kind == "tma_descriptor" else self.size


def pointer(name: str, dtype: str, address_align: int = POINTER_ALIGN) -> Param:
    """A global pointer: an address of this call's tensors, so always per call; 16-byte aligned
    unless the kernel reads it element by element at any address (``address_align``)."""
    return Param(name, "pointer", dtype, per_call=True, address_align=address_align)


def scalar(name: str, dtype: str, *, per_call: bool = False) -> Param:
    """A scalar passed by value; ``per_call``: supplied by each launch (else fixed by the launch
    template's call signature: lengths, strides, slot counts, flags)."""
    return Param(name, "scalar", dtype, per_call=per_call)


def token_tma(name: str, source: str) -> Param:
    """Descriptor for the 16×128 bf16 tiles of a token-major [rows, H, 128] tensor ``source``,
    one tile per copy as a 3-D box (32 columns, 16 rows, 4 column blocks), so that shared memory
    holds the tile block by block (``kernels.common.input_tile_layout``).

    The recipe is written in ``cuTensorMapEncodeTiled`` order (dimension 0 innermost); each
    entry is an int or the name of a runtime value (``rows`` = tokens, ``row_blocks`` = H·4
    32-column blocks, ``<source>_row_bytes`` = that tensor's token stride in bytes: H·256 when
    contiguous, more for a view cut from a fused projection).  It matches the PTX:
    ``cp.async.bulk.tensor.3d`` with coordinates {0, first row, 4·head}.
    """
    recipe = {
        "source": source,
        "dtype": "bf16",
        "rank": 3,
        "global_dims": [INPUT_BLOCK_COLS, "rows", "row_blocks"],
        "global_strides_bytes": [f"{source}_row_bytes", INPUT_BLOCK_COLS * 2],
        "box_dims": [INPUT_BLOCK_COLS, CHUNK, D // INPUT_BLOCK_COLS],
        "element_strides": [1, 1, 1],
        "interleave": "none",
        "swizzle": "none",
        "l2_promotion": "L2_256B",
        "oob_fill": "zeros",
    }
    return Param(
        name,
        "tma_descriptor",
        "bf16",
        tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in recipe.items())),
        per_call=True,  # the descriptor's address is the source tensor's, a call's
    )


def abi_layout(params) -> list[dict]:
    """Ordered ABI records with naturally aligned offsets.  The build replaces the offsets with
    the ones ptxas chose (``compiler.cubin.place_params``) before writing the manifest."""
    records, offset = [], 0
    for p in params:
        offset = -(-offset // p.align) * p.align
        record = {
            "name": p.name,
            "kind": p.kind,
            "dtype": p.dtype,
            "size": p.size,
            "align": p.align,
            "offset": offset,
            "per_call": p.per_call,
        }
        if p.kind == "pointer":
            record["address_align"] = p.address_align
        if p.kind == "tma_descriptor":
            record["recipe"] = {k: list(v) if isinstance(v, tuple) else v for k, v in p.recipe}
        records.append(record)
        offset += p.size
    return records


def gate_field():
    """The ``gate`` codegen field of a spec whose kernel computes the per-token decay (K1, the
    fused prefill, decode): one of ``gates.GATES``, default ``gates.DEFAULT_GATE``, validated with
    every other field that declares its choices (``KernelSpec.__post_init__``).  The kernel asks
    it through ``kernels.gate.Gate``."""
    return dataclasses.field(default=DEFAULT_GATE, metadata={"choices": GATES})


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """Base of all specializations: subclasses add their codegen fields."""

    kernel: ClassVar[str]
    params: ClassVar[tuple]
    # Kernel arguments fixed at trace time that lower to no parameter (e.g. static TMA
    # coordinate tensors): excluded from the ABI.
    static_args: ClassVar[tuple] = ()
    block: ClassVar[tuple] = (128, 1, 1)
    cluster: ClassVar[tuple] = (1, 1, 1)
    # Grid dimensions: an int or the name of a scalar parameter / codegen argument.
    grid: ClassVar[tuple]
    # The kernel runs ``griddepcontrol.wait`` before it reads anything the kernel before it on the
    # stream may write, so it may be launched as a programmatic dependent (PDL): its CTAs start
    # while that kernel drains.  The build checks the PTX for the instruction.
    dependent_launch: ClassVar[bool] = False

    def __post_init__(self):
        for field in dataclasses.fields(self):
            choices = field.metadata.get("choices")
            value = getattr(self, field.name)
            if choices is not None and value not in choices:
                raise ValueError(f"{type(self).__name__}: {field.name} must be one of {choices}, got {value!r}")

    @property
    def args(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @functools.cached_property
    def name(self) -> str:
        parts = [self.kernel]
        for key, value in self.args.items():
            parts.append(f"{key}{int(value) if isinstance(value, bool) else value}")
        return "_".join(parts)


# K1's outputs and K2's / pre_scan's inputs: the workspace records (``layout.WORKSPACE_RECORD_*``,
# bytes), then the sequence geometry both kernels read (``ops.prepare.workspace_values`` supplies
# all of them).
WORKSPACE_POINTERS = (pointer("workspace", "u8"),)
SEQUENCE_SCALARS = (scalar("seq_len", "i32"), scalar("num_seqs", "i32"), scalar("total_slots", "i32"))

# K1's inputs (also the fused prefill's): q, k, g through TMA descriptors, β and the gate parameters.
K1_INPUTS = (
    token_tma("tma_q", "q"),
    token_tma("tma_k", "k"),
    token_tma("tma_g", "g"),
    pointer("beta", "bf16"),
    pointer("a_log", "f32"),
    pointer("dt_bias", "f32"),
)


# The per-call scale and gate lower bound, then the flags (the input conventions,
# ``layout.FLAG_BETA_PROBABILITY`` and ``FLAG_QK_AS_GIVEN``, and the kernel's own bits): the tail of
# K1's and both decode kernels' lists (``kernels.params.TokenScalars``).
TOKEN_SCALARS = (
    scalar("scale", "f32", per_call=True),
    scalar("lower_bound", "f32", per_call=True),
    scalar("flags", "i32"),
)


# State tensors: S[k, v] of state ``index`` and head h at element
# ``index·slot_stride + h·128·128 + k·stride_k + v·stride_v`` (in elements of the state's dtype,
# fp32 or bf16 by ``flags``); pointers are declared f32 and recast in the kernel.
def state_params(which: str) -> tuple:
    return (
        scalar(f"{which}_slot_stride", "i32"),
        scalar(f"{which}_stride_k", "i32"),
        scalar(f"{which}_stride_v", "i32"),
    )


# Device-value bounds, last in every prefill kernel's list (so the parameters before them keep the
# offsets they had without them): the caller's status word (int32; ``layout.STATUS_*`` bits ORed
# in when the flags say it is given) and each state tensor's leading size, which bounds a pool
# index (one outside it is padding).
STATUS_POINTER = pointer("status", "i32")


def bound_params(*states: str) -> tuple:
    return (STATUS_POINTER, *(scalar(f"{which}_slots", "i32") for which in states))


# Prefix-cache checkpoints, after the bounds in K2 and the fused prefill: the checkpoint pool (a
# state tensor as above, ``checkpoint_slots`` slots), its int32 [N, checkpoint_columns] slot
# map, the optional int32 [N] token offsets, and the period in tokens (0: no checkpoints).
CHECKPOINT_PARAMS = (
    pointer("checkpoints", "f32"),
    pointer("checkpoint_indices", "i32"),
    pointer("checkpoint_offsets", "i32"),
    scalar("checkpoint_every", "i32"),
    scalar("checkpoint_columns", "i32"),
    scalar("checkpoint_slots", "i32"),
    *state_params("checkpoint"),
)
