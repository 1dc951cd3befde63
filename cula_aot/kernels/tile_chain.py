"""K2's per-tile chain and its state I/O, shared by K2 (``k2_recurrence.py``) and the fused prefill's
consumers (``fused_prefill.py``): the state's load and store (key pairs where the layout allows),
the v staging, the wgmma state products, W, U and the state update, and the longest-first grid
order.  See ``k2_recurrence``'s docstring for the fragment layouts."""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute

from ..layout import (
    FLAG_BF16_CHECKPOINT,
    FLAG_BF16_FINAL,
    FLAG_BF16_INIT,
    FLAG_CHECKPOINT_OFFSETS,
    FLAG_FINAL_STATE,
    FLAG_INDEXED_FINAL,
    FLAG_INDEXED_INIT,
    FLAG_INITIAL_STATE,
    FLAG_LONGEST_FIRST,
    FLAG_STATUS,
    ORDER_MAX_SEQS,
    STATUS_SLOT_OUT_OF_RANGE,
    STATUS_CHECKPOINT_MISALIGNED,
    STATUS_CU_SEQLENS_MALFORMED,
)
from ..specs import K2_WARP_COLUMNS as WARP_COLUMNS
from .common import CHUNK, D, pool_slot, report_status, sequence_bounds
from .params import Checkpoints, StateStrides
from .warpgroup_mma import smem_descriptor, wgmma_bf16, wgmma_commit, wgmma_fence
from .warp_mma import accumulators_as_a, bf16_as_f32, cp_async_16, ldmatrix_x4, mma_bf16_m16n8k16, opaque_i32

N_TILES = D // 8  # m16n8 accumulator tiles per warp for its 16 × 128 slice of Sᵀ
STAGE_ALIGN = 32  # every part offset and stage size is a multiple of this
# Each warp's v block of one tile: 16 tokens × 16 columns bf16, rows of 32 bytes.
V_WARP_BYTES = CHUNK * WARP_COLUMNS * 2


def stage_pointer(stages: cute.Tensor, stage, nbytes: int):
    """Start of stage ``stage`` (dynamic; stages ``nbytes`` apart) with its alignment stated, so
    copies stay vectorised."""
    return stages.iterator + cute.assume(stage * nbytes, divby=STAGE_ALIGN)


def fragment_value(i: int):
    """(n-tile, row half, column) of value ``i`` of a two-n-tile accumulator over 16 tokens:
    V row ``g + 8·half``, token ``8·n_tile + 2t + column``."""
    return i // 4, (i // 2) % 2, i % 2


