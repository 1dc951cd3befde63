"""Fused prefill: K1's per-tile preparation and K2's recurrence in one CTA per (sequence, head),
the record of each tile kept in shared memory instead of a global workspace round trip.

What it computes: K1 (``k1_prepare``) followed by the 64-column warpgroup-MMA K2
(``k2_recurrence`` with ``wgmma``) for all 128 V columns of one (sequence, head), with the same
rounding points; one arithmetic difference, within an fp32 rounding: kr = k̂·2^−G·2^G[15] (one
MUFU op fewer per element than K1's k̂·2^(G[15] − G)); on standard inputs o and the state match
the two-kernel path to ~1e-6.

Roles (warp-specialised, ``producers`` + 2 warpgroups):

* the **producers** (warpgroup p, p < ``producers``: K1's 128 threads each) take tiles p, p + P,
  p + 2P, …: each TMA-loads its tiles' q, k, g into its own two load buffers (its next tile's
  loads fly while it computes one), runs K1's phases A–D and writes the tile's record into stage
  ``tile % stages``: it waits on the stage's ``empty`` barrier before its first store and arrives
  on its ``full`` barrier after a proxy fence (the consumers' wgmma read the stage through the
  async proxy).  Its barriers are named barrier 1 + p over its 128 threads; phase D runs in
  warp p's registers (producer p − 1's runs on another scheduler).
* the two **consumers** (the last two warpgroups, V columns 0–63 and 64–127): K2's tile chain on
  warpgroup MMAs, each warp staging its own 16 × 16 v block ``stages − 1`` tiles ahead; every
  consumer thread arrives on the stage's ``empty`` barrier once the state update has read it.

Registers: with two producers (512 threads) ``setmaxnreg`` gives the producers
``FUSED_PRODUCER_REGISTERS`` and the consumers ``FUSED_CONSUMER_REGISTERS`` (the state alone is
64 per consumer thread); ptxas compiles each role to its budget without spills.

Stage layout (``STAGE_PART_OFFSETS``): K1's record parts, the images' 8-token × 16-byte core
matrices with key groups 160 bytes apart instead of K_INTER's 256, so the producers' row stores
are conflict-free; the wgmma descriptors take the same strides.

Why: the two-kernel path writes and reads a 13.9 KB record per (tile, head), ~60% of all the
bytes moved at H64 8×1024 (PERFORMANCE.md, Fused prefill); fused, only q, k, g, v, β in and o out
remain.  The price is one (sequence, head) per SM with K1's work on two warpgroups (~1.8 µs
per tile against K2's ~0.5), so it pays only with enough long items (``specs.auto_fused``).

Launch: grid (1, H, N), block (128·producers + 256, 1, 1), ``smem_bytes(stages, producers)``
dynamic shared memory, one CTA per SM.  Constraints as K1 and K2 (D = 128, CHUNK = 16, any H;
the gate a codegen argument as in K1).  One variant per gate serves fixed and varlen input:
under ``FLAG_VARLEN`` grid row z is a sequence of ``cu_seqlens`` (the z-th longest under
``FLAG_LONGEST_FIRST``), else rows z·seq_len …  Device values are bounded as in K2: cu_seqlens
entries clamped, pool slots outside each pool's slot count are padding, both reported in the
status word under ``FLAG_STATUS``.  With ``checkpointing`` (a codegen argument: the variant
without it has no checkpoint code) the consumers also write the state after every
``checkpoint_every``-th token to the slot ``checkpoint_indices`` names, as K2 does.
"""

import dataclasses

import cutlass
import cutlass.cute as cute

from ..layout import (
    FLAG_STATUS,
    FLAG_SUCCESSOR,
    FLAG_VARLEN,
    IMAGE_BYTES,
    SEG_FINAL_INDEX,
    SEG_FIRST_TOKEN,
    SEG_FLAGS,
    SEG_INIT_INDEX,
    SEG_PREDECESSOR,
    SEG_SEQ_OFFSET,
    SEG_TOKENS,
    SEGMENT_FIELDS,
)
from ..specs import (
    FUSED_CONSUMER_REGISTERS,
    FUSED_PRODUCER_REGISTERS,
    PIECE_WARMUP_TILES,
    TRUNCATION_LOG2,
    fused_threads,
)
from .common import CHUNK, D, grid_heads, sigmoid, varlen_sequence
from .params import Checkpoints, PieceTables, PoolBounds, StateStrides
from .gate import Gate
from .prepare_tile import (
    TokenTileKernel,
    gate_constants,
    decayed_partials,
    LANE_COLS,
    NORM_PARTIALS,
    PRODUCT_PARTIALS,
    WARPS,
    copy_tiles,
    gate_cumsum,
    normalised_and_gates,
    reduce_and_invert,
    vector,
    lane_columns,
    lane_rows,
    load_fragments,
)
from .tile_chain import (
    report_item_status,
    checkpoint_run_end,
    checkpoint_schedule,
    state_slots,
    N_TILES,
    STAGE_ALIGN,
    V_WARP_BYTES,
    longest_first,
    square_lane_offset,
    stage_pointer,
    stage_v_rows,
    VStaging,
    v_chunk,
    issue_state_update,
    read_state,
    tile_u,
    tile_w,
    wgmma_state_products,
    store_checkpoint,
    write_state,
)
from .warp_mma import (
    accumulators_as_a,
    ld_global_cg_v4_f32,
    ld_shared_v4,
    ldmatrix_x4,
    mma_bf16_m16n8k16,
    pack_bf16x2,
    st_global_v4,
    st_global_v4_f32,
    stmatrix_x4_trans,
)
from .tile_bound import RecordImages, frobenius_log2
from .warpgroup_mma import smem_descriptor, wgmma_fence, wgmma_wait

