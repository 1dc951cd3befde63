"""Device helpers and constants shared by the KDA kernels (CuTeDSL; imported only by the build)."""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

from ..layout import CHUNK, D, IMAGE_BYTES, INPUT_BLOCK_COLS, WORKSPACE_PART_OFFSETS, k_inter_index

THREADS = 128

__all__ = [
    "CHUNK",
    "D",
    "IMAGE_BYTES",
    "THREADS",
    "LOG2E",
    "exp2_fast",
    "k_inter_index",
    "input_tile_layout",
    "input_element_offset",
    "make_token_tma",
    "record_part",
    "sigmoid",
    "butterfly_reduce_scatter",
    "kept_start",
    "state_element",
    "pool_slot",
    "report_status",
    "sequence_bounds",
    "sequence_start",
    "varlen_sequence",
    "varlen_slot_sequence",
    "slot_base",
]


LOG2E = 1.4426950408889634


def exp2_fast(x):
    """2^x with the hardware approximation (ex2.approx.ftz: ~2 ulp, two instructions)."""
    return cute.math.exp2(x, approx=True, ftz=True)


def log2_fast(x):
    """log2(x) with the hardware approximation (lg2.approx.ftz: absolute error ~2^-22)."""
    return cute.math.log2(x, approx=True, ftz=True)


def vector(base: cute.Pointer, offset, count: int) -> cute.Tensor:
    """``count`` consecutive elements at ``base + offset`` (``offset`` a multiple of ``count``),
    so that loads and stores of the whole view are single vector accesses."""
    return cute.make_tensor(base + cute.assume(offset, divby=count), cute.make_layout(count))


@cute.jit
def sigmoid(x):
    """σ(x) = 1 / (1 + 2^(−x·log2 e)) with approximate ex2 and rcp (relative error ~1e-7, far
    below the bf16 roundings that follow): ±inf give exactly 0 and 1, NaN stays NaN."""
    return cute.arch.rcp_approx(cutlass.Float32(1.0) + exp2_fast(x * cutlass.Float32(-LOG2E)))


def beta_weight(value, probability):
    """A row's b from its loaded β: the value itself when ``probability`` (``FLAG_BETA_PROBABILITY``),
    else σ(value)."""
    return cutlass.Float32(cutlass.select_(probability, value, sigmoid(value)))


def butterfly_reduce_scatter(values: list, lane_bits, offsets) -> list:
    """Sums the tuples ``values`` (per-lane partials, a power-of-two count) over the lanes that
    xor-ing ``offsets`` reaches.  Level b halves the tuples a lane keeps: it keeps the upper half
    where bit b of ``lane_bits`` is set and sends the other half to its partner across
    ``offsets[b]``, so it costs half the shuffles of an all-reduce; once one tuple is left, later
    levels all-reduce it (a + b on both partners: bit-identical).  Returns the tuples left: the
    totals of ``values[kept_start(..) ..]``; each total is summed by one lane (or identical pair)."""
    for level, off in enumerate(offsets):
        if len(values) > 1:
            half = len(values) // 2
            upper = ((lane_bits >> level) & 1) != 0
            kept = []
            for lo, hi in zip(values[:half], values[half:]):
                total = []
                for lo_x, hi_x in zip(lo, hi):
                    keep = cutlass.Float32(cutlass.select_(upper, hi_x, lo_x))
                    send = cutlass.Float32(cutlass.select_(upper, lo_x, hi_x))
                    total.append(keep + cute.arch.shuffle_sync_bfly(send, offset=off))
                kept.append(tuple(total))
            values = kept
        else:
            values = [tuple(x + cute.arch.shuffle_sync_bfly(x, offset=off) for x in values[0])]
    return values


def kept_start(lane_bits, count: int, levels: int):
    """Index in ``values`` of the first tuple ``butterfly_reduce_scatter`` leaves a lane
    (trace-time ints or dynamic Int32)."""
    start = 0
    for b in range(min(levels, count.bit_length() - 1)):
        start = start + ((lane_bits >> b) & 1) * (count >> (b + 1))
    return start