def state_entry(t, v_col, i: int):
    """(key k, V column) of value ``i`` of this thread's Sᵀ accumulator fragments: n-tile i // 4
    covers keys 8·(i // 4) .. + 7, value i % 4 is C entry (row g + 8·(c // 2), column 2t + c % 2)."""
    return (i // 4) * 8 + 2 * t + i % 2, v_col + 8 * ((i // 2) % 2)


def square_lane_offset(lane):
    """Byte offset of this lane's ldmatrix row in a row-major bf16 16×16 matrix (INV, Mqk, a
    warp's v block): matrix m = lane // 8 is (row block m // 2, column half m % 2)."""
    return ((lane // 16) * 8 + lane % 8) * (CHUNK * 2) + ((lane // 8) % 2) * 16


def image_lane_offset(lane):
    """Byte offset of this lane's ldmatrix row in a K_INTER image for k-step 0: matrix
    m = lane // 8 is (token block m // 2, column block m % 2), row lane % 8 of it."""
    return ((lane // 8) % 2) * (CHUNK * 16) + ((lane // 16) * 8 + lane % 8) * 16


def image_trans_lane_offset(lane):
    """Byte offset of this lane's ``ldmatrix.trans`` row in a K_INTER image for n-tile pair 0:
    matrix m = lane // 8 is (column block m // 2, token block m % 2)."""
    return (lane // 16) * (CHUNK * 16) + (((lane // 8) % 2) * 8 + lane % 8) * 16


def v_chunk(lane):
    """(token row, 8-column half) of the 16-byte piece of a warp's 16 × 16 v block that lane
    ``lane`` stages: the 32 lanes cover the block once."""
    return lane // 2, lane % 2


class VStaging(NamedTuple):
    """A warp's v staging (``stage_v_rows``): its 16 columns from ``warp_col0`` of head ``head`` of
    v (token rows ``row_stride`` elements apart) into its slot of each stage, stage s's at
    ``base + s · stage_bytes`` (``slot``); every row reads as 0 where not ``enabled``."""

    v: cute.Pointer
    row_stride: cutlass.Int32
    head: cutlass.Int32
    warp_col0: cutlass.Int32
    lane: cutlass.Int32
    enabled: cutlass.Boolean
    base: cutlass.Int32
    stage_bytes: int

    def slot(self, stage):
        """The shared address of this warp's v slot of stage ``stage``."""
        return self.base + stage * self.stage_bytes


@cute.jit
def stage_v_rows(staging: VStaging, smem_address, token0, rows_valid):
    """Lane l copies half ``l % 2`` (8 columns) of row ``l // 2`` of this warp's 16 × 16 v block
    of a tile into 32-byte smem rows at ``smem_address`` (a ``staging.slot``); rows past the end
    (or all, if not ``staging.enabled``) read as 0."""
    row, half = v_chunk(staging.lane)
    # Invalid rows still form an address: the tile's first row (the token of a valid tile, and
    # at worst a row of the same tensor when the whole tile is past the end).
    src_row = token0
    nbytes = cutlass.Int32(0)
    if row < rows_valid and staging.enabled:
        src_row = token0 + cutlass.Int64(row)
        nbytes = cutlass.Int32(16)
    at = src_row * cutlass.Int64(staging.row_stride) + cutlass.Int64(staging.head * D + staging.warp_col0 + half * 8)
    cp_async_16(smem_address + row * (WARP_COLUMNS * 2) + half * 16, (staging.v + at).toint(), nbytes)


@cute.jit
def state_slots(state_indices: cute.Pointer, flags, init_index, init_slots, final_index, final_slots):
    """An item's states in pools: its rows ``init_index`` / ``final_index`` are sequence numbers
    and the slots state_indices[row] (one outside its pool: a zero start, no write).  Returns
    (init_index, read_init, final_index, write_final, bad_slot): the indices to use, the flags'
    read and write bits (0 for padding) and whether a slot was out of range."""
    read_init = flags & FLAG_INITIAL_STATE
    write_final = flags & FLAG_FINAL_STATE
    bad_slot = cutlass.Boolean(False)
    if (flags & FLAG_INDEXED_INIT) != 0:
        init_index, usable, out_of_range = pool_slot(state_indices, init_index, init_slots)
        bad_slot = bad_slot | out_of_range
        read_init = cutlass.select_(usable, read_init, 0)
    if (flags & FLAG_INDEXED_FINAL) != 0:
        final_index, usable, out_of_range = pool_slot(state_indices, final_index, final_slots)
        bad_slot = bad_slot | out_of_range
        write_final = cutlass.select_(usable, write_final, 0)
    return init_index, read_init, final_index, write_final, bad_slot


def report_item_status(status: cute.Pointer, flags, malformed, bad_slot, checkpoint_misaligned):
    """A prefill work item's findings (K2, the fused prefill's consumers) into the caller's status
    word: a malformed cu_seqlens, a pool slot out of range, a misaligned checkpoint offset."""
    report_status(
        status,
        (flags & FLAG_STATUS) != 0,
        cutlass.select_(malformed, STATUS_CU_SEQLENS_MALFORMED, 0)
        | cutlass.select_(bad_slot, STATUS_SLOT_OUT_OF_RANGE, 0)
        | cutlass.select_(checkpoint_misaligned, STATUS_CHECKPOINT_MISALIGNED, 0),
    )


@cute.jit
def read_state(state: cute.Tensor, initial_state: cute.Pointer, index, strides: StateStrides, head, t, v_col, flags):
    """This thread's Sᵀ accumulator values (``state_entry``) from state ``index`` of
    ``initial_state``, fp32 or bf16 by ``FLAG_BF16_INIT``; keys k, k + 1 in one access where the
    layout puts them side by side (``paired``)."""
    strided_io(False, state, initial_state, index, strides, head, t, v_col, (flags & FLAG_BF16_INIT) != 0)


@cute.jit
def write_state(state: cute.Tensor, final_state: cute.Pointer, index, strides: StateStrides, head, t, v_col, flags):
    """This thread's Sᵀ accumulator values into state ``index`` of ``final_state``, fp32 or bf16 by
    ``FLAG_BF16_FINAL``; paired as ``read_state``."""
    strided_io(True, state, final_state, index, strides, head, t, v_col, (flags & FLAG_BF16_FINAL) != 0)


class StatePlace(NamedTuple):
    """Where this thread's Sᵀ values lie in a state tensor: state ``index`` of ``base`` (slots
    ``slot_stride`` elements apart), head ``head``, from key 2t and V column ``v_col`` on
    (``state_entry``)."""

    base: cute.Pointer
    index: cutlass.Int32
    slot_stride: cutlass.Int32
    head: cutlass.Int32
    t: cutlass.Int32
    v_col: cutlass.Int32


@cute.jit
def strided_io(
    write: cutlass.Constexpr[bool],
    state: cute.Tensor,
    base: cute.Pointer,
    index,
    strides: StateStrides,
    head,
    t,
    v_col,
    dtype_is_bf16,
):
    """``state_io`` of a state tensor with strides ``strides``."""
    place = StatePlace(base, index, strides.slot_stride, head, t, v_col)
    state_io(write, state, place, strides.stride_k, strides.stride_v, dtype_is_bf16)


@cute.jit
def checkpoint_schedule(checkpoint_offsets: cute.Pointer, flags, row, every, tokens_before):
    """(first tile, first column, misaligned) of work item ``row``'s checkpoints, the device twin
    of ``layout.checkpoint_schedule`` (``tokens_before``: a CP segment's ``SEG_SEQ_OFFSET``, else
    0).  First tile −1: none (``every`` 0, or a misaligned offset, which is then reported)."""
    offset = cutlass.Int32(0)
    enabled = every > 0
    if enabled:
        if (flags & FLAG_CHECKPOINT_OFFSETS) != 0:
            offset = cute.make_tensor(checkpoint_offsets + row, cute.make_layout(1))[0]
    misaligned = enabled & ((offset < 0) | ((offset % CHUNK) != 0))
    first_tile = cutlass.Int32(-1)
    column = cutlass.Int32(0)
    if enabled & (offset >= 0) & ((offset % CHUNK) == 0):
        start = offset % every + tokens_before
        first = every - start % every
        first_tile = first // CHUNK - 1
        column = (start + first) // every - 1
    return first_tile, column, misaligned


def checkpoint_run_end(checkpoint_tile, num_tiles):
    """One past the last tile of the run that ends at the next checkpoint (the item's last tile
    when none is left): a checkpointing chain runs its tiles in such runs and writes between them."""
    return cutlass.select_((checkpoint_tile >= 0) & (checkpoint_tile < num_tiles), checkpoint_tile + 1, num_tiles)


@cute.jit
def write_checkpoint(
    state: cute.Tensor,
    tile,
    length,
    checkpoint: Checkpoints,
    row,
    tokens_before,
    head,
    t,
    v_col,
    flags,
    status: cute.Pointer,
    reporter,
):
    """At a checkpoint tile (``checkpoint_schedule``): the state after ``tile`` into slot
    ``checkpoint_indices[row, column]`` when the tile is whole (``store_checkpoint``).  Returns
    the next checkpoint tile.  The column is recomputed from the schedule here, so the tile loop
    keeps one register for checkpoints: the next tile."""
    first_tile, column, _ = checkpoint_schedule(checkpoint.offsets, flags, row, checkpoint.every, tokens_before)
    every_tiles = checkpoint.every // CHUNK
    column = column + (tile - first_tile) // every_tiles
    store_checkpoint(
        state,
        ((tile + 1) * CHUNK <= length) & (column < checkpoint.columns),
        row * checkpoint.columns + column,
        checkpoint,
        head,
        t,
        v_col,
        flags,
        status,
        reporter,
    )
    return tile + every_tiles


@cute.jit
def store_checkpoint(
    state: cute.Tensor,
    wanted,
    index,
    checkpoint: Checkpoints,
    head,
    t,
    v_col,
    flags,
    status: cute.Pointer,
    reporter,
):
    """Where ``wanted`` (a whole tile, a column inside the slot map): this thread's Sᵀ values into
    slot ``checkpoint_indices[index]`` (fp32 or bf16 by ``FLAG_BF16_CHECKPOINT``; a slot outside
    the pool is padding, reported by ``reporter`` when out of range)."""
    if wanted:
        slot, usable, out_of_range = pool_slot(checkpoint.indices, index, checkpoint.slots)
        if usable:
            place = StatePlace(
                checkpoint.pool,
                slot,
                opaque_i32(checkpoint.strides.slot_stride),
                opaque_i32(head),
                opaque_i32(t),
                opaque_i32(v_col),
            )
            state_io(
                True,
                state,
                place,
                opaque_i32(checkpoint.strides.stride_k),
                opaque_i32(checkpoint.strides.stride_v),
                (flags & FLAG_BF16_CHECKPOINT) != 0,
            )
        if reporter:
            report_status(
                status, (flags & FLAG_STATUS) != 0, cutlass.select_(out_of_range, STATUS_SLOT_OUT_OF_RANGE, 0)
            )


@cute.jit
def state_io(write: cutlass.Constexpr[bool], state: cute.Tensor, place: StatePlace, stride_k, stride_v, dtype_is_bf16):
    """The case split ``read_state`` and ``write_state`` share (``write``: ``state`` into the
    state at ``place``, else from it): layout and dtype are runtime values ([.., V, K]:
    ``stride_k`` 1, ``stride_v`` 128; [.., K, V]: 128, 1), but an access's width, element type and
    offsets are fixed when it is traced, so each case is its own branch: ``pairs_io`` on a
    ``paired`` layout, else ``elements_io`` with the layout's strides, each bf16 or fp32."""
    if paired(stride_k, place.slot_stride):
        if dtype_is_bf16:
            pairs_io(write, state, place, cutlass.BFloat16)
        else:
            pairs_io(write, state, place, cutlass.Float32)
    elif stride_k == 1:
        if dtype_is_bf16:
            elements_io(write, state, place, 1, D, cutlass.BFloat16)
        else:
            elements_io(write, state, place, 1, D, cutlass.Float32)
    else:
        if dtype_is_bf16:
            elements_io(write, state, place, D, 1, cutlass.BFloat16)
        else:
            elements_io(write, state, place, D, 1, cutlass.Float32)


def paired(stride_k, slot_stride):
    """Whether a thread's keys k, k + 1 (k even, ``state_entry`` values i, i + 1) are one aligned
    pair in memory: the [.., V, K] layout (keys adjacent) with an even slot stride."""
    return (stride_k == 1) & ((slot_stride % 2) == 0)


def _thread_origin(place: StatePlace, stride_k: int, stride_v: int, dtype, align: int = 1):
    """This thread's first state element at ``place`` (``common.state_element``'s addressing): every value of its fragments lies a
    trace-time constant away (``_value_offset``), so the accesses take immediate offsets from
    one register pair."""
    ptr = place.base if dtype is cutlass.Float32 else cute.recast_ptr(place.base, dtype=dtype)
    at = cutlass.Int64(place.index) * cutlass.Int64(place.slot_stride) + cutlass.Int64(
        place.head * (D * D) + (2 * place.t) * stride_k + place.v_col * stride_v
    )
    if align > 1:
        at = cute.assume(at, divby=align)
    return ptr + at


def _value_offset(i: int, stride_k: int, stride_v: int) -> int:
    """Elements from ``_thread_origin`` to value ``i`` of the fragments (``state_entry``)."""
    return ((i // 4) * 8 + i % 2) * stride_k + 8 * ((i // 2) % 2) * stride_v


@cute.jit
def pairs_io(write: cutlass.Constexpr[bool], state: cute.Tensor, place: StatePlace, dtype):
    """``state_io`` on a ``paired`` layout ([.., V, K]): values i, i + 1 in one access."""
    origin = _thread_origin(place, 1, D, dtype, 2)
    for i in cutlass.range_constexpr(0, 4 * N_TILES, 2):
        if cutlass.const_expr(write):
            pair = cute.make_rmem_tensor(cute.make_layout(2), cutlass.Float32)
            pair[0] = state[i]
            pair[1] = state[i + 1]
            element = cute.make_tensor(origin + _value_offset(i, 1, D), cute.make_layout(2))
            element.store(pair.load().to(dtype))
        else:
            pair = cute.make_tensor(origin + _value_offset(i, 1, D), cute.make_layout(2)).load().to(cutlass.Float32)
            state[i] = pair[0]
            state[i + 1] = pair[1]


@cute.jit
def elements_io(
    write: cutlass.Constexpr[bool], state: cute.Tensor, place: StatePlace, stride_k: int, stride_v: int, dtype
):
    """``state_io`` on either layout: one value per access."""
    origin = _thread_origin(place, stride_k, stride_v, dtype)
    for i in cutlass.range_constexpr(4 * N_TILES):
        element = cute.make_tensor(origin + _value_offset(i, stride_k, stride_v), cute.make_layout(1))
        if cutlass.const_expr(write):
            element[0] = state[i].to(dtype)
        else:
            state[i] = element[0].to(cutlass.Float32)


@cute.jit
def wgmma_state_products(acc: list, a_steps: list, b_descriptor, k_step_units: int) -> list:
    """One 8-step wgmma chain Sᵀ·Xᵀ over the keys (A: the state's bf16 k-steps, B: image X's
    K-major descriptor, a k-step ``k_step_units`` on), committed as one group; in flight until
    ``wgmma_wait``."""
    for kt in cutlass.range_constexpr(D // 16):
        acc = wgmma_bf16(16, acc, a_steps[kt], b_descriptor + kt * k_step_units, False)
    wgmma_commit()
    return acc


@cute.jit
def tile_w(v_regs: list, b_rows: cute.Tensor, ks, t) -> cute.Tensor:
    """Wᵀ = (Vᵀ − Sᵀkdᵀ)·diag(b): 0 past the end, where K1 stored b = 0. v_regs[2·n_tile + half]
    holds the bf16 pair (token 8·n_tile + 2t + {0, 1}, column g + 8·half)."""
    w = cute.make_rmem_tensor(cute.make_layout(8), cutlass.Float32)
    for i in cutlass.range_constexpr(8):
        n_tile, half, column = fragment_value(i)
        v_value = bf16_as_f32(v_regs[2 * n_tile + half], column == 1)
        w[i] = b_rows[n_tile * 8 + 2 * t + column] * (v_value - ks[i])
    return w


@cute.jit
def tile_u(w: cute.Tensor, base, inv_offset: int, square_lane) -> list:
    """Uᵀ = Wᵀ·INVᵀ (B[j, i] = INV[i, j]: ldmatrix of the row-major INV at ``base + inv_offset``),
    as the A fragment of the products that follow."""
    a_w = accumulators_as_a(w, 0)
    b_inv = ldmatrix_x4(base + inv_offset + square_lane)
    u = cute.make_rmem_tensor(cute.make_layout(8), cutlass.Float32)
    for n in cutlass.range_constexpr(2):
        d_u = mma_bf16_m16n8k16(a_w, b_inv[2 * n : 2 * n + 2], [cutlass.Float32(0.0)] * 4)
        for c in cutlass.range_constexpr(4):
            u[4 * n + c] = d_u[c]
    return accumulators_as_a(u, 0)


@cute.jit
def issue_state_update(
    state: cute.Tensor, gt: cute.Tensor, t, a_u: list, base, kr_offset: int, leading: int, stride: int
) -> list:
    """Sᵀ ← Sᵀ·diag(gtot) + Uᵀ·kr issued: one m64n128k16 for the warpgroup, B = kr N-major at
    ``base + kr_offset`` (tokens lead, keys stride), the state the accumulator, scaled first; in
    flight until ``wgmma_wait``."""
    for i in cutlass.range_constexpr(4 * N_TILES):
        state[i] = state[i] * gt[8 * (i // 4) + 2 * t + i % 2]
    wgmma_fence()
    updated = wgmma_bf16(
        D, [state[i] for i in range(4 * N_TILES)], a_u, smem_descriptor(base + kr_offset, leading, stride), True
    )
    wgmma_commit()
    return updated


@cute.jit
def longest_first(cu_seqlens: cute.Pointer, num_seqs, row, flags, scratch: cute.Pointer, tid, threads: int, num_tokens):
    """The sequence grid row ``row`` runs: under ``FLAG_LONGEST_FIRST`` (and at most
    ``ORDER_MAX_SEQS`` sequences) the one whose rank by length (longest first, ties in index
    order) is ``row``, else ``row`` itself.  The CTA stages the lengths in ``scratch`` (shared,
    ``ORDER_MAX_SEQS`` + 1 words, free until the caller's barriers are set up) and each thread
    ranks its sequences.  Ranks are a permutation for any lengths, so every sequence still runs
    exactly once."""
    if (flags & FLAG_LONGEST_FIRST) != 0:
        if num_seqs <= ORDER_MAX_SEQS:
            cu = cute.make_tensor(cu_seqlens, cute.make_layout(num_seqs + 1))
            lengths = cute.make_tensor(scratch, cute.make_layout(ORDER_MAX_SEQS + 1))
            i = tid
            while i < num_seqs:
                start, end = sequence_bounds(cu, i, num_tokens)
                lengths[i] = end - start
                i = i + threads
            cute.arch.sync_threads()
            i = tid
            while i < num_seqs:
                mine = lengths[i]
                rank = cutlass.Int32(0)
                for j in cutlass.range(num_seqs, unroll=1):
                    other = lengths[j]
                    if (other > mine) | ((other == mine) & (j < i)):
                        rank = rank + 1
                if rank == row:
                    lengths[ORDER_MAX_SEQS] = i
                i = i + threads
            cute.arch.sync_threads()
            row = lengths[ORDER_MAX_SEQS]
    return row