WARP = 32
PRODUCER_THREADS = WARPS * WARP  # K1's warpgroup
CONSUMER_WARPS = D // 16  # one warp per 16 V columns, two warpgroups


# A tile's record in a stage: K1's parts, with the images' 8-token × 16-byte core matrices laid
# out for the producer's stores instead of K_INTER's: key groups 160 bytes apart (≡ 32 mod 128),
# so the 8 row stores of a store phase (2 rows × 4 key groups) hit 8 distinct bank groups (with
# K_INTER's 256 they were 4-way conflicts, ncu: 60% of the shared store wavefronts), the second 8
# tokens one image half on.  The wgmma descriptors take the same strides.
STAGE_KEY_GROUP_BYTES = 160
STAGE_TOKEN_HALF_BYTES = (D // 8) * STAGE_KEY_GROUP_BYTES
STAGE_IMAGE_BYTES = 2 * STAGE_TOKEN_HALF_BYTES
STAGE_PART_BYTES = {
    "kd": STAGE_IMAGE_BYTES,
    "kr": STAGE_IMAGE_BYTES,
    "qd": STAGE_IMAGE_BYTES,
    "inv": CHUNK * CHUNK * 2,
    "mqk": CHUNK * CHUNK * 2,
    "gt": D * 4,
    "b": CHUNK * 4,
}
STAGE_PART_OFFSETS = {}
STAGE_BYTES = 0
for _part, _bytes in STAGE_PART_BYTES.items():  # the parts back to back, in this order
    STAGE_PART_OFFSETS[_part] = STAGE_BYTES
    STAGE_BYTES += _bytes
assert all(o % STAGE_ALIGN == 0 for o in (STAGE_BYTES, *STAGE_PART_OFFSETS.values()))
STAGE_K_STEP_UNITS = 2 * STAGE_KEY_GROUP_BYTES // 16  # a wgmma k-step: 16 keys, two key groups


def _stage_lane_offset(lane):
    """Byte offset of this lane's ldmatrix row in a stage image's keys 0-15: matrix m = lane // 8
    is (token block m // 2, key group m % 2), row lane % 8 of it."""
    return ((lane // 8) % 2) * STAGE_KEY_GROUP_BYTES + (lane // 16) * STAGE_TOKEN_HALF_BYTES + (lane % 8) * 16


def _stage_trans_lane_offset(lane):
    """The same for ``ldmatrix.trans``: matrix m = lane // 8 is (key group m // 2, token block m % 2)."""
    return (lane // 16) * STAGE_KEY_GROUP_BYTES + ((lane // 8) % 2) * STAGE_TOKEN_HALF_BYTES + (lane % 8) * 16


# A stage's images for the tile bound (``tile_bound.frobenius_log2``).
STAGE_IMAGES = RecordImages(
    STAGE_PART_OFFSETS["kd"],
    STAGE_PART_OFFSETS["kr"],
    STAGE_PART_OFFSETS["inv"],
    2 * STAGE_KEY_GROUP_BYTES,
    _stage_lane_offset,
    _stage_trans_lane_offset,
)


def stage_image_offset(row, col):
    """Byte offset of element (token ``row``, key ``col``) of a stage image."""
    return (col // 8) * STAGE_KEY_GROUP_BYTES + (row // 8) * STAGE_TOKEN_HALF_BYTES + (row % 8) * 16 + (col % 8) * 2


def _stage_part(stage_base: cute.Pointer, part: str, dtype):
    """Pointer to ``part`` of the record in a stage, as ``dtype``."""
    return cute.recast_ptr(stage_base + STAGE_PART_OFFSETS[part], dtype=dtype)


def _stage_part_view(stage_base: cute.Pointer, part: str, dtype) -> cute.Tensor:
    """``part`` of the record in a stage as a 1-D tensor of ``dtype``."""
    return cute.make_tensor(
        _stage_part(stage_base, part, dtype), cute.make_layout(STAGE_PART_BYTES[part] * 8 // dtype.width)
    )


@cute.jit
def _store_stage_image_row(stage_base: cute.Pointer, part: cutlass.Constexpr[str], values: cute.Tensor, row, col0):
    """One lane's 8 values of ``row`` (columns col0 .. col0 + 7) as bf16 into stage image ``part``:
    16 contiguous bytes, one shared vector store."""
    words = cute.make_rmem_tensor(cute.make_layout(LANE_COLS // 2), cutlass.Int32)
    for m in cutlass.range_constexpr(LANE_COLS // 2):
        words[m] = pack_bf16x2(values[2 * m], values[2 * m + 1])
    image = cute.recast_ptr(stage_base + STAGE_PART_OFFSETS[part], dtype=cutlass.Int32)
    vector(image, stage_image_offset(row, col0) // 4, LANE_COLS // 2).store(words.load())


# A producer's share of shared memory: the load buffers and their barriers, the norm and
# product exchanges (no s_info: each producer thread knows its tiles; phase D is in registers).
PRODUCER_SMEM_BYTES = 6 * IMAGE_BYTES + 16 + 4 * NORM_PARTIALS + 4 * PRODUCT_PARTIALS


def smem_bytes(stages: int, producers: int) -> int:
    """Dynamic shared memory: each producer's buffers, the record stages, the consumers' v
    stages, the stage barriers and alignment slack."""
    return (
        producers * PRODUCER_SMEM_BYTES + stages * (STAGE_BYTES + CONSUMER_WARPS * V_WARP_BYTES) + 16 * stages + 8 * 128
    )


def pieces_smem_bytes(stages: int, producers: int) -> int:
    """``smem_bytes`` and the fused pieces' certification word."""
    return smem_bytes(stages, producers) + 16


INPUT_ELEMS = 2 * 3 * CHUNK * D  # two load buffers of q, k, g tiles


def _slice(whole: cute.Tensor, index, count: int) -> cute.Tensor:
    """Elements [index·count, (index + 1)·count) of a 1-D shared array (``index`` dynamic)."""
    return cute.make_tensor(whole.iterator + cute.assume(index * count, divby=4), cute.make_layout(count))


def _producer_sync(producer):
    """Named barrier 1 + p over producer p's 128 threads (0 is the CTA's)."""
    cute.arch.barrier(barrier_id=1 + producer, number_of_threads=PRODUCER_THREADS)


@dataclasses.dataclass(frozen=True)
class _ConsumerContext:
    """What one tile of the consumers' chain reads: geometry, stages, barriers, fragments and the
    state (trace-time values)."""

    bound_warp: object  # the consumer warp that forms the warm-up tiles' bounds (fused pieces)
    empty: object
    full: object
    head: object
    lane: object
    length: object
    out: object
    out_stride: object
    s_stages: object
    seq_start: object
    square_lane: object
    staging: object
    stages: object
    state: object
    t: object
    warp_col0: object


@cute.jit
def _consumer_tile(ctx, tile, stage, ahead_stage, phase, warm_up=False):
    """Tile ``tile`` of a consumer warp's chain from stage ``stage`` (barrier phase ``phase``),
    staging v of the tile stages − 1 ahead into ``ahead_stage``; ``ctx``: the warp's chain
    context (``_ConsumerContext``).  A ``warm_up`` tile (fused pieces) writes no output, and the
    bound warp returns log2 of its map's bound (``tile_bound.frobenius_log2``)."""
    stage_base = stage_pointer(ctx.s_stages, stage, STAGE_BYTES)
    ahead = tile + (ctx.stages - 1)
    stage_v_rows(
        ctx.staging,
        ctx.staging.slot(ahead_stage),
        ctx.seq_start + cutlass.Int64(ahead * CHUNK),
        ctx.length - ahead * CHUNK,
    )
    cute.arch.cp_async_commit_group()
    rows_valid = cutlass.min(ctx.length - tile * CHUNK, CHUNK)
    token0 = ctx.seq_start + cutlass.Int64(tile * CHUNK)
    cute.arch.cp_async_wait_group(ctx.stages - 1)
    cute.arch.sync_warp()
    v_regs = ldmatrix_x4(ctx.staging.slot(stage) + ctx.square_lane, transpose=True)
    cute.arch.mbarrier_wait(ctx.full + stage, phase)
    base = stage_base.toint()
    b_rows = _stage_part_view(stage_base, "b", cutlass.Float32)
    gt = _stage_part_view(stage_base, "gt", cutlass.Float32)

    # -- Sᵀ·kdᵀ and Sᵀ·qdᵀ (K2, wgmma) ---------------------------------------------------
    a_steps = [accumulators_as_a(ctx.state, 8 * kt) for kt in range(D // 16)]
    kd_b = smem_descriptor(base + STAGE_PART_OFFSETS["kd"], STAGE_KEY_GROUP_BYTES, STAGE_TOKEN_HALF_BYTES)
    wgmma_fence()
    ks_acc = wgmma_state_products([cutlass.Float32(0.0)] * 8, a_steps, kd_b, STAGE_K_STEP_UNITS)
    if cutlass.const_expr(warm_up):
        ks_acc = wgmma_wait(0, ks_acc)
    else:
        qs_acc = [cutlass.Float32(0.0)] * 8
        qd_b = smem_descriptor(base + STAGE_PART_OFFSETS["qd"], STAGE_KEY_GROUP_BYTES, STAGE_TOKEN_HALF_BYTES)
        qs_acc = wgmma_state_products(qs_acc, a_steps, qd_b, STAGE_K_STEP_UNITS)
        ks_acc = wgmma_wait(1, ks_acc)

    # -- Wᵀ = (Vᵀ − Sᵀkdᵀ)·diag(b), Uᵀ = Wᵀ·INVᵀ ---------------------------------------
    w = tile_w(v_regs, b_rows, ks_acc, ctx.t)
    a_u = tile_u(w, base, STAGE_PART_OFFSETS["inv"], ctx.square_lane)

    # -- Sᵀ ← Sᵀ·diag(gtot) + Uᵀ·kr, in flight under the O work ------------------------
    updated = issue_state_update(
        ctx.state, gt, ctx.t, a_u, base, STAGE_PART_OFFSETS["kr"], STAGE_TOKEN_HALF_BYTES, STAGE_KEY_GROUP_BYTES
    )

    # -- Oᵀ = Sᵀqdᵀ + Uᵀ·Mqkᵀ, out through the warp's v slot ----------------------------
    if cutlass.const_expr(not warm_up):
        qs_acc = wgmma_wait(1, qs_acc)
        b_mqk = ldmatrix_x4(base + STAGE_PART_OFFSETS["mqk"] + ctx.square_lane)
        o_pairs = []
        for n in cutlass.range_constexpr(2):
            d_o = mma_bf16_m16n8k16(a_u, b_mqk[2 * n : 2 * n + 2], [qs_acc[4 * n + c] for c in range(4)])
            o_pairs += [pack_bf16x2(d_o[0], d_o[1]), pack_bf16x2(d_o[2], d_o[3])]
        o_slot = ctx.staging.slot(stage)
        stmatrix_x4_trans(o_slot + ctx.square_lane, o_pairs)
        cute.arch.sync_warp()
        words = ld_shared_v4(o_slot + ctx.lane * 16)
        out_row, out_half = v_chunk(ctx.lane)
        if out_row < rows_valid:
            at = (token0 + cutlass.Int64(out_row)) * ctx.out_stride + cutlass.Int64(
                ctx.head * D + ctx.warp_col0 + out_half * 8
            )
            st_global_v4((ctx.out + at).toint(), words)
    updated = wgmma_wait(0, updated)
    for i in cutlass.range_constexpr(4 * N_TILES):
        ctx.state[i] = updated[i]
    bound = cutlass.Float32(0.0)
    if cutlass.const_expr(warm_up):
        if ctx.bound_warp:
            bound = frobenius_log2(base, b_rows, gt, ctx.lane, STAGE_IMAGES)
    # The update has read the stage's kr (and the bound its images): the producer may refill it.
    cute.arch.mbarrier_arrive(ctx.empty + stage)
    return bound if warm_up else None


def _consumer_sync(producers: int):
    """Named barrier 1 + producers over the two consumer warpgroups."""
    cute.arch.barrier(barrier_id=1 + producers, number_of_threads=CONSUMER_WARPS * WARP)


def _ready_flag(pieces: PieceTables, item):
    """Item ``item``'s ready flag (after the H ticket counters)."""
    return pieces.ready + grid_heads() + item


def _carry_address(pieces: PieceTables, item, consumer, chunk: int):
    """Global address of 16-byte chunk ``chunk`` of consumer thread ``consumer``'s state values in
    item ``item``'s published end state (thread-fastest, so each chunk's stores coalesce)."""
    at = cutlass.Int64(item) * cutlass.Int64(D * D) + cutlass.Int64((chunk * CONSUMER_WARPS * WARP + consumer) * 4)
    return (pieces.carries + at).toint()


@cute.jit
def _publish_carry(state: cute.Tensor, pieces: PieceTables, item, consumer, producers: int):
    """Item ``item``'s end state out for its successor, then its ready flag: the barrier orders
    every consumer thread's stores before consumer 0's GPU-scope fence and release, which is
    cumulative over them (one fence, not one per thread)."""
    for chunk in cutlass.range_constexpr(4 * N_TILES // 4):
        st_global_v4_f32(_carry_address(pieces, item, consumer, chunk), [state[4 * chunk + c] for c in range(4)])
    _consumer_sync(producers)
    if consumer == 0:
        cute.arch.fence_acq_rel_gpu()
        cute.arch.store(_ready_flag(pieces, item), cutlass.Int32(1), sem="release", scope="gpu")


@cute.jit
def _unless_certified_take_carry(
    state: cute.Tensor, bound, decision, pieces: PieceTables, predecessor, consumer, producers: int
):
    """The consumers' start after a warm-up from zero: kept where the warm-up tiles' bounds
    (``bound``, their log2 sum, on the bound warp) certify that the dropped state reaches the
    piece's first tile attenuated by ≤ 2^TRUNCATION_LOG2; else replaced by item
    ``predecessor``'s published end state, the exact state there, once its flag is set (it took
    an earlier ticket, so it is running or done).  A NaN bound never certifies."""
    if consumer == 0:
        cute.make_tensor(decision, cute.make_layout(1))[0] = cutlass.select_(
            bound <= cutlass.Float32(TRUNCATION_LOG2), 1, 0
        )
    _consumer_sync(producers)
    if cute.make_tensor(decision, cute.make_layout(1))[0] == 0:
        if consumer == 0:
            seen = cutlass.Int32(0)
            while seen == 0:
                seen = cute.arch.load(_ready_flag(pieces, predecessor), cutlass.Int32, sem="acquire", scope="gpu")
        _consumer_sync(producers)
        for chunk in cutlass.range_constexpr(4 * N_TILES // 4):
            values = ld_global_cg_v4_f32(_carry_address(pieces, predecessor, consumer, chunk))
            for c in cutlass.range_constexpr(4):
                state[4 * chunk + c] = values[c]


@cute.jit
def _load_tiles(atoms: tuple, token_coords: cute.Tensor, inputs: cute.Tensor, barriers, buffer, token0, head, lane):
    """A producer's warp 0: lane 0 arms load buffer ``buffer``'s barrier for the q, k, g tiles of
    rows [token0, token0 + 16), and the warp issues them (``copy_tiles``)."""
    if lane == 0:
        cute.arch.mbarrier_arrive_and_expect_tx(barriers + buffer, 3 * IMAGE_BYTES)
    copy_tiles(atoms, token_coords, inputs, buffer, barriers + buffer, token0, head)


class FusedPrefill(TokenTileKernel):
    """The fused prefill of one variant (``specs.FusedSpec``): the codegen arguments here, the
    launch in ``TokenTileKernel.__call__``, the device code in ``kernel`` (docs/DESIGN.md, Kernels
    as classes).  The entry symbol is the former function's, ``kernel_cutlass_fused_prefill_kernel_<the
    parameters' types, cut at 180 characters>_0``."""

    min_blocks_per_mp = 1

    def __init__(self, stages: int, producers: int, gate: str, checkpointing: bool):
        self.stages = stages
        self.producers = producers
        self.gate = gate
        self.checkpointing = checkpointing

    @property
    def threads(self) -> int:
        return fused_threads(self.producers)

    @property
    def smem_bytes(self) -> int:
        return smem_bytes(self.stages, self.producers)

    @cute.kernel
    def fused_prefill(
        self,
        tma_q: cute.CopyAtom,
        tma_k: cute.CopyAtom,
        tma_g: cute.CopyAtom,
        beta: cute.Pointer,
        a_log: cute.Pointer,
        dt_bias: cute.Pointer,
        v: cute.Pointer,
        out: cute.Pointer,
        initial_state: cute.Pointer,
        final_state: cute.Pointer,
        cu_seqlens: cute.Pointer,
        state_indices: cute.Pointer,
        seq_len: cutlass.Int32,
        num_seqs: cutlass.Int32,
        beta_row_stride: cutlass.Int32,
        v_row_stride: cutlass.Int32,
        out_row_stride: cutlass.Int32,
        init: StateStrides,
        final: StateStrides,
        flags: cutlass.Int32,
        scale: cutlass.Float32,
        lower_bound: cutlass.Float32,
        bounds: PoolBounds,
        checkpoint: Checkpoints,
        token_coords: cute.Tensor,
    ):
        self._run(
            tma_q,
            tma_k,
            tma_g,
            beta,
            a_log,
            dt_bias,
            v,
            out,
            initial_state,
            final_state,
            cu_seqlens,
            state_indices,
            seq_len,
            num_seqs,
            beta_row_stride,
            v_row_stride,
            out_row_stride,
            init,
            final,
            flags,
            scale,
            lower_bound,
            bounds,
            checkpoint,
            token_coords,
            None,
        )

    @cute.jit
    def _run(
        self,
        tma_q: cute.CopyAtom,
        tma_k: cute.CopyAtom,
        tma_g: cute.CopyAtom,
        beta: cute.Pointer,
        a_log: cute.Pointer,
        dt_bias: cute.Pointer,
        v: cute.Pointer,
        out: cute.Pointer,
        initial_state: cute.Pointer,
        final_state: cute.Pointer,
        cu_seqlens: cute.Pointer,
        state_indices: cute.Pointer,
        seq_len: cutlass.Int32,
        num_seqs: cutlass.Int32,
        beta_row_stride: cutlass.Int32,
        v_row_stride: cutlass.Int32,
        out_row_stride: cutlass.Int32,
        init: StateStrides,
        final: StateStrides,
        flags: cutlass.Int32,
        scale: cutlass.Float32,
        lower_bound: cutlass.Float32,
        bounds: PoolBounds,
        checkpoint: Checkpoints,
        token_coords: cute.Tensor,
        pieces,
    ):
        tid, _, _ = cute.arch.thread_idx()
        gate = Gate(self.gate)  # asked, not compared by name (kernels/gate.py)
        _, head, seq = cute.arch.block_idx()
        warp = tid // WARP
        lane = tid % WARP

        smem = cutlass.utils.SmemAllocator()
        s_stages = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(self.stages * STAGE_BYTES), 128)
        s_v = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(self.stages * CONSUMER_WARPS * V_WARP_BYTES), 128)
        full = smem.allocate_array(cutlass.Int64, self.stages)
        empty = smem.allocate_array(cutlass.Int64, self.stages)
        # Each producer's own K1 buffers, side by side: two load buffers and their barriers, the
        # norm and product exchanges.
        all_inputs = smem.allocate_tensor(cutlass.BFloat16, cute.make_layout(self.producers * INPUT_ELEMS), 128)
        all_load_barriers = smem.allocate_array(cutlass.Int64, 2 * self.producers)
        all_norms = smem.allocate_tensor(cutlass.Float32, cute.make_layout(self.producers * NORM_PARTIALS), 16)
        all_parts = smem.allocate_tensor(cutlass.Float32, cute.make_layout(self.producers * PRODUCT_PARTIALS), 16)

        # ---- this work item: first token, length (as K2's serial path) ------------------------
        if cutlass.const_expr(pieces is None):
            seq_start = cutlass.Int64(seq) * cutlass.Int64(seq_len)
            length = seq_len
            malformed = cutlass.Boolean(False)
            if (flags & FLAG_VARLEN) != 0:
                scratch = cute.recast_ptr(s_stages.iterator, dtype=cutlass.Int32)
                seq = longest_first(cu_seqlens, num_seqs, seq, flags, scratch, tid, self.threads, seq_len)
                seq_start, _first_slot, length, malformed = varlen_sequence(cu_seqlens, num_seqs, seq, seq_len)
        else:
            # The row by ticket, one counter per head: the head's rows in the table's order
            # whatever order the CTAs start in, so a row waited on (an earlier one of the same head)
            # has started: it is running or done.  The head stays the grid's (no register to hold).
            s_item = smem.allocate_array(cutlass.Int32, 4)  # [0]: the ticket, [1]: the certificate
            if tid == 0:
                cute.make_tensor(s_item, cute.make_layout(1))[0] = cute.arch.atomic_add(
                    pieces.ready + head, cutlass.Int32(1), sem="relaxed", scope="gpu"
                )
            cute.arch.sync_threads()
            num_heads = grid_heads()
            seq = cute.make_tensor(s_item, cute.make_layout(1))[0]
            # Piece row ``seq``: its own tokens after ``warm`` tiles of its sequence that it runs
            # without output, from a zero state, or from the sequence's initial state where they
            # reach its start (exact).
            row = cute.make_tensor(pieces.segments + seq * SEGMENT_FIELDS, cute.make_layout(SEGMENT_FIELDS))
            c0 = row[SEG_SEQ_OFFSET] // CHUNK
            warm = cutlass.min(c0, PIECE_WARMUP_TILES)
            seq_start = cutlass.Int64(row[SEG_FIRST_TOKEN] - warm * CHUNK)
            length = row[SEG_TOKENS] + warm * CHUNK
            malformed = cutlass.Boolean(False)
            flags = row[SEG_FLAGS] | (flags & FLAG_STATUS)  # the row's, and the launch's status bit
        num_tiles = (length + (CHUNK - 1)) // CHUNK

        if tid == 0:
            for b in cutlass.range_constexpr(2 * self.producers):
                cute.arch.mbarrier_init(all_load_barriers + b, 1)
            for s in cutlass.range_constexpr(self.stages):
                cute.arch.mbarrier_init(full + s, PRODUCER_THREADS)
                cute.arch.mbarrier_init(empty + s, CONSUMER_WARPS * WARP)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        if warp < WARPS * self.producers:
            # ================= producers: K1's phases per tile, the record into a stage ==========
            # Producer p (warps 4p .. 4p + 3) prepares tiles p, p + P, p + 2P, …
            if cutlass.const_expr(self.producers > 1):
                cute.arch.setmaxregister_decrease(FUSED_PRODUCER_REGISTERS)
            producer = warp // WARPS
            pw = warp % WARPS  # the warp within its producer (K1's warp index)
            # The warp that inverts (I + L): producer p's warp p, on another scheduler than p − 1's.
            inverse_warp = producer % 2
            s_inputs = _slice(all_inputs, producer, INPUT_ELEMS)
            load_barriers = all_load_barriers + 2 * producer
            s_norm = _slice(all_norms, producer, NORM_PARTIALS)
            s_part = _slice(all_parts, producer, PRODUCT_PARTIALS)
            atoms = (tma_q, tma_k, tma_g)
            my_tiles = (num_tiles - producer + (self.producers - 1)) // self.producers
            if pw == 0:
                for b in cutlass.range_constexpr(2):
                    if b < my_tiles:
                        first = seq_start + (producer + b * self.producers) * CHUNK
                        _load_tiles(atoms, token_coords, s_inputs, load_barriers, b, first, head, lane)
            col0 = lane_columns(pw, lane)
            my_rows = lane_rows(lane)
            # The softplus producers recompute their gate constants every tile (L1 hits): held across
            # the loop, two of them spilled and the kernel ran 4-5% slower.  The safe producers keep
            # them hoisted: recomputed, they spill instead.
            constants = gate_constants(a_log, dt_bias, head, col0, lower_bound, lane, gate)
            for mine in cutlass.range(my_tiles, unroll=1):
                if cutlass.const_expr(gate.recomputes_constants):
                    constants = gate_constants(a_log, dt_bias, head, col0, lower_bound, lane, gate)
                gate_scale, gate_bias, gamma_scale, has_source = constants
                i = producer + mine * self.producers
                buffer = mine % 2
                stage = i % self.stages
                token0 = seq_start + cutlass.Int64(i * CHUNK)
                rows = cutlass.min(length - i * CHUNK, CHUNK)
                cute.arch.mbarrier_wait(load_barriers + buffer, (mine // 2) % 2)

                # ---- phase A (K1): the lane's fragments, row norms -----------------------------
                valid, vq, vk, vg = load_fragments(s_inputs.iterator, buffer, my_rows, col0, rows, s_norm, pw)
                logit = cutlass.Float32(-float("inf"))
                if pw == inverse_warp:
                    if lane < rows:
                        beta_at = beta + (token0 + lane) * cutlass.Int64(beta_row_stride) + cutlass.Int64(head)
                        logit = cute.make_tensor(beta_at, cute.make_layout(1))[0].to(cutlass.Float32)
                _producer_sync(producer)
                # Every thread of this producer has read the buffer: refill it with its tile after next.
                if pw == 0:
                    if mine + 2 < my_tiles:
                        ahead = token0 + 2 * self.producers * CHUNK
                        _load_tiles(atoms, token_coords, s_inputs, load_barriers, buffer, ahead, head, lane)
                # The stage is free once both consumer warpgroups are done with tile i − stages.
                if i >= self.stages:
                    cute.arch.mbarrier_wait(empty + stage, ((i // self.stages) + 1) % 2)
                record = stage_pointer(s_stages, stage, STAGE_BYTES)

                # ---- phase B (K1): q̂, k̂, γ, the cumsum G and the decayed operands -------------
                qhat, khat, gamma = normalised_and_gates(
                    vq, vk, vg, valid, s_norm, my_rows, gate_scale, gate_bias, gamma_scale, gate
                )
                cum, total, gtot = gate_cumsum(gamma, has_source, lane)  # safe: kr uses 2^G[15], not G[15]
                if lane < 4:
                    vector(_stage_part(record, "gt", cutlass.Float32), col0, LANE_COLS).store(gtot.load())

                def store_images(half, qd, kd, kr):
                    for part, values in (("qd", qd), ("kd", kd), ("kr", kr)):
                        _store_stage_image_row(record, part, values, my_rows[half], col0)

                # ---- phase C (K1): L and Mqk, split over keys by warp ---------------------------
                decayed_partials(
                    qhat, khat, cum, total, gtot, scale, store_images, s_part, pw, lane, gate, kr_from_kinv=True
                )
                b = cutlass.Float32(0.0)
                if pw == inverse_warp:
                    b = sigmoid(logit)
                    if lane < CHUNK:
                        cute.make_tensor(_stage_part(record, "b", cutlass.Float32), cute.make_layout(CHUNK))[lane] = b
                _producer_sync(producer)
                # ---- phases C–D: one warp sums L and inverts (I + L) in registers; warps 2–3 Mqk ---
                reduce_and_invert(
                    lambda name, dtype: _stage_part(record, name, dtype), s_part, b, pw, inverse_warp, lane
                )

                # The record's generic stores before the consumers' wgmma reads (async proxy).
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.mbarrier_arrive(full + stage)
        else:
            # ================= consumers: K2's wgmma tile chain, 64 V columns per warpgroup =====
            if cutlass.const_expr(self.producers > 1):
                cute.arch.setmaxregister_increase(FUSED_CONSUMER_REGISTERS)
            cw = warp - WARPS * self.producers
            g = lane // 4
            t = lane % 4
            warp_col0 = cw * 16
            v_col = warp_col0 + g
            init_index = seq
            final_index = seq
            if cutlass.const_expr(pieces is not None):
                init_index = row[SEG_INIT_INDEX]
                final_index = row[SEG_FINAL_INDEX]
            init_index, read_init, final_index, write_final, bad_slot = state_slots(
                state_indices, flags, init_index, bounds.init_slots, final_index, bounds.final_slots
            )
            if cutlass.const_expr(pieces is not None):
                read_init = cutlass.select_(warm == c0, read_init, 0)  # only an exact start reads it
            checkpoint_tile = cutlass.Int32(-1)
            checkpoint_misaligned = cutlass.Boolean(False)
            if cutlass.const_expr(self.checkpointing):
                checkpoint_tile, checkpoint_column, checkpoint_misaligned = checkpoint_schedule(
                    checkpoint.offsets, flags, seq, checkpoint.every, cutlass.Int32(0)
                )
                # What the writes need, derived here: nothing both roles read stays live to them.
                checkpoint_row = seq * checkpoint.columns
                whole_tiles = length // CHUNK
            if (cw == 0) & (lane == 0):
                report_item_status(bounds.status, flags, malformed, bad_slot, checkpoint_misaligned)
            state = cute.make_rmem_tensor(cute.make_layout(4 * N_TILES), cutlass.Float32)
            state.fill(0.0)
            if read_init != 0:
                read_state(state, initial_state, init_index, init, head, t, v_col, flags)
            v_base = s_v.iterator.toint() + cw * V_WARP_BYTES
            staging = VStaging(v, v_row_stride, head, warp_col0, lane, True, v_base, CONSUMER_WARPS * V_WARP_BYTES)
            for s in cutlass.range_constexpr(self.stages - 1):
                stage_v_rows(staging, staging.slot(s), seq_start + cutlass.Int64(s * CHUNK), length - s * CHUNK)
                cute.arch.cp_async_commit_group()
            square_lane = square_lane_offset(lane)
            out_stride = cutlass.Int64(out_row_stride)
            bound_warp = cw == 0
            if cutlass.const_expr(pieces is not None):
                bound_warp = bound_warp & (warm < c0)  # an exact start needs no certificate
            ctx = _ConsumerContext(
                bound_warp=bound_warp,
                empty=empty,
                full=full,
                head=head,
                lane=lane,
                length=length,
                out=out,
                out_stride=out_stride,
                s_stages=s_stages,
                seq_start=seq_start,
                square_lane=square_lane,
                staging=staging,
                stages=self.stages,
                state=state,
                t=t,
                warp_col0=warp_col0,
            )
            if cutlass.const_expr(self.checkpointing):
                # Runs of tiles up to each checkpoint, the write between runs, as in K2.
                run_start = cutlass.Int32(0)
                while run_start < num_tiles:
                    run_end = checkpoint_run_end(checkpoint_tile, num_tiles)
                    for tile in cutlass.range(run_start, run_end, unroll=1):
                        at = cutlass.Uint32(tile)
                        _consumer_tile(
                            ctx,
                            tile,
                            cutlass.Int32(at % self.stages),
                            cutlass.Int32((at + (self.stages - 1)) % self.stages),
                            cutlass.Int32((at // self.stages) % 2),
                        )
                    if run_end - 1 == checkpoint_tile:
                        store_checkpoint(
                            state,
                            (checkpoint_tile < whole_tiles) & (checkpoint_column < checkpoint.columns),
                            checkpoint_row + checkpoint_column,
                            checkpoint,
                            head,
                            t,
                            v_col,
                            flags,
                            bounds.status,
                            (cw == 0) & (lane == 0),
                        )
                        checkpoint_tile = checkpoint_tile + checkpoint.every // CHUNK
                        checkpoint_column = checkpoint_column + 1
                    run_start = run_end
            elif cutlass.const_expr(pieces is not None):
                # The warm-up, then the piece's own tiles from the warm-up's state where its bounds
                # certify it, else from its predecessor's published end state.
                bound = cutlass.Float32(0.0)
                for tile in cutlass.range(warm, unroll=1):
                    bound = bound + _consumer_tile(
                        ctx,
                        tile,
                        tile % self.stages,
                        (tile + (self.stages - 1)) % self.stages,
                        (tile // self.stages) % 2,
                        warm_up=True,
                    )
                consumer = tid - WARPS * WARP * self.producers
                if warm < c0:
                    predecessor = row[SEG_PREDECESSOR] * num_heads + head
                    _unless_certified_take_carry(
                        state, bound, s_item + 1, pieces, predecessor, consumer, self.producers
                    )
                for tile in cutlass.range(warm, num_tiles, unroll=1):
                    _consumer_tile(
                        ctx,
                        tile,
                        tile % self.stages,
                        (tile + (self.stages - 1)) % self.stages,
                        (tile // self.stages) % 2,
                    )
            else:
                for tile in cutlass.range(num_tiles, unroll=1):
                    _consumer_tile(
                        ctx,
                        tile,
                        tile % self.stages,
                        (tile + (self.stages - 1)) % self.stages,
                        (tile // self.stages) % 2,
                    )

            if write_final != 0:
                write_state(
                    state,
                    final_state,
                    final_index,
                    final,
                    head,
                    t,
                    v_col,
                    flags,
                )
            if cutlass.const_expr(pieces is not None):
                if (flags & FLAG_SUCCESSOR) != 0:
                    _publish_carry(state, pieces, seq * num_heads + head, consumer, self.producers)

    kernel = fused_prefill


class FusedPieces(FusedPrefill):
    """The fused prefill over certified pieces (``specs.FusedPiecesSpec``): ``FusedPrefill``'s
    roles over the rows of a piece table, one CTA per (row, head) item (docs/DESIGN.md, Certified
    truncation).  A piece runs ``PIECE_WARMUP_TILES`` tiles of its sequence before its own from a
    zero state, no output, while the bound warp (consumer warp 0) forms each warm-up tile's bound
    from the stage the producers wrote; certified, the piece goes on from there, else it waits for
    its predecessor's published end state.  Every piece with a successor publishes its
    end state and sets its ready flag.  Rows carry absolute tokens (fixed and varlen alike); a CTA
    takes its row by ticket (an atomic counter per head), in the table's order, where a
    predecessor comes first: a row waited on has started, so it is running or done.  No
    checkpoint writes."""

    def __init__(self, stages: int, producers: int, gate: str, checkpointing: bool):
        assert not checkpointing, "the fused pieces kernel writes no checkpoints"
        super().__init__(stages, producers, gate, checkpointing)

    @property
    def smem_bytes(self) -> int:
        return pieces_smem_bytes(self.stages, self.producers)

    @cute.kernel
    def fused_pieces(
        self,
        tma_q: cute.CopyAtom,
        tma_k: cute.CopyAtom,
        tma_g: cute.CopyAtom,
        beta: cute.Pointer,
        a_log: cute.Pointer,
        dt_bias: cute.Pointer,
        v: cute.Pointer,
        out: cute.Pointer,
        initial_state: cute.Pointer,
        final_state: cute.Pointer,
        cu_seqlens: cute.Pointer,
        state_indices: cute.Pointer,
        seq_len: cutlass.Int32,
        num_seqs: cutlass.Int32,
        beta_row_stride: cutlass.Int32,
        v_row_stride: cutlass.Int32,
        out_row_stride: cutlass.Int32,
        init: StateStrides,
        final: StateStrides,
        flags: cutlass.Int32,
        scale: cutlass.Float32,
        lower_bound: cutlass.Float32,
        bounds: PoolBounds,
        checkpoint: Checkpoints,
        pieces: PieceTables,
        token_coords: cute.Tensor,
    ):
        self._run(
            tma_q,
            tma_k,
            tma_g,
            beta,
            a_log,
            dt_bias,
            v,
            out,
            initial_state,
            final_state,
            cu_seqlens,
            state_indices,
            seq_len,
            num_seqs,
            beta_row_stride,
            v_row_stride,
            out_row_stride,
            init,
            final,
            flags,
            scale,
            lower_bound,
            bounds,
            checkpoint,
            token_coords,
            pieces,
        )

    kernel = fused_pieces