# Token-major input tensors [rows, H, 128] are viewed as 2-D [rows, H·128] for TMA; the row and
# head counts the kernels are traced with are placeholders (the runtime encodes the true ones in
# the descriptors and launches the true grid; the kernels read H from the grid, never from code).
TRACE_ROWS = 1 << 20
TRACE_HEADS = 128


def grid_heads():
    """H: the launch grid's second dimension (every kernel's grid is (·, H, ·))."""
    return cute.arch.grid_dim()[1]


# A 16×128 bf16 input tile in shared memory is four blocks of 16 rows × 32 columns (64-byte
# rows), each block one K1 warp's columns: the 8 lanes of a 16-byte read phase (rows g and
# g + 1, 4 lanes each) then cover 128 distinct bytes, where 256-byte rows put both rows on the
# same banks (2-way conflicts: twice the minimum wavefronts of every input read).  One 3-D TMA
# box (32 columns, 16 rows, 4 blocks) writes that order.
INPUT_BLOCKS = D // INPUT_BLOCK_COLS


def input_tile_layout():
    """An input tile in shared memory as (row, column in block, block)."""
    return cute.make_layout(
        (CHUNK, INPUT_BLOCK_COLS, INPUT_BLOCKS), stride=(INPUT_BLOCK_COLS, 1, CHUNK * INPUT_BLOCK_COLS)
    )


