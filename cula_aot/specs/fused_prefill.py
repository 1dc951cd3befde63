"""The fused prefill (``kernels/fused_prefill.py``: K1's work and K2's chain in one CTA per
(sequence, head), the tile records in shared memory): its parameters, the variant, grid,
register split and the rule that picks it over K1 then K2."""

import dataclasses
from typing import ClassVar

from ..gates import DEFAULT_GATE
from .abi import CHECKPOINT_PARAMS, K1_INPUTS, KernelSpec, gate_field, bound_params, pointer, scalar, state_params

FUSED_PARAMS = (
    *K1_INPUTS,
    pointer("v", "bf16"),
    pointer("out", "bf16"),
    pointer("initial_state", "f32"),
    pointer("final_state", "f32"),
    pointer("cu_seqlens", "i32"),
    pointer("state_indices", "i32"),
    scalar("seq_len", "i32"),
    scalar("num_seqs", "i32"),
    scalar("beta_row_stride", "i32"),
    scalar("v_row_stride", "i32"),
    scalar("out_row_stride", "i32"),
    *state_params("init"),
    *state_params("final"),
    scalar("flags", "i32"),
    scalar("scale", "f32", per_call=True),
    scalar("lower_bound", "f32", per_call=True),
    *bound_params("init", "final"),
    *CHECKPOINT_PARAMS,
)
# The fused pieces kernel's tables (``kernels/fused_prefill.py``, ``FusedPieces``): its rows
# (``layout.SEG_*``); a ticket counter per head, then one ready flag per (row, head) item of the
# rows with a successor (the first rows), zeroed before each launch; those items' published end
# states (fp32, 128·128 each, in the consumer threads' register order).
PIECE_PARAMS = (pointer("segments", "i32"), pointer("ready", "i32"), pointer("carries", "f32"))
FUSED_PIECES_PARAMS = (*FUSED_PARAMS, *PIECE_PARAMS)
# The tiles a piece runs from a zero state before its own; their bounds must sum to
# ≤ TRUNCATION_LOG2 (two tiles do for ~97% of standard-regime positions: docs/DESIGN.md,
# Certified truncation), else the piece takes its predecessor's end state.
PIECE_WARMUP_TILES = 2
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

    stages: int = FUSED_STAGES
    producers: int = FUSED_PRODUCERS
    gate: str = gate_field()
    checkpointing: bool = False  # prefix-cache checkpoint writes, as ``K2Spec.checkpointing``

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


def fused_spec(gate: str = DEFAULT_GATE, checkpointing: bool = False) -> FusedSpec:
    """The fused prefill the runtime launches for ``gate`` (fixed and varlen input alike:
    ``FLAG_VARLEN``), with or without checkpoint writes."""
    return FusedSpec(gate=gate, checkpointing=checkpointing)


def auto_fused(heads: int, num_seqs: int, total_tokens: int, sm_count: int, uniform: bool = False) -> bool:
    """Whether the serial prefill of ``num_seqs`` sequences (``total_tokens`` in all) × ``heads``
    heads runs as the fused kernel; ``uniform``: the sequences are known to be equally long (a
    fixed-length batch)."""
    waves = heads * num_seqs / sm_count
    mean_tiles = total_tokens / (16 * num_seqs)
    min_tiles = FUSED_UNIFORM_MIN_MEAN_TILES if uniform else FUSED_MIN_MEAN_TILES
    return (waves >= FUSED_MIN_WAVES and mean_tiles >= min_tiles) or (
        waves >= FUSED_LONG_MIN_WAVES and mean_tiles >= FUSED_LONG_MIN_MEAN_TILES
    )


@dataclasses.dataclass(frozen=True)
class FusedPiecesSpec(FusedSpec):
    """The fused prefill over certified pieces: one CTA per (piece row, head) of a table, each
    piece warmed up from zero over ``PIECE_WARMUP_TILES`` tiles, or started from its
    predecessor's published end state where their bounds do not certify."""

    kernel: ClassVar[str] = "fused_pieces"
    params: ClassVar[tuple] = FUSED_PIECES_PARAMS
    grid: ClassVar[tuple] = (1, "heads", "num_rows")


def fused_pieces_spec(gate: str = DEFAULT_GATE) -> FusedPiecesSpec:
    """The fused pieces kernel for ``gate`` (no checkpoint writes)."""
    return FusedPiecesSpec(gate=gate)
