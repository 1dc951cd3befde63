"""K2 "recurrence": the sequential KDA state update over the tiles of each (sequence, head),
on tensor cores.

What it computes (docs/CONTRACT.md §2), for one sequence, one head and one block of
``v_block`` value columns (the recurrence is independent across V columns), over the tiles of
the sequence in order.  Written transposed, so that V is the MMA's M dimension:

    Wᵀ = (Vᵀ − Sᵀ·kdᵀ)·diag(b)     Uᵀ = Wᵀ·INVᵀ
    Oᵀ = Sᵀ·qdᵀ + Uᵀ·Mqkᵀ          Sᵀ ← Sᵀ·diag(gtot) + Uᵀ·kr

``b = σ(β)`` as K1 stored it (fp32; 0 on rows past the sequence end, whose staged v rows are zero
too, so W is 0 there and nothing from another sequence leaks in).

Tensor cores.  Each warp owns 16 V columns: its slice of Sᵀ (16 × 128, fp32) lives in the
accumulator fragments of 16 m16n8 tiles, which is also the update's output.  Every product is
one or more ``mma.sync.m16n8k16`` (bf16 operands, fp32 accumulation): Sᵀ·kdᵀ and Sᵀ·qdᵀ take
8 k-steps whose A operand is the state fragment itself rounded to bf16 (the C layout of two
n-tiles is the A layout of a k-step; see ``warp_mma``), Wᵀ and Uᵀ become A operands the same
way, and kd, qd, INV, Mqk (``ldmatrix``) and kr (``ldmatrix.trans``) come straight from the
stage: the K_INTER image's 16-byte rows are ldmatrix rows.  O leaves through the warp's v slot
of the tile: one ``stmatrix.trans`` lays its 16 × 16 block out token-major, then each lane
stores 16 bytes of one token row.  Rounding points are those of the FlashKDA recipe (bf16 S, W
and U operands); the state itself stays fp32 between tiles.

Warpgroup MMAs (``wgmma=True``, v_block 64: the CTA's 4 warps are one warpgroup): Sᵀ·kdᵀ,
Sᵀ·qdᵀ and the state update run as ``wgmma.mma_async`` with B read from the stage through
shared-memory descriptors (``warpgroup_mma``), once for the warpgroup instead of once per warp;
the A operands and the state registers are the same fragments as above, and the update is in
flight while O is formed and stored.

Inputs per tile come from K1's workspace record of the slot (slot = head · total_slots + tile
slot, see ``k1_prepare``): qd, kd, kr as raw 4096-byte K_INTER images, inv, mqk, gt and b
back to back (``layout.WORKSPACE_PART_OFFSETS``), with one ``cp.async.bulk`` global→shared copy
of the whole record (no tensor map) into one of ``stages`` stages, issued ``stages − 1`` tiles
ahead.  Each warp stages its own 16 × 16 block of v per tile the same
distance ahead with one 16-byte ``cp.async`` per lane (rows past the end zero-filled) and reads
it back as the Vᵀ accumulator fragment with one ``ldmatrix.trans``.

Work items.  Serial (``segmented=False``): one per sequence, found from cu_seqlens (varlen) or
B×T (fixed) on the device; under ``FLAG_LONGEST_FIRST`` grid row z takes the z-th longest
varlen sequence (up to ``layout.ORDER_MAX_SEQS``), so the longest chains start first.
Segmented (intracard CP, ``segmented=True``): one per row of a segment table built by the host
planner (``cula_aot.layout.SEG_*``): first token, first tile
slot, token count, the state rows it reads/writes and its flags.  The same kernel serves the CP
pre_scan (flags: identity start, v = 0 → the segment's transition matrix; or zero start, real
v → its end state) and the segmented recurrence (start from the merged carry).  The pre_scan's
variant (``prescan``) writes states only: it stages the record's first
``layout.PRESCAN_RECORD_BYTES`` (kd, kr, inv, gt, b) and drops the qd and Mqk products and the
output stores, a third of the tile's MMAs.

Checkpoints (``checkpointing=True``, serial and segmented recurrence, not the pre_scan): the state
after every ``checkpoint_every``-th token of the item's sequence is also written, after its tile,
to the slot ``checkpoint_indices`` names (``layout.checkpoint_schedule``); the variant without
them has no checkpoint code, so a call without checkpoints runs the plain chain.

Multicast (``multicast=True``): the V blocks of one work item are one thread-block cluster;
each CTA loads a slice of every record into the same stage of all of them, and a stage is
refilled once the whole cluster is done with it (a relaxed cluster barrier per tile).

Launch: grid (128 / v_block, H, work items), block (2·v_block, 1, 1) (one warp per 16 V
columns), cluster (128 / v_block, 1, 1) when multicast (a launch attribute),
``smem_bytes(v_block, stages, prescan)`` dynamic shared memory, as a programmatic dependent of the
kernel before it (K1, or the CP merge): ``griddepcontrol.wait`` comes before the first read of a
workspace record (serial) or of the start state (segmented).  Runtime: lengths, cu_seqlens or the
segment table, the token strides of v and out (elements; rows 16-byte aligned, heads and D
packed), initial/final state slot and element strides (``[N,H,V,K]``, ``[N,H,K,V]``, padded
pool slots), an optional ``state_indices`` pool map with each pool's slot count (a slot outside
it is padding), flags (``cula_aot.layout.FLAG_*``: which states exist, pool indexing, fp32 or
bf16 states) and an optional status word (``FLAG_STATUS``: malformed cu_seqlens entries, which
are clamped, and slots out of range are reported there).  Compile-time: H, varlen, v_block (16,
32, 64, ...), segmented, prescan, stages, multicast, wgmma, checkpointing.
"""