def input_element_offset(row, col):
    """Element offset of (row, col) of an input tile (col a multiple of 8 stays in one block row)."""
    return (col // INPUT_BLOCK_COLS) * (CHUNK * INPUT_BLOCK_COLS) + row * INPUT_BLOCK_COLS + col % INPUT_BLOCK_COLS


def make_token_tma(base: cute.Pointer):
    """(TMA load atom, coordinate tensor) for one input tile per copy of a [rows, H·128] bf16
    tensor viewed as (row, column in block, block of all heads); a tile is at (token0, 0, 4·head)."""
    view = cute.make_tensor(
        base,
        cute.make_layout(
            (TRACE_ROWS, INPUT_BLOCK_COLS, TRACE_HEADS * INPUT_BLOCKS), stride=(TRACE_HEADS * D, 1, INPUT_BLOCK_COLS)
        ),
    )
    return cpasync.make_tiled_tma_atom(
        cpasync.CopyBulkTensorTileG2SOp(), view, input_tile_layout(), (CHUNK, INPUT_BLOCK_COLS, INPUT_BLOCKS)
    )


def record_part(record: cute.Pointer, part: str, dtype):
    """Workspace ``part`` of one slot's record (global, or a K2 stage holding a copy of it) as a
    pointer to ``dtype`` (``layout.WORKSPACE_PART_OFFSETS``)."""
    return cute.recast_ptr(record + WORKSPACE_PART_OFFSETS[part], dtype=dtype)


@cute.jit
def sequence_start(cu_seqlens: cute.Tensor, seq, num_tokens):
    """``cu_seqlens[seq]`` clamped into [0, num_tokens]: no device value, however wrong, moves a
    read or a write outside the buffers (``layout.STATUS_CU_SEQLENS_MALFORMED``)."""
    return cutlass.max(cutlass.min(cu_seqlens[seq], num_tokens), 0)


@cute.jit
def sequence_bounds(cu_seqlens: cute.Tensor, seq, num_tokens):
    """[start, end) of varlen sequence ``seq``, clamped: start into [0, T], end into [start, T]
    (an end below its start makes the sequence empty)."""
    start = sequence_start(cu_seqlens, seq, num_tokens)
    return start, cutlass.max(cutlass.min(cu_seqlens[seq + 1], num_tokens), start)


@cute.jit
def slot_base(cu_seqlens: cute.Tensor, seq, num_tokens):
    """First tile slot of varlen sequence ``seq``: (start + 15·seq) // 16 (see K1's docstring).
    With clamped starts every sequence's slots stay below ``varlen_total_slots`` (the floor of
    a sum bounds the sum of floors), monotone ``cu_seqlens`` or not."""
    return (sequence_start(cu_seqlens, seq, num_tokens) + (CHUNK - 1) * seq) // CHUNK


@cute.jit
def varlen_slot_sequence(cu_seqlens_ptr: cute.Pointer, num_seqs, slot, num_tokens):
    """The varlen sequence whose slot range holds tile slot ``slot``: binary search for the last
    sequence whose first slot is ≤ ``slot`` (a slot past its tiles is a gap slot of it)."""
    cu = cute.make_tensor(cu_seqlens_ptr, cute.make_layout(num_seqs + 1))
    lo = cutlass.Int32(0)
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if slot_base(cu, mid, num_tokens) <= slot:
            lo = mid
        else:
            hi = mid - 1
    return lo


@cute.jit
def varlen_sequence(cu_seqlens_ptr: cute.Pointer, num_seqs, seq, num_tokens):
    """(first token, first tile slot, length, malformed) of varlen sequence ``seq``, its bounds
    clamped (``sequence_bounds``); ``malformed``: this sequence's entries needed the clamp, or
    the first entry is not 0."""
    cu = cute.make_tensor(cu_seqlens_ptr, cute.make_layout(num_seqs + 1))
    start, end = sequence_bounds(cu, seq, num_tokens)
    malformed = (start != cu[seq]) | (end != cu[seq + 1]) | ((seq == 0) & (start != 0))
    return cutlass.Int64(start), slot_base(cu, seq, num_tokens), end - start, malformed


def state_element(
    base: cute.Pointer, index, slot_stride, head, k, v, stride_k, stride_v, dtype=cutlass.Float32, count: int = 1
) -> cute.Tensor:
    """A one-element view of S[k, v] of head ``head`` in state ``index`` of a [slots, H, 128, 128]
    state tensor of ``dtype`` (fp32 or bf16; ``base`` is declared fp32 and recast): slots are
    ``slot_stride`` elements apart (H·128·128 when packed, more in a padded pool) and a head's
    element (k, v) sits at ``k·stride_k + v·stride_v`` ([.., V, K]: 1, 128; [.., K, V]: 128, 1).
    ``count`` 2: S[k, v] and the next element in memory, the offset asserted even (one aligned
    access; the caller checks that it is)."""
    ptr = base if dtype is cutlass.Float32 else cute.recast_ptr(base, dtype=dtype)
    at = cutlass.Int64(index) * cutlass.Int64(slot_stride) + cutlass.Int64(head * (D * D) + k * stride_k + v * stride_v)
    if count > 1:
        at = cute.assume(at, divby=count)
    return cute.make_tensor(ptr + at, cute.make_layout(count))


@cute.jit
def pool_slot(state_indices: cute.Pointer, seq, num_slots):
    """(slot, usable, out of range) of sequence ``seq`` in a state pool of ``num_slots`` slots:
    a slot outside [0, num_slots) is padding (zero start, nothing written); -1 is the padding
    value, any other such slot is out of range (``layout.STATUS_SLOT_OUT_OF_RANGE``)."""
    slot = cute.make_tensor(state_indices + seq, cute.make_layout(1))[0]
    return slot, (slot >= 0) & (slot < num_slots), (slot >= num_slots) | (slot < -1)


@cute.jit
def report_status(status: cute.Pointer, enabled, bits):
    """OR ``bits`` (``layout.STATUS_*``, 0: nothing to report) into the caller's status word when
    the call has one; atomic, so CTAs may report at once.  Only the error path stores."""
    if enabled:
        if bits != 0:
            cute.arch.red(status, bits, op="or", dtype="b32", sem="relaxed", scope="gpu")
