"""Kernel specializations and their declared parameter ABI (no cutlass, no GPU).

A specialization fixes every code-generation argument of one kernel; its ``name`` is derived
from all of them, so two different cubins can never share a name.  The parameter list is the
ABI the runtime packs: the build cross-checks it against the ``.entry`` of the PTX it produced
and writes it, with offsets, into ``manifest.json``.
"""

import dataclasses
import functools
from typing import ClassVar

from .layout import CHUNK, D, INPUT_BLOCK_COLS


DEFAULT_HEADS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128)
ARCH = "sm_90a"
# The CuTeDSL release the kernels, their ABI declarations and the manifest are keyed on
# (pyproject's ``build`` extra pins the same version; a test checks they agree).
CUTEDSL_VERSION = "4.8.1"

# Parameter kinds: a global pointer (element dtype, address alignment the kernel assumes), a
# scalar passed by value, or a TMA descriptor (a CUtensorMap passed by value, with the recipe
# the runtime encodes it from).  Sizes and alignments are those of the PTX ``.param`` space.
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

    @property
    def size(self) -> int:
        if self.kind == "tma_descriptor":
            return TMA_DESCRIPTOR_BYTES
        return 8 if self.kind == "pointer" else SCALAR_TYPES[self.dtype][0]

    @property
    def align(self) -> int:
        return TMA_DESCRIPTOR_ALIGN if self.kind == "tma_descriptor" else self.size


def pointer(name: str, dtype: str) -> Param:
    return Param(name, "pointer", dtype)


def scalar(name: str, dtype: str) -> Param:
    return Param(name, "scalar", dtype)


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
    return Param(name, "tma_descriptor", "bf16", tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                                                              for k, v in recipe.items())))