import dataclasses

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

from ..layout import (
    FLAG_BF16_CHECKPOINT,
    FLAG_CHECKPOINT_OFFSETS,
    FLAG_IDENTITY_INIT,
    FLAG_NO_OUTPUT,
    FLAG_STATUS,
    FLAG_ZERO_V,
    SEG_FINAL_INDEX,
    SEG_FIRST_SLOT,
    SEG_FIRST_TOKEN,
    SEG_FLAGS,
    SEG_INIT_INDEX,
    SEG_SEQ,
    SEG_SEQ_OFFSET,
    SEG_TOKENS,
    SEGMENT_FIELDS,
    PRESCAN_RECORD_BYTES,
    WORKSPACE_PART_OFFSETS,
    WORKSPACE_RECORD_BYTES,
    WORKSPACE_SLOT_BYTES,
)
from ..specs import K2_WARP_COLUMNS as WARP_COLUMNS
from ..specs import k2_threads
from .common import CHUNK, D, TRACE_HEADS, grid_heads, record_part, varlen_sequence
from .params import Checkpoints, PoolBounds, StateStrides, grouped
from .tile_bound import certified_warmup
from .warpgroup_mma import smem_descriptor, wgmma_fence, wgmma_wait
from .warp_mma import (
    accumulators_as_a,
    ld_shared_v4,
    ldmatrix_x4,
    mma_bf16_m16n8k16,
    pack_bf16x2,
    st_global_v4,
    stmatrix_x4_trans,
)
from .tile_chain import (
    report_item_status,
    checkpoint_run_end,
    checkpoint_schedule,
    image_lane_offset,
    image_trans_lane_offset,
    state_slots,
    N_TILES,
    STAGE_ALIGN,
    V_WARP_BYTES,
    issue_state_update,
    longest_first,
    read_state,
    square_lane_offset,
    stage_pointer,
    stage_v_rows,
    VStaging,
    state_entry,
    tile_u,
    tile_w,
    v_chunk,
    wgmma_state_products,
    write_checkpoint,
    write_state,
)

WARP = 32
KS_CHAINS = 4  # independent accumulation chains of Sᵀ·kdᵀ (see the tile loop)

assert all(
    o % STAGE_ALIGN == 0 for o in (WORKSPACE_RECORD_BYTES, PRESCAN_RECORD_BYTES, *WORKSPACE_PART_OFFSETS.values())
)


def stage_bytes(prescan: bool) -> int:
    """One pipeline stage: one slot's workspace record as K1 lays it out (the parts back to
    back), filled by one bulk copy; the pre_scan stages only the record's leading parts."""
    return PRESCAN_RECORD_BYTES if prescan else WORKSPACE_RECORD_BYTES


# A K_INTER image as wgmma no-swizzle core matrices (8 rows × 16 bytes): 8 keys × 8 tokens each,
# the next 8 tokens 128 bytes on, the next 8 keys 256 bytes on; a k-step (16 keys) advances the
# descriptor's address by 512 bytes, in its 16-byte units.
IMAGE_TOKEN_GROUP_BYTES = 8 * 16
IMAGE_KEY_GROUP_BYTES = CHUNK * 16
IMAGE_K_STEP_UNITS = 2 * IMAGE_KEY_GROUP_BYTES // 16


def smem_bytes(v_block: int, stages: int, prescan: bool = False) -> int:
    """Dynamic shared memory: the workspace stages, the v stages, barriers and alignment slack
    (fragments live in registers)."""
    warps = v_block // WARP_COLUMNS
    return stages * (stage_bytes(prescan) + warps * V_WARP_BYTES) + 8 * stages + 128


