"""K2 recurrence (``kernels/k2_recurrence.py``): its parameters, variants (V block, segmented / pre_scan,
multicast, wgmma), grid, and the V-block dispatch of the serial and CP launches."""

import dataclasses
from typing import ClassVar

from .abi import (
    CHECKPOINT_PARAMS,
    SEQUENCE_SCALARS,
    WORKSPACE_POINTERS,
    KernelSpec,
    bound_params,
    pointer,
    scalar,
    state_params,
)

K2_PARAMS = (
    pointer("v", "bf16"),
    pointer("out", "bf16"),
    pointer("initial_state", "f32"),
    pointer("final_state", "f32"),
    pointer("cu_seqlens", "i32"),
    pointer("segments", "i32"),
    pointer("state_indices", "i32"),
    *WORKSPACE_POINTERS,
    *SEQUENCE_SCALARS,
    scalar("v_row_stride", "i32"),
    scalar("out_row_stride", "i32"),
    *state_params("init"),
    *state_params("final"),
    scalar("flags", "i32"),
    *bound_params("init", "final"),
    *CHECKPOINT_PARAMS,
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
    # Certified truncation (segmented rows: the pieces of ``intracard_cp="truncated"``): a row walks
    # back over the tile bounds before its first tile and starts from a zero state where they prove
    # the dropped state negligible, else from its sequence's start (docs/DESIGN.md).
    walk: bool = False
    # Prefix-cache checkpoint writes (``kda_prefill(checkpoint_every=...)``) in the tile loop: a
    # twin of the serial and segmented recurrence variants, so calls without checkpoints run a
    # chain with no checkpoint code (in one, the loop's cold write cost 2–6%: PERFORMANCE.md).
    checkpointing: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.walk and (not self.segmented or self.prescan or self.checkpointing):
            raise ValueError("K2Spec: walk=True is a segmented recurrence variant without pre_scan or checkpoints")
        if self.checkpointing and self.prescan:
            raise ValueError("K2Spec: checkpointing=True has no pre_scan variant (its states are not the sequence's)")
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


def serial_k2_spec(varlen: bool, v_block: int, checkpointing: bool = False) -> K2Spec:
    """The serial K2 for ``v_block``: multicast where it is built, and warpgroup
    MMAs for the one-warpgroup V block (3.5–6% faster where ``auto_v_block`` takes it; on the
    few-CTA fixed rows, where 32 columns stay the pick, 64 with wgmma lost 6–9%: PERFORMANCE.md,
    K2 recurrence)."""
    return K2Spec(
        varlen=varlen,
        v_block=v_block,
        multicast=v_block in K2_MULTICAST_V_BLOCKS,
        wgmma=v_block == K2_WGMMA_V_BLOCK,
        checkpointing=checkpointing,
    )


def segmented_k2_spec(
    v_block: int = K2_SEGMENTED_V_BLOCK, prescan: bool = False, checkpointing: bool = False, walk: bool = False
) -> K2Spec:
    """The CP segmented K2: the segment recurrence, or (``prescan``) the pre_scan
    jobs, which write states only, or (``walk``) the certified-truncation pieces."""
    return K2Spec(varlen=True, v_block=v_block, segmented=True, prescan=prescan, checkpointing=checkpointing, walk=walk)


def segmented_v_block(heads: int, rows: int, sm_count: int) -> int:
    """The segmented K2's V block for a launch over ``rows`` segment-table rows: 32 columns, or
    64 once the 32-column grid exceeds one wave of ``K2_CTAS_PER_SM`` CTAs per SM (then 64
    holds it in one wave of four: H8 [8192, 2048] at s = 8, 896 pre_scan CTAs, 5% faster;
    PERFORMANCE.md, Intracard CP)."""
    ctas = (128 // K2_SEGMENTED_V_BLOCK) * heads * rows
    return K2_SEGMENTED_WIDE_V_BLOCK if ctas > K2_CTAS_PER_SM * sm_count else K2_SEGMENTED_V_BLOCK