def abi_layout(params) -> list[dict]:
    """Ordered ABI records with naturally aligned offsets.  The build replaces the offsets with
    the ones ptxas chose (``compiler.cubin.place_params``) before writing the manifest."""
    records, offset = [], 0
    for p in params:
        offset = -(-offset // p.align) * p.align
        record = {"name": p.name, "kind": p.kind, "dtype": p.dtype, "size": p.size, "align": p.align, "offset": offset}
        if p.kind == "pointer":
            record["address_align"] = POINTER_ALIGN
        if p.kind == "tma_descriptor":
            record["recipe"] = {k: list(v) if isinstance(v, tuple) else v for k, v in p.recipe}
        records.append(record)
        offset += p.size
    return records


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
K1_PARAMS = (
    *K1_INPUTS,
    pointer("cu_seqlens", "i32"),
    *WORKSPACE_POINTERS,
    *SEQUENCE_SCALARS,
    scalar("beta_row_stride", "i32"),
    scalar("tiles_per_cta", "i32"),
    scalar("scale", "f32"),
    scalar("lower_bound", "f32"),
)


@dataclasses.dataclass(frozen=True)
class K1Spec(KernelSpec):
    """K1 prepare: one CTA per ``tiles_per_cta`` consecutive tile slots of one head."""

    kernel: ClassVar[str] = "k1_prepare"
    params: ClassVar[tuple] = K1_PARAMS
    static_args: ClassVar[tuple] = ("token_coords",)
    grid: ClassVar[tuple] = ("k1_ctas", "heads", 1)

    heads: int
    varlen: bool


# K1 CTAs resident per SM (registers), and the most tile slots one CTA walks: each CTA loads its
# next tiles while it computes one, so fewer, longer CTAs hide the load latency; the grid keeps
# K1_WAVES waves of resident CTAs so that it still spreads evenly over the SMs (one wave of
# 8-tile CTAs lost 4% on 32×256 H8; PERFORMANCE.md, K1 prepare).
K1_CTAS_PER_SM = 4
K1_MAX_TILES_PER_CTA = 8
K1_WAVES = 4


def k1_grid(total_slots: int, heads: int, sm_count: int) -> dict:
    """K1's launch values: ``tiles_per_cta`` (the fewest that fit all tiles into K1_WAVES waves
    of resident CTAs, at most K1_MAX_TILES_PER_CTA) and the grid's ``k1_ctas`` per head."""
    resident = K1_CTAS_PER_SM * sm_count * K1_WAVES
    tiles_per_cta = max(1, min(K1_MAX_TILES_PER_CTA, -(-(total_slots * heads) // resident)))
    return {"tiles_per_cta": tiles_per_cta, "k1_ctas": -(-total_slots // tiles_per_cta)}


# State tensors: S[k, v] of state ``index`` and head h at element
# ``index·slot_stride + h·128·128 + k·stride_k + v·stride_v`` (in elements of the state's dtype,
# fp32 or bf16 by ``flags``); pointers are declared f32 and recast in the kernel.  ``slots``: the
# tensor's leading size, which bounds a pool index (one outside it is padding).
def state_params(which: str) -> tuple:
    return (scalar(f"{which}_slots", "i32"), scalar(f"{which}_slot_stride", "i32"), scalar(f"{which}_stride_k", "i32"),
            scalar(f"{which}_stride_v", "i32"))


# The caller's status word (int32; ``layout.STATUS_*`` bits ORed in when the flags say it is given).
STATUS_POINTER = pointer("status", "i32")


K2_PARAMS = (
    pointer("v", "bf16"),
    pointer("out", "bf16"),
    pointer("initial_state", "f32"),
    pointer("final_state", "f32"),
    pointer("cu_seqlens", "i32"),
    pointer("segments", "i32"),
    pointer("state_indices", "i32"),
    STATUS_POINTER,
    *WORKSPACE_POINTERS,
    *SEQUENCE_SCALARS,
    scalar("v_row_stride", "i32"),
    scalar("out_row_stride", "i32"),
    *state_params("init"),
    *state_params("final"),
    scalar("flags", "i32"),
)

# V columns per K2 CTA that the build compiles; the runtime default is chosen by measurement
# (docs/PERFORMANCE.md).
K2_V_BLOCKS = (16, 32, 64)
# Cluster multicast (serial K2): the wide V block only, the one ``auto_v_block`` takes for grids of
# K2_WIDE_V_BLOCK_WAVES or more waves, where each record's L2 reads bound the kernel.  There it was 2–5% faster;
# on latency-bound grids (few CTAs per SM, 32 columns) the cluster's per-tile coupling made it
# 7–27% slower (PERFORMANCE.md, K2 recurrence).
K2_MULTICAST_V_BLOCKS = (64,)
K2_DEFAULT_V_BLOCK = 32
# Many-CTA serial calls take 64 columns instead: each CTA stages a tile's 13.9 KB of workspace
# for its V block, so halving the CTAs per (sequence, head) halves the L2 reads that bound those
# rows (ncu, H64 8×1024: L2 87% busy).  Chosen when the 32-column grid is at least
# K2_WIDE_V_BLOCK_WAVES waves of K2_CTAS_PER_SM resident CTAs (PERFORMANCE.md, K2 recurrence:
# with multicast the 64-column K2 won at 1.94 and 2.33 waves, H16 4×2048 + 16×128 and H64 6 seqs,
# by 7% and 3.5%, and lost 3–7% at 1.55, H8 32×256 and H32 8×1024).
K2_WIDE_V_BLOCK = 64
K2_WIDE_V_BLOCK_WAVES = 1.75
K2_WGMMA_V_BLOCK = 64
K2_CTAS_PER_SM = 5  # 32-column CTAs resident per SM (shared memory: 3 stages of 14.4 KB)


def auto_v_block(heads: int, num_seqs: int, sm_count: int) -> int:
    """The serial K2 V block for a call of ``num_seqs`` sequences × ``heads`` heads."""
    ctas = (128 // K2_DEFAULT_V_BLOCK) * heads * num_seqs
    waves = ctas / (K2_CTAS_PER_SM * sm_count)
    return K2_WIDE_V_BLOCK if waves >= K2_WIDE_V_BLOCK_WAVES else K2_DEFAULT_V_BLOCK


# The CP segmented K2: two warps per CTA share each staged tile (half the record traffic of
# 16-column CTAs, twice the warps per SM at five CTAs per SM): 5–31% faster on every CP row
# (PERFORMANCE.md, Intracard CP).  The planner counts its V blocks.
K2_SEGMENTED_V_BLOCK = 32
# Four warps per CTA (four CTAs per SM) for a launch whose 32-column grid would not fit one wave.
K2_SEGMENTED_WIDE_V_BLOCK = 64
K2_SEGMENTED_V_BLOCKS = (K2_SEGMENTED_V_BLOCK, K2_SEGMENTED_WIDE_V_BLOCK)
# Tiles a K2 CTA stages (stages − 1 in flight ahead of the one it computes).  Three, not four:
# 43–48 KB of shared memory instead of 58–64 KB fits five 16- or 32-column CTAs per SM instead
# of three (58 KB was 288 B over the four-CTA limit), and two tiles in flight still cover a bulk
# load (PERFORMANCE.md, K2 recurrence: the CP benchmark rows 12–34% faster, serial rows 3–9%).
K2_STAGES = 3
# One K2 warp per 16 V columns (the tensor-core M dimension).
K2_WARP_COLUMNS = 16


def k2_threads(v_block: int) -> int:
    """Threads per K2 CTA: one warp per ``K2_WARP_COLUMNS`` V columns."""
    return 32 * (v_block // K2_WARP_COLUMNS)


@dataclasses.dataclass(frozen=True)
class K2Spec(KernelSpec):
    """K2 recurrence: one CTA per (V block, head, sequence or CP segment)."""

    kernel: ClassVar[str] = "k2_recurrence"
    params: ClassVar[tuple] = K2_PARAMS
    dependent_launch: ClassVar[bool] = True

    heads: int
    varlen: bool
    v_block: int
    segmented: bool = False
    # The CP pre_scan's variant: no output (no qd, Mqk or O work), and each tile stages only the
    # record's first ``layout.PRESCAN_RECORD_BYTES``.
    prescan: bool = False
    stages: int = K2_STAGES
    # The V blocks of one (sequence, head) run as one thread-block cluster that loads each
    # tile's record once, multicast into every CTA (``K2_MULTICAST_V_BLOCKS``).
    multicast: bool = False
    # Sᵀ·kdᵀ, Sᵀ·qdᵀ and the state update as warpgroup MMAs (``wgmma``, B read from the stage
    # once per warpgroup instead of once per warp): v_block 64, the one warpgroup of 4 warps.
    wgmma: bool = False

    def __post_init__(self):
        if self.wgmma and self.v_block != K2_WGMMA_V_BLOCK:
            raise ValueError(f"K2Spec: wgmma=True needs v_block {K2_WGMMA_V_BLOCK} (one warpgroup), got {self.v_block}")
        if self.prescan and not self.segmented:
            raise ValueError("K2Spec: prescan=True needs segmented=True (the pre_scan runs segment-table rows)")
        if self.multicast and self.v_block not in K2_MULTICAST_V_BLOCKS:
            raise ValueError(f"K2Spec: multicast=True needs v_block in {K2_MULTICAST_V_BLOCKS}, got {self.v_block}")

    @property
    def cluster(self) -> tuple:
        return (128 // self.v_block, 1, 1) if self.multicast else (1, 1, 1)

    @property
    def grid(self) -> tuple:
        return (128 // self.v_block, "heads", "num_seqs")

    @property
    def block(self) -> tuple:
        return (k2_threads(self.v_block), 1, 1)


def serial_k2_spec(heads: int, varlen: bool, v_block: int) -> K2Spec:
    """The serial K2 for ``heads`` and ``v_block``: multicast where it is built, and warpgroup
    MMAs for the one-warpgroup V block (3.5–6% faster where ``auto_v_block`` takes it; on the
    few-CTA fixed rows, where 32 columns stay the pick, 64 with wgmma lost 6–9%: PERFORMANCE.md,
    K2 recurrence)."""
    return K2Spec(heads=heads, varlen=varlen, v_block=v_block, multicast=v_block in K2_MULTICAST_V_BLOCKS,
                  wgmma=v_block == K2_WGMMA_V_BLOCK)


def segmented_k2_spec(heads: int, v_block: int = K2_SEGMENTED_V_BLOCK, prescan: bool = False) -> K2Spec:
    """The CP segmented K2 for ``heads``: the segment recurrence, or (``prescan``) the pre_scan
    jobs, which write states only."""
    return K2Spec(heads=heads, varlen=True, v_block=v_block, segmented=True, prescan=prescan)


def segmented_v_block(heads: int, rows: int, sm_count: int) -> int:
    """The segmented K2's V block for a launch over ``rows`` segment-table rows: 32 columns, or
    64 once the 32-column grid exceeds one wave of ``K2_CTAS_PER_SM`` CTAs per SM (then 64
    holds it in one wave of four: H8 [8192, 2048] at s = 8, 896 pre_scan CTAs, 5% faster;
    PERFORMANCE.md, Intracard CP)."""
    ctas = (128 // K2_SEGMENTED_V_BLOCK) * heads * rows
    return K2_SEGMENTED_WIDE_V_BLOCK if ctas > K2_CTAS_PER_SM * sm_count else K2_SEGMENTED_V_BLOCK


# ---- the fused prefill (``kernels/fused_prefill.py``): K1's work and K2's chain in one CTA per
# (sequence, head), the tile records in shared memory ------------------------------------------
FUSED_PARAMS = (
    *K1_INPUTS,
    pointer("v", "bf16"),
    pointer("out", "bf16"),
    pointer("initial_state", "f32"),
    pointer("final_state", "f32"),
    pointer("cu_seqlens", "i32"),
    pointer("state_indices", "i32"),
    STATUS_POINTER,
    scalar("seq_len", "i32"),
    scalar("num_seqs", "i32"),
    scalar("beta_row_stride", "i32"),
    scalar("v_row_stride", "i32"),
    scalar("out_row_stride", "i32"),
    *state_params("init"),
    *state_params("final"),
    scalar("flags", "i32"),
    scalar("scale", "f32"),
    scalar("lower_bound", "f32"),
)
# Two producer warpgroups (tiles dealt round robin) and four record stages: one producer per
# CTA was 3–12% slower on every row (PERFORMANCE.md, Fused prefill).
FUSED_PRODUCERS = 2
FUSED_STAGES = 4
# Two producer warpgroups split the registers with the two consumer warpgroups (``setmaxnreg``):
# 2·128·(producer + consumer) = the SM's 64 K.
FUSED_PRODUCER_REGISTERS = 112
FUSED_CONSUMER_REGISTERS = 144


def fused_threads(producers: int) -> int:
    """``producers`` warpgroups running K1's work (tiles dealt round robin) and two consumer
    warpgroups (64 V columns each)."""
    return 128 * producers + 256


@dataclasses.dataclass(frozen=True)
class FusedSpec(KernelSpec):
    """Fused prefill: one CTA per (sequence, head), ``producers`` warpgroups preparing tiles
    into ``stages`` shared-memory stages and two consumer warpgroups running the chain."""

    kernel: ClassVar[str] = "fused_prefill"
    params: ClassVar[tuple] = FUSED_PARAMS
    static_args: ClassVar[tuple] = ("token_coords",)
    grid: ClassVar[tuple] = (1, "heads", "num_seqs")

    heads: int
    stages: int = FUSED_STAGES
    producers: int = FUSED_PRODUCERS

    @property
    def block(self) -> tuple:
        return (fused_threads(self.producers), 1, 1)


# The fused prefill runs one CTA per SM and (sequence, head) item at ~1.5 µs per tile,
# where K2 alone takes ~0.5: it wins once the items fill the GPU and are long enough that K1's
# workspace round trip outweighs the slower chain.  Measured (PERFORMANCE.md, Fused prefill):
# 0.82–0.96 of K1 then K2 at ≥ 0.97 waves of items with ≥ 64 tiles each (8×1024 at
# H16–H128, 16×1024, the benchmark's varlen rows); slower at half a wave (fixed 1×8192 at H64: 1.4×)
# and on ragged batches whose long sequences set the time (4×2048 + 16×128 at H8–H16, 1.08–1.5).
# Below a wave it wins only for very long items: H96 1×8192 (0.73 waves, 512 tiles) 0.95.  On
# equal lengths short items win too: 32×256 at H4–H32 0.74–0.90, so a fixed-length
# batch (uniform by its signature) needs 16 tiles.  Decided from shapes only (items and mean
# length), so a plan stays valid for any lengths of its signature: a varlen batch may be ragged.
FUSED_MIN_WAVES = 0.9
FUSED_MIN_MEAN_TILES = 48
FUSED_UNIFORM_MIN_MEAN_TILES = 16
FUSED_LONG_MIN_WAVES = 0.7
FUSED_LONG_MIN_MEAN_TILES = 512


def fused_spec(heads: int) -> FusedSpec:
    """The fused prefill the runtime launches (fixed and varlen input alike: ``FLAG_VARLEN``)."""
    return FusedSpec(heads=heads)


def auto_fused(heads: int, num_seqs: int, total_tokens: int, sm_count: int, uniform: bool = False) -> bool:
    """Whether the serial prefill of ``num_seqs`` sequences (``total_tokens`` in all) × ``heads``
    heads runs as the fused kernel; ``uniform``: the sequences are known to be equally long (a
    fixed-length batch)."""
    waves = heads * num_seqs / sm_count
    mean_tiles = total_tokens / (16 * num_seqs)
    min_tiles = FUSED_UNIFORM_MIN_MEAN_TILES if uniform else FUSED_MIN_MEAN_TILES
    return ((waves >= FUSED_MIN_WAVES and mean_tiles >= min_tiles)
            or (waves >= FUSED_LONG_MIN_WAVES and mean_tiles >= FUSED_LONG_MIN_MEAN_TILES))


MERGE_PARAMS = (
    pointer("initial_state", "f32"),
    pointer("prescan", "f32"),
    pointer("carries", "f32"),
    pointer("seq_segments", "i32"),
    pointer("state_indices", "i32"),
    STATUS_POINTER,
    scalar("num_seqs", "i32"),
    *state_params("init"),
    scalar("flags", "i32"),
)
MERGE_V_BLOCKS = (8, 16)  # state columns per merge CTA, both built
MERGE_THREADS = 256  # eight warps, one m16 tile of the 128 state rows each


def merge_v_block(heads: int, num_seqs: int, sm_count: int) -> int:
    """The merge's column block: 8 while its grid of one-CTA-per-SM blocks still fits the SMs
    in one wave (twice the CTAs for the same chain), else 16."""
    narrow, wide = MERGE_V_BLOCKS
    return narrow if (128 // narrow) * heads * num_seqs <= sm_count else wide


@dataclasses.dataclass(frozen=True)
class MergeSpec(KernelSpec):
    """Intracard CP merge: one CTA per (state column block, head, sequence)."""

    kernel: ClassVar[str] = "cp_merge"
    params: ClassVar[tuple] = MERGE_PARAMS
    dependent_launch: ClassVar[bool] = True

    heads: int
    v_block: int = 16
    block: ClassVar[tuple] = (MERGE_THREADS, 1, 1)

    @property
    def grid(self) -> tuple:
        return (128 // self.v_block, "heads", "num_seqs")


# ---- decode: the recurrent step over a state pool, ``kernels/decode.py`` ----------------------
DECODE_MAX_TOKENS = 8  # tokens per sequence and call (speculative decoding verifies several)
DECODE_FLAG_INTERMEDIATE = 1  # ``flags`` bit: write the state after every token
DECODE_FLAG_STATUS = 2  # ``flags`` bit: a status word is given (``layout.STATUS_SLOT_OUT_OF_RANGE``)
# (V rows per item, items per CTA) of the built decode kernels: one warp per 16 rows; with
# several items a CTA walks V blocks of one head, the next one's state streaming into shared
# memory while the current one computes.  Only what ``ops.decode.pick_variant`` launches is
# built: 16-row items and 64-row single items lost on every row of the first sweep, 64-row pairs
# on the session-11 table (docs/PERFORMANCE.md "Decode").
DECODE_VARIANTS = ((32, 1), (32, 2), (32, 4))

DECODE_PARAMS = (
    pointer("q", "bf16"),
    pointer("k", "bf16"),
    pointer("v", "bf16"),
    pointer("g", "bf16"),
    pointer("beta", "bf16"),  # rounded down to 16 bytes; beta_offset elements added on device
    pointer("a_log", "f32"),
    pointer("dt_bias", "f32"),
    pointer("state_indices", "i32"),  # rounded down to 16 bytes; index_offset added on device
    pointer("state_pool", "state"),  # element dtype: f32 or bf16 by spec (see DecodeSpec.params)
    pointer("intermediate", "state"),
    pointer("out", "bf16"),
    STATUS_POINTER,
    scalar("num_seqs", "i32"),
    scalar("num_tokens", "i32"),
    scalar("num_slots", "i32"),
    scalar("slot_stride", "i32"),
    *(scalar(f"{name}_stride_{axis}", "i32") for name in ("q", "k", "v", "g", "beta") for axis in ("n", "t")),
    scalar("beta_offset", "i32"),
    scalar("index_offset", "i32"),
    scalar("out_stride_n", "i32"),
    scalar("out_stride_t", "i32"),
    scalar("scale", "f32"),
    scalar("lower_bound", "f32"),
    scalar("flags", "i32"),
)


def decode_params(state_dtype: str) -> tuple:
    """``DECODE_PARAMS`` with the pool and intermediate pointers of element dtype ``state_dtype``."""
    return tuple(dataclasses.replace(p, dtype=state_dtype) if p.dtype == "state" else p for p in DECODE_PARAMS)


def decode_threads(v_block: int) -> int:
    """Threads per decode CTA: one warp per 16 V rows."""
    return 32 * (v_block // 16)


def decode_stage_bytes(v_block: int, items: int, bf16_state: bool) -> int:
    """A decode CTA's stage for the next item's state (``v_block`` rows of 128 keys in the pool
    dtype, refilled item by item), or a placeholder when the CTA has one item."""
    return v_block * 128 * (2 if bf16_state else 4) if items > 1 else 128


def decode_token_bytes(v_block: int, items: int) -> int:
    """A decode CTA's shared memory per token: the four fp32 key vectors (α then k̂/A, k̂ then
    A⊙k̂, q̂ then A⊙q̂, A) and the bf16 v and o rows of its ``items·v_block`` rows."""
    return 4 * 128 * 4 + 2 * items * v_block * 2


def decode_smem_bytes(v_block: int, items: int, bf16_state: bool, tokens: int = DECODE_MAX_TOKENS) -> int:
    """Dynamic shared memory of a decode CTA (``kernels/decode.py``) for calls of ``tokens`` tokens:
    the stage, k̂·q̂ and b, alignment slack, and ``tokens`` times the per-token arrays.  The kernel
    is built for ``DECODE_MAX_TOKENS``; a launch asks for what its T uses, so short calls fit more
    CTAs per SM."""
    return (decode_stage_bytes(v_block, items, bf16_state) + 2 * DECODE_MAX_TOKENS * 4 + 256
            + tokens * decode_token_bytes(v_block, items))


@dataclasses.dataclass(frozen=True)
class DecodeSpec(KernelSpec):
    """KDA decode: one CTA per (V block, head, sequence); the state of sequence n is
    ``state_pool[state_indices[n]]``, ``[V, K]`` per head (``kv_layout=False``) or ``[K, V]``,
    fp32 or bf16 (``bf16_state``)."""

    kernel: ClassVar[str] = "kda_decode"

    heads: int
    kv_layout: bool
    bf16_state: bool
    v_block: int
    items: int = 1

    @property
    def params(self) -> tuple:
        return decode_params("bf16" if self.bf16_state else "f32")

    @property
    def grid(self) -> tuple:
        return (128 // (self.items * self.v_block), "heads", "num_seqs")

    @property
    def block(self) -> tuple:
        return (decode_threads(self.v_block), 1, 1)

    def launch_smem_bytes(self, tokens: int) -> int:
        """Dynamic shared memory a launch for ``tokens`` tokens needs (≤ the built maximum)."""
        return decode_smem_bytes(self.v_block, self.items, self.bf16_state, tokens)


# The tensor-core form of 2–4 decode tokens on bf16 "vk" pools (``kernels/decode_chunk.py``);
# warps per CTA, each warp 16 V rows of one head.
DECODE_CHUNK_MAX_TOKENS = 4
DECODE_CHUNK_VARIANTS = ((4, 1), (4, 2), (2, 4))  # (warps, items)


def decode_chunk_stage_bytes(warps: int, items: int) -> int:
    """A chunk CTA's stage for the next item's state (its 16·warps rows in bf16), or a placeholder."""
    return warps * 16 * 128 * 2 if items > 1 else 16


def decode_chunk_smem_bytes(warps: int, items: int) -> int:
    """Dynamic shared memory of a chunk decode CTA: the per-token key vectors (α / ki, kd and qd,
    A: four fp32 [4, 128]), P's bf16 hi / lo operands, K̃, G and the dot products, k̂·q̂ and b,
    the warps' bf16 o staging, the next item's stage, and alignment slack."""
    tokens = DECODE_CHUNK_MAX_TOKENS
    return (4 * tokens * 128 * 4 + 2 * 2 * tokens * 128 * 2 + tokens * 128 * 4 + (64 + 8 * tokens + 16 + 2 * tokens) * 4
            + warps * tokens * 16 * 2 + decode_chunk_stage_bytes(warps, items) + 256)


@dataclasses.dataclass(frozen=True)
class DecodeChunkSpec(KernelSpec):
    """KDA decode of 2–4 tokens on a bf16 pool with keys contiguous, on tensor cores: one CTA per
    (``items`` blocks of 16·warps V rows, head, sequence), the next block's state streaming into
    shared memory while the current one computes; same parameter list as ``DecodeSpec``."""

    kernel: ClassVar[str] = "kda_decode_chunk"

    heads: int
    warps: int
    items: int = 1

    @property
    def params(self) -> tuple:
        return decode_params("bf16")

    @property
    def grid(self) -> tuple:
        return (128 // (16 * self.warps * self.items), "heads", "num_seqs")

    @property
    def block(self) -> tuple:
        return (32 * self.warps, 1, 1)

    def launch_smem_bytes(self, tokens: int) -> int:
        return decode_chunk_smem_bytes(self.warps, self.items)


def decode_specs(heads) -> list[KernelSpec]:
    """Every decode specialization for the given head counts (both layouts, both pool dtypes,
    every ``DECODE_VARIANTS``; the chunk form for every ``DECODE_CHUNK_VARIANTS``)."""
    return [DecodeSpec(heads=h, kv_layout=kv, bf16_state=bf16, v_block=vb, items=items)
            for h in sorted(set(heads)) for kv in (False, True) for bf16 in (False, True)
            for vb, items in DECODE_VARIANTS] + [
        DecodeChunkSpec(heads=h, warps=w, items=i) for h in sorted(set(heads)) for w, i in DECODE_CHUNK_VARIANTS]


def default_specs(heads=DEFAULT_HEADS) -> list[KernelSpec]:
    """Every specialization the build produces for the given head counts."""
    specs: list[KernelSpec] = []
    for h in sorted(set(heads)):
        for varlen in (False, True):
            specs.append(K1Spec(heads=h, varlen=varlen))
            specs.extend(K2Spec(heads=h, varlen=varlen, v_block=vb) for vb in K2_V_BLOCKS)
            specs.extend(K2Spec(heads=h, varlen=varlen, v_block=vb, multicast=True) for vb in K2_MULTICAST_V_BLOCKS)
            specs.extend(K2Spec(heads=h, varlen=varlen, v_block=K2_WGMMA_V_BLOCK, multicast=m, wgmma=True)
                         for m in (False, True))
        specs.append(fused_spec(h))
        # Intracard CP: segment tables carry absolute tokens and slots, so one variant serves
        # fixed and varlen input.
        specs.extend(segmented_k2_spec(h, vb, prescan) for prescan in (True, False) for vb in K2_SEGMENTED_V_BLOCKS)
        specs.extend(MergeSpec(heads=h, v_block=vb) for vb in MERGE_V_BLOCKS)
    specs.extend(decode_specs(heads))
    return specs