def _stage_view(stage_base: cute.Pointer, part: str, dtype):
    """The ``part`` workspace inside a stage buffer, as a 1-D tensor of ``dtype``."""
    nbytes = WORKSPACE_SLOT_BYTES[part]
    return cute.make_tensor(record_part(stage_base, part, dtype), cute.make_layout(nbytes * 8 // dtype.width))


def multicast_slice_bytes(nbytes: int, ctas: int) -> int:
    """Bytes of a stage each CTA of a ``ctas``-CTA cluster loads for all of them (16-byte
    multiples, the bulk copy's unit; the record sizes divide evenly for 2 and 4 CTAs, not 8)."""
    if nbytes % (16 * ctas):
        raise ValueError(f"a {nbytes}-byte stage does not split into {ctas} 16-byte-aligned slices")
    return nbytes // ctas


def _issue_stage_loads(
    workspace: cute.Pointer,
    stage_base: cute.Pointer,
    barrier: cute.Pointer,
    record_offset,
    nbytes: int,
    cluster_ctas: int,
    rank,
):
    """One thread: arm ``barrier`` with the stage's byte count, then load the workspace record at
    byte ``record_offset`` (its first ``nbytes``): alone with one bulk copy, or in a cluster of
    ``cluster_ctas`` CTAs (the V blocks of one sequence and head) its ``rank``-th slice,
    multicast into the same stage of every CTA of the cluster, whose barriers each count all
    slices' bytes."""
    cute.arch.mbarrier_arrive_and_expect_tx(barrier, nbytes)
    record = workspace + cute.assume(record_offset, divby=STAGE_ALIGN)
    if cutlass.const_expr(cluster_ctas == 1):
        atom = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), cutlass.Uint8, num_bits_per_copy=nbytes * 8)
        cute.copy(
            atom,
            cute.make_tensor(record, cute.make_layout(nbytes)),
            cute.make_tensor(stage_base, cute.make_layout(nbytes)),
            mbar_ptr=barrier,
        )
    else:
        part = multicast_slice_bytes(nbytes, cluster_ctas)
        offset = cute.assume(rank * part, divby=16)
        atom = cute.make_copy_atom(cpasync.CopyBulkG2SMulticastOp(), cutlass.Uint8, num_bits_per_copy=part * 8)
        cute.copy(
            atom,
            cute.make_tensor(record + offset, cute.make_layout(part)),
            cute.make_tensor(stage_base + offset, cute.make_layout(part)),
            mbar_ptr=barrier,
            mcast_mask=cutlass.Int16((1 << cluster_ctas) - 1),
        )


@dataclasses.dataclass(frozen=True)
class _ChainContext:
    """What one tile of the K2 chain reads of its CTA: geometry, stages, barriers, fragments and the state
    (trace-time values; the codegen arguments as plain Python)."""

    cluster_ctas: object
    full: object
    head: object
    image_lane: object
    image_trans_lane: object
    lane: object
    length: object
    multicast: object
    num_tiles: object
    out: object
    out_stride: object
    prescan: object
    rank: object
    s_stages: object
    seq_start: object
    slot0: object
    square_lane: object
    staging: object
    stage_nbytes: object
    stages: object
    state: object
    t: object
    tid: object
    warp: object
    warp_col0: object
    wgmma: object
    workspace: object
    write_out: object
    walk: object  # certified-truncation pieces: no output before ``first_out`` (the warm-up)
    first_out: object


@dataclasses.dataclass(frozen=True)
class TileCursor:
    """One tile's addresses as the checkpointing twin carries them through a run (``run_cursor``,
    ``next_tile``): a loop from a run's first tile instead of 0 does not get LLVM's induction
    variables for them, and recomputing them cost its chain ~15 instructions a tile.  The first
    token row, the rows left from it, the first output row's element offset and the byte offset
    of the workspace record ``stages`` − 1 tiles ahead."""

    token0: object
    rows_left: object
    out_row0: object
    ahead_record: object


def run_cursor(run_start, seq_start, length, out_stride, slot0, stages: int):
    """(token row, rows left, output offset, stage, ahead stage, phase, ahead record) of tile
    ``run_start``: the carried values' start (``TileCursor``; stages count unsigned from tile 0)."""
    token0 = seq_start + cutlass.Int64(run_start * CHUNK)
    at = cutlass.Uint32(run_start)
    return (
        token0,
        length - run_start * CHUNK,
        token0 * out_stride,
        cutlass.Int32(at % stages),
        cutlass.Int32((at + (stages - 1)) % stages),
        cutlass.Int32((at // stages) % 2),
        (slot0 + cutlass.Int64(run_start + (stages - 1))) * WORKSPACE_RECORD_BYTES,
    )


def next_tile(token0, rows_left, out_row0, stage, ahead_stage, phase, ahead_record, out_stride, stages: int):
    """The carried values (``run_cursor``'s order) one tile on."""
    wraps = stage == stages - 1
    return (
        token0 + CHUNK,
        rows_left - CHUNK,
        out_row0 + out_stride * CHUNK,
        cutlass.select_(wraps, 0, stage + 1),
        cutlass.select_(ahead_stage == stages - 1, 0, ahead_stage + 1),
        cutlass.select_(wraps, phase ^ 1, phase),
        ahead_record + WORKSPACE_RECORD_BYTES,
    )


@cute.jit
def _chain_tile(ctx, tile, stage, ahead_stage, phase, cursor=None):
    """Tile ``tile`` of a K2 chain from stage ``stage`` (barrier phase ``phase``), refilling
    ``ahead_stage`` with the tile stages − 1 ahead; ``ctx``: the CTA's chain context (``_ChainContext``).
    ``cursor`` (``TileCursor``): the tile's addresses as values its loop carries; None computes
    them from ``tile`` (the plain loop from 0, whose induction variables LLVM finds itself)."""
    stage_base = stage_pointer(ctx.s_stages, stage, ctx.stage_nbytes)
    # The stage stages − 1 tiles ahead was last read by tile t − 1 (freed by its barrier).
    ahead = tile + (ctx.stages - 1)
    if cutlass.const_expr(ctx.multicast):
        if ctx.warp == 0:
            # The cluster barrier of tile t − 1: every CTA is done with the stage refilled now.
            if tile > 0:
                cute.arch.cluster_wait()
    if cutlass.const_expr(cursor is None):
        ahead_record = (ctx.slot0 + cutlass.Int64(ahead)) * WORKSPACE_RECORD_BYTES
        ahead_token0 = ctx.seq_start + cutlass.Int64(ahead * CHUNK)
        ahead_rows = ctx.length - ahead * CHUNK
        rows_left = ctx.length - tile * CHUNK
        token0 = ctx.seq_start + cutlass.Int64(tile * CHUNK)
    else:
        ahead_record = cursor.ahead_record
        ahead_token0 = cursor.token0 + (ctx.stages - 1) * CHUNK
        ahead_rows = cursor.rows_left - (ctx.stages - 1) * CHUNK
        rows_left = cursor.rows_left
        token0 = cursor.token0
    if ctx.tid == 0:
        if ahead < ctx.num_tiles:
            _issue_stage_loads(
                ctx.workspace,
                stage_pointer(ctx.s_stages, ahead_stage, ctx.stage_nbytes),
                ctx.full + ahead_stage,
                ahead_record,
                ctx.stage_nbytes,
                ctx.cluster_ctas,
                ctx.rank,
            )
    stage_v_rows(ctx.staging, ctx.staging.slot(ahead_stage), ahead_token0, ahead_rows)
    # One group per tile, empty past the end, so "all but the newest stages − 1" is tile t.
    cute.arch.cp_async_commit_group()
    rows_valid = cutlass.min(rows_left, CHUNK)
    cute.arch.cp_async_wait_group(ctx.stages - 1)
    cute.arch.sync_warp()  # every lane's v rows visible to the whole warp
    v_regs = ldmatrix_x4(ctx.staging.slot(stage) + ctx.square_lane, transpose=True)
    cute.arch.mbarrier_wait(ctx.full + stage, phase)
    base = stage_base.toint()
    b_rows = _stage_view(stage_base, "b", cutlass.Float32)
    gt = _stage_view(stage_base, "gt", cutlass.Float32)

    # -- Sᵀ·kdᵀ and Sᵀ·qdᵀ: 8 k-steps over the keys, two token n-tiles each -----------
    # Sᵀ·kdᵀ is on the tile-to-tile critical path (→ W → U → Sᵀ): k-step kt accumulates in
    # chain kt % KS_CHAINS, the chains are summed at the end (dependent MMA depth
    # 8 / KS_CHAINS).  Sᵀ·qdᵀ only feeds O and keeps one chain.
    if cutlass.const_expr(ctx.wgmma):
        # The warpgroup reads each image once: 8 wgmma k-steps per product, A = this warp's
        # state rows in bf16, B = the K-major image (keys lead, tokens stride; a k-step is two
        # key groups on).
        a_steps = [accumulators_as_a(ctx.state, 8 * kt) for kt in range(D // 16)]
        kd_b = smem_descriptor(base + WORKSPACE_PART_OFFSETS["kd"], IMAGE_KEY_GROUP_BYTES, IMAGE_TOKEN_GROUP_BYTES)
        wgmma_fence()
        ks_acc = wgmma_state_products([cutlass.Float32(0.0)] * 8, a_steps, kd_b, IMAGE_K_STEP_UNITS)
        qs_acc = [cutlass.Float32(0.0)] * 8
        if cutlass.const_expr(not ctx.prescan):
            qd_b = smem_descriptor(base + WORKSPACE_PART_OFFSETS["qd"], IMAGE_KEY_GROUP_BYTES, IMAGE_TOKEN_GROUP_BYTES)
            qs_acc = wgmma_state_products(qs_acc, a_steps, qd_b, IMAGE_K_STEP_UNITS)
            ks_acc = wgmma_wait(1, ks_acc)
        else:
            ks_acc = wgmma_wait(0, ks_acc)
        ks = cute.make_rmem_tensor(cute.make_layout(8), cutlass.Float32)
        qs = cute.make_rmem_tensor(cute.make_layout(8), cutlass.Float32)
        for i in cutlass.range_constexpr(8):
            ks[i] = ks_acc[i]
    else:
        ks_chains = [cute.make_rmem_tensor(cute.make_layout(8), cutlass.Float32) for _ in range(KS_CHAINS)]
        qs = cute.make_rmem_tensor(cute.make_layout(8), cutlass.Float32)
        for chain in ks_chains:
            chain.fill(0.0)
        qs.fill(0.0)
        for kt in cutlass.range_constexpr(D // 16):
            a = accumulators_as_a(ctx.state, 8 * kt)
            b_kd = ldmatrix_x4(base + WORKSPACE_PART_OFFSETS["kd"] + kt * 2 * CHUNK * 16 + ctx.image_lane)
            ks_kt = ks_chains[kt % KS_CHAINS]
            for n in cutlass.range_constexpr(2):
                d_k = mma_bf16_m16n8k16(a, b_kd[2 * n : 2 * n + 2], [ks_kt[4 * n + c] for c in range(4)])
                for c in cutlass.range_constexpr(4):
                    ks_kt[4 * n + c] = d_k[c]
            if cutlass.const_expr(not ctx.prescan):
                b_qd = ldmatrix_x4(base + WORKSPACE_PART_OFFSETS["qd"] + kt * 2 * CHUNK * 16 + ctx.image_lane)
                for n in cutlass.range_constexpr(2):
                    d_q = mma_bf16_m16n8k16(a, b_qd[2 * n : 2 * n + 2], [qs[4 * n + c] for c in range(4)])
                    for c in cutlass.range_constexpr(4):
                        qs[4 * n + c] = d_q[c]
        ks = ks_chains[0]
        for chain in ks_chains[1:]:
            for i in cutlass.range_constexpr(8):
                ks[i] = ks[i] + chain[i]

    # -- Wᵀ = (Vᵀ − Sᵀkdᵀ)·diag(b), Uᵀ = Wᵀ·INVᵀ --------------------------------------
    w = tile_w(v_regs, b_rows, ks, ctx.t)
    a_u = tile_u(w, base, WORKSPACE_PART_OFFSETS["inv"], ctx.square_lane)
    if cutlass.const_expr(ctx.wgmma):
        # -- Sᵀ ← Sᵀ·diag(gtot) + Uᵀ·kr issued first, in flight under the O work.
        updated = issue_state_update(
            ctx.state,
            gt,
            ctx.t,
            a_u,
            base,
            WORKSPACE_PART_OFFSETS["kr"],
            IMAGE_TOKEN_GROUP_BYTES,
            IMAGE_KEY_GROUP_BYTES,
        )

    # -- Oᵀ = Sᵀqdᵀ + Uᵀ·Mqkᵀ (the pre_scan writes states only) --------------------------
    # O as bf16 pairs, matrix m = 2·n + h of the 16 × 16 block: token n-tile n, V rows 8h..8h+7.
    o_pairs = []
    if cutlass.const_expr(not ctx.prescan):
        if cutlass.const_expr(ctx.wgmma):
            qs_acc = wgmma_wait(1, qs_acc)
            for i in cutlass.range_constexpr(8):
                qs[i] = qs_acc[i]
        b_mqk = ldmatrix_x4(base + WORKSPACE_PART_OFFSETS["mqk"] + ctx.square_lane)
        for n in cutlass.range_constexpr(2):
            d_o = mma_bf16_m16n8k16(a_u, b_mqk[2 * n : 2 * n + 2], [qs[4 * n + c] for c in range(4)])
            o_pairs += [pack_bf16x2(d_o[0], d_o[1]), pack_bf16x2(d_o[2], d_o[3])]

    # -- Sᵀ ← Sᵀ·diag(gtot) + Uᵀ·kr (B[token, key] = kr: ldmatrix.trans) ----------------
    if cutlass.const_expr(not ctx.wgmma):
        for pair in cutlass.range_constexpr(N_TILES // 2):
            b_kr = ldmatrix_x4(
                base + WORKSPACE_PART_OFFSETS["kr"] + pair * 2 * CHUNK * 16 + ctx.image_trans_lane, transpose=True
            )
            for n in cutlass.range_constexpr(2):
                j = 2 * pair + n
                scaled = [ctx.state[4 * j + c] * gt[8 * j + 2 * ctx.t + c % 2] for c in range(4)]
                d_s = mma_bf16_m16n8k16(a_u, b_kr[2 * n : 2 * n + 2], scaled)
                for c in cutlass.range_constexpr(4):
                    ctx.state[4 * j + c] = d_s[c]
    if cutlass.const_expr(not ctx.prescan):
        # O leaves through this warp's v slot of the tile (read above, refilled only at the
        # next tile): stmatrix.trans lays it out token-major, then each lane stores 16 bytes of
        # one token row, whole 32-byte sectors per row (off the state chain, after its MMAs).
        o_slot = ctx.staging.slot(stage)
        stmatrix_x4_trans(o_slot + ctx.square_lane, o_pairs)
        cute.arch.sync_warp()
        words = ld_shared_v4(o_slot + ctx.lane * 16)
        out_row, out_half = v_chunk(ctx.lane)
        writes = ctx.write_out
        if cutlass.const_expr(ctx.walk):
            writes = ctx.write_out & (tile >= ctx.first_out)
        if out_row < rows_valid and writes:
            if cutlass.const_expr(cursor is None):
                at = (token0 + cutlass.Int64(out_row)) * ctx.out_stride + cutlass.Int64(
                    ctx.head * D + ctx.warp_col0 + out_half * 8
                )
            else:
                at = (
                    cursor.out_row0
                    + cutlass.Int64(out_row) * ctx.out_stride
                    + cutlass.Int64(ctx.head * D + ctx.warp_col0 + out_half * 8)
                )
            st_global_v4((ctx.out + at).toint(), words)
    if cutlass.const_expr(ctx.wgmma):
        # The update has read the stage's kr and written the state before the stage is freed.
        updated = wgmma_wait(0, updated)
        for i in cutlass.range_constexpr(4 * N_TILES):
            ctx.state[i] = updated[i]
    # Frees this stage for tile t + stages: in a cluster, for every CTA's slice of it.  Warp
    # 0 waits at the next tile's refill; the other warps here, before their next arrive.
    if cutlass.const_expr(ctx.multicast):
        if ctx.warp != 0:
            if tile > 0:
                cute.arch.cluster_wait()
        # Relaxed: a release would wait for this tile's output stores; every shared read of
        # the stage has already been consumed by an MMA, so nothing else needs ordering.
        cute.arch.cluster_arrive_relaxed()
    else:
        cute.arch.sync_threads()


class K2Recurrence:
    """K2 of one variant (``specs.K2Spec``): the codegen arguments here, the launch in
    ``__call__``, the device code in ``kernel`` (docs/DESIGN.md, Kernels as classes).  The entry
    symbol is the former function's, ``kernel_cutlass_k2_recurrence_kernel_<the parameters' types,
    cut at 180 characters>_0``: the device function is defined as ``k2_recurrence`` and
    ``str(self)`` is ``"kernel"``; the codegen arguments, once trailing Constexpr arguments, never
    reached the cut symbol."""

    def __init__(
        self,
        varlen: bool,
        v_block: int,
        segmented: bool,
        prescan: bool,
        stages: int,
        multicast: bool,
        wgmma: bool,
        walk: bool,
        checkpointing: bool,
    ):
        self.varlen = varlen
        self.v_block = v_block
        self.segmented = segmented
        self.prescan = prescan
        self.stages = stages
        self.multicast = multicast
        self.wgmma = wgmma
        self.checkpointing = checkpointing
        self.walk = walk

    def __str__(self) -> str:
        return "kernel"  # the entry symbol's component for ``self`` (see the class docstring)

    @cute.jit
    def __call__(self, *params, stream):
        # ``params``: the kernel's runtime parameters (``specs.K2_PARAMS``).  The grid here is a
        # placeholder: the runtime launches the cubin with the spec's grid.
        v_block = self.v_block
        self.kernel(*grouped(self.kernel, *params)).launch(
            grid=[D // v_block, TRACE_HEADS, 1],
            block=[k2_threads(v_block), 1, 1],
            smem=smem_bytes(v_block, self.stages, self.prescan),
            stream=stream,
            **({"cluster": [D // v_block, 1, 1]} if self.multicast else {}),
        )

    @cute.kernel
    def k2_recurrence(
        self,
        v: cute.Pointer,
        out: cute.Pointer,
        initial_state: cute.Pointer,
        final_state: cute.Pointer,
        cu_seqlens: cute.Pointer,
        segments: cute.Pointer,
        state_indices: cute.Pointer,
        workspace: cute.Pointer,
        seq_len: cutlass.Int32,
        num_seqs: cutlass.Int32,
        total_slots: cutlass.Int32,
        v_row_stride: cutlass.Int32,
        out_row_stride: cutlass.Int32,
        init: StateStrides,
        final: StateStrides,
        flags: cutlass.Int32,
        bounds: PoolBounds,
        checkpoint: Checkpoints,
    ):
        tid, _, _ = cute.arch.thread_idx()
        vblk, head, seq = cute.arch.block_idx()
        lane = tid % WARP
        g = lane // 4
        t = lane % 4
        # This thread's V columns: v_col and v_col + 8 (accumulator rows g and g + 8).
        warp = tid // WARP
        warp_col0 = vblk * self.v_block + warp * WARP_COLUMNS
        # Multicast: the V blocks of one (sequence, head) are one cluster, and each CTA loads a
        # slice of every tile's record for all of them (one L2 read per record, not one per CTA).
        cluster_ctas = D // self.v_block if self.multicast else 1
        rank = cute.arch.block_idx_in_cluster() if self.multicast else cutlass.Int32(0)
        v_col = warp_col0 + g

        smem = cutlass.utils.SmemAllocator()
        stage_nbytes = stage_bytes(self.prescan)
        s_stages = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(self.stages * stage_nbytes), 128)
        warps = self.v_block // WARP_COLUMNS
        s_v = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(self.stages * warps * V_WARP_BYTES), 128)
        full = smem.allocate_array(cutlass.Int64, self.stages)

        # ---- this work item: first token, first tile slot, length, state rows, flags ----------
        if cutlass.const_expr(self.varlen and not self.segmented):
            scratch = cute.recast_ptr(s_stages.iterator, dtype=cutlass.Int32)
            seq = longest_first(cu_seqlens, num_seqs, seq, flags, scratch, tid, k2_threads(self.v_block), seq_len)
        seq_start = cutlass.Int64(0)
        first_slot = cutlass.Int32(0)
        length = seq_len
        init_index = seq
        final_index = seq
        checkpoint_row = seq  # the row of checkpoint_indices (a sequence number)
        tokens_before = cutlass.Int32(0)  # of the item's sequence, before the item (CP segments)
        malformed = cutlass.Boolean(False)
        if cutlass.const_expr(self.segmented):
            seg_row = cute.make_tensor(segments + seq * SEGMENT_FIELDS, cute.make_layout(SEGMENT_FIELDS))
            checkpoint_row = seg_row[SEG_SEQ]
            tokens_before = seg_row[SEG_SEQ_OFFSET]
            seq_start = cutlass.Int64(seg_row[SEG_FIRST_TOKEN])
            first_slot = seg_row[SEG_FIRST_SLOT]
            length = seg_row[SEG_TOKENS]
            init_index = seg_row[SEG_INIT_INDEX]
            final_index = seg_row[SEG_FINAL_INDEX]
            # The row's flags; the launch's status word and checkpoint bits.
            flags = seg_row[SEG_FLAGS] | (flags & (FLAG_STATUS | FLAG_BF16_CHECKPOINT | FLAG_CHECKPOINT_OFFSETS))
        elif cutlass.const_expr(self.varlen):
            seq_start, first_slot, length, malformed = varlen_sequence(cu_seqlens, num_seqs, seq, seq_len)
        else:
            seq_start = cutlass.Int64(seq) * cutlass.Int64(seq_len)
            first_slot = seq * ((seq_len + (CHUNK - 1)) // CHUNK)
        num_tiles = (length + (CHUNK - 1)) // CHUNK

        # ---- Sᵀ slice into accumulator fragments: value 4j + c is (V row g + 8·(c // 2),
        # key 8j + 2t + c % 2) -------------------------------------------------------------------
        # State pools: the row's index is a sequence number and the slot is state_indices[n]
        # (outside the pool: a zero start and no write).
        init_index, read_init, final_index, write_final, bad_slot = state_slots(
            state_indices, flags, init_index, bounds.init_slots, final_index, bounds.final_slots
        )
        # Prefix-cache checkpoints.
        checkpoint_tile = cutlass.Int32(-1)
        checkpoint_misaligned = cutlass.Boolean(False)
        if cutlass.const_expr(self.checkpointing):
            checkpoint_tile, _, checkpoint_misaligned = checkpoint_schedule(
                checkpoint.offsets, flags, checkpoint_row, checkpoint.every, tokens_before
            )
        if tid == 0:
            report_item_status(bounds.status, flags, malformed, bad_slot, checkpoint_misaligned)
        if cutlass.const_expr(self.segmented):
            # Launched as a programmatic dependent (``ops.prefill``): the start state of a CP segment
            # is the merge's output, so nothing of the predecessor's is read before its grid is done.
            cute.arch.griddepcontrol_wait()
        first_out = cutlass.Int32(0)
        if cutlass.const_expr(self.walk):
            # A piece walks back over the tile bounds (they follow the H·total_slots records):
            # certified w tiles back, it starts there from zero; else from its sequence's start and
            # initial state.  The warm-up tiles write no output.
            c0 = tokens_before // CHUNK
            records = cutlass.Int64(grid_heads()) * cutlass.Int64(total_slots)
            bounds = cute.recast_ptr(workspace + records * WORKSPACE_RECORD_BYTES, dtype=cutlass.Float32)
            slot = cutlass.Int64(head) * cutlass.Int64(total_slots) + cutlass.Int64(first_slot)
            walked = certified_warmup(bounds + slot, c0, lane)
            if walked < c0:
                read_init = cutlass.Int32(0)
            seq_start = seq_start - cutlass.Int64(walked * CHUNK)
            first_slot = first_slot - walked
            length = length + walked * CHUNK
            num_tiles = num_tiles + walked
            first_out = walked
        state = cute.make_rmem_tensor(cute.make_layout(4 * N_TILES), cutlass.Float32)
        state.fill(0.0)
        if read_init != 0:
            read_state(state, initial_state, init_index, init, head, t, v_col, flags)
        if (flags & FLAG_IDENTITY_INIT) != 0:
            for i in cutlass.range_constexpr(4 * N_TILES):
                key, column = state_entry(t, v_col, i)
                state[i] = cutlass.Float32(1.0) if key == column else cutlass.Float32(0.0)
        load_v = (flags & FLAG_ZERO_V) == 0
        write_out = (flags & FLAG_NO_OUTPUT) == 0

        slot0 = cutlass.Int64(head) * cutlass.Int64(total_slots) + cutlass.Int64(first_slot)
        if tid == 0:
            for s in cutlass.range_constexpr(self.stages):
                cute.arch.mbarrier_init(full + s, 1)
            cute.arch.mbarrier_init_fence()
        if cutlass.const_expr(self.multicast):
            # Every CTA's barriers are initialised before any slice lands in it.
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()
        if cutlass.const_expr(not self.segmented):
            # Serial K2 is K1's programmatic dependent: everything above reads the caller's tensors
            # only (lengths, pool indices, the start state), so it overlaps K1's tail; the workspace
            # records are K1's and come after its grid is done.
            cute.arch.griddepcontrol_wait()
        # This warp's v block of stage s starts at v_base + s · warps · V_WARP_BYTES.
        v_base = s_v.iterator.toint() + warp * V_WARP_BYTES
        staging = VStaging(v, v_row_stride, head, warp_col0, lane, load_v, v_base, warps * V_WARP_BYTES)
        for s in cutlass.range_constexpr(self.stages - 1):
            if tid == 0:
                if s < num_tiles:
                    _issue_stage_loads(
                        workspace,
                        stage_pointer(s_stages, s, stage_nbytes),
                        full + s,
                        (slot0 + cutlass.Int64(s)) * WORKSPACE_RECORD_BYTES,
                        stage_nbytes,
                        cluster_ctas,
                        rank,
                    )
            stage_v_rows(staging, staging.slot(s), seq_start + cutlass.Int64(s * CHUNK), length - s * CHUNK)
            cute.arch.cp_async_commit_group()

        image_lane = image_lane_offset(lane)
        image_trans_lane = image_trans_lane_offset(lane)
        square_lane = square_lane_offset(lane)
        out_stride = cutlass.Int64(out_row_stride)

        ctx = _ChainContext(
            cluster_ctas=cluster_ctas,
            full=full,
            head=head,
            image_lane=image_lane,
            image_trans_lane=image_trans_lane,
            lane=lane,
            length=length,
            multicast=self.multicast,
            num_tiles=num_tiles,
            out=out,
            out_stride=out_stride,
            prescan=self.prescan,
            rank=rank,
            s_stages=s_stages,
            seq_start=seq_start,
            slot0=slot0,
            square_lane=square_lane,
            staging=staging,
            stage_nbytes=stage_nbytes,
            stages=self.stages,
            state=state,
            t=t,
            tid=tid,
            warp=warp,
            warp_col0=warp_col0,
            wgmma=self.wgmma,
            workspace=workspace,
            write_out=write_out,
            walk=self.walk,
            first_out=first_out,
        )
        if cutlass.const_expr(self.checkpointing):
            # The tiles run up to each checkpoint (one run without any), the write between runs; a
            # run carries its tiles' addresses and self.stages (``TileCursor``).
            run_start = cutlass.Int32(0)
            while run_start < num_tiles:
                run_end = checkpoint_run_end(checkpoint_tile, num_tiles)
                token0, rows_left, out_row0, stage, ahead_stage, phase, ahead_record = run_cursor(
                    run_start, seq_start, length, out_stride, slot0, self.stages
                )
                for tile in cutlass.range(run_start, run_end, unroll=1):
                    _chain_tile(
                        ctx,
                        tile,
                        stage,
                        ahead_stage,
                        phase,
                        cursor=TileCursor(token0, rows_left, out_row0, ahead_record),
                    )
                    token0, rows_left, out_row0, stage, ahead_stage, phase, ahead_record = next_tile(
                        token0, rows_left, out_row0, stage, ahead_stage, phase, ahead_record, out_stride, self.stages
                    )
                if run_end - 1 == checkpoint_tile:
                    checkpoint_tile = write_checkpoint(
                        state,
                        checkpoint_tile,
                        length,
                        checkpoint,
                        checkpoint_row,
                        tokens_before,
                        head,
                        t,
                        v_col,
                        flags,
                        bounds.status,
                        tid == 0,
                    )
                run_start = run_end
        else:
            for tile in cutlass.range(num_tiles, unroll=1):
                _chain_tile(
                    ctx, tile, tile % self.stages, (tile + (self.stages - 1)) % self.stages, (tile // self.stages) % 2
                )
        if cutlass.const_expr(self.multicast):
            # The last tile's barrier: no CTA leaves while a peer may still self.multicast into it.
            if num_tiles > 0:
                cute.arch.cluster_wait()

        if write_final != 0:
            write_state(state, final_state, final_index, final, head, t, v_col, flags)

    kernel = k2_recurrence
