"""Intracard CP "merge": chain the segment transitions of each sequence into start states.

What it computes (shared/design/SPEC.md §2, CP), for one sequence, one head and one block of
``MERGE_V_BLOCK`` state columns: with ``carry_0`` = the sequence's initial state (or 0),

    carries[s] = carry_i,   carry_{i+1} = M_i · carry_i + B_i

over the sequence's segments i = 0, 1, … in order, where ``M_i`` (the product of the segment's
tile transitions) and ``B_i`` (its end state from S = 0) were written by the pre_scan (K2 in
segmented mode) to ``prescan[2i]`` and ``prescan[2i + 1]``.  All states here are fp32
[K, V] row-major per head ("kv"); the user's initial state is read with its own strides.

Launch: grid (128 / MERGE_V_BLOCK, H, N), block (128, 1, 1), ``SMEM_BYTES`` dynamic shared
memory.  ``seq_segments`` (int32 [N + 1]) gives each sequence's segment range.  Thread t owns
column ``t % MERGE_V_BLOCK`` and rows ``[kg·16, kg·16 + 16)``, ``kg = t // MERGE_V_BLOCK``.
"""

import cutlass
import cutlass.cute as cute

from ..layout import FLAG_INITIAL_STATE
from ..specs import MERGE_V_BLOCK
from .common import D, THREADS, state_element

_GROUPS = THREADS // MERGE_V_BLOCK
_K_PER = D // _GROUPS
SMEM_BYTES = D * MERGE_V_BLOCK * 4 + 128


@cute.kernel
def cp_merge_kernel(
    initial_state: cute.Pointer,
    prescan: cute.Pointer,
    carries: cute.Pointer,
    seq_segments: cute.Pointer,
    num_seqs: cutlass.Int32,
    init_stride_k: cutlass.Int32,
    init_stride_v: cutlass.Int32,
    flags: cutlass.Int32,
    heads: cutlass.Constexpr[int],
):
    tid, _, _ = cute.arch.thread_idx()
    vblk, head, seq = cute.arch.block_idx()
    col = tid % MERGE_V_BLOCK
    kg = tid // MERGE_V_BLOCK
    v_col = vblk * MERGE_V_BLOCK + col

    smem = cutlass.utils.SmemAllocator()
    s_carry = smem.allocate_tensor(cutlass.Float32, cute.make_layout((D, MERGE_V_BLOCK)), 16)

    bounds = cute.make_tensor(seq_segments, cute.make_layout(num_seqs + 1))
    first = bounds[seq]
    last = bounds[seq + 1]

    carry = cute.make_rmem_tensor(cute.make_layout(_K_PER), cutlass.Float32)
    carry.fill(0.0)
    if (flags & FLAG_INITIAL_STATE) != 0:
        for i in cutlass.range_constexpr(_K_PER):
            carry[i] = state_element(initial_state, seq, heads, head, kg * _K_PER + i, v_col,
                                     init_stride_k, init_stride_v)[0]

    for seg in cutlass.range(first, last, unroll=1):
        for i in cutlass.range_constexpr(_K_PER):
            element = state_element(carries, seg, heads, head, kg * _K_PER + i, v_col, D, 1)
            element[0] = carry[i]
        if seg + 1 < last:
            for i in cutlass.range_constexpr(_K_PER):
                s_carry[kg * _K_PER + i, col] = carry[i]
            cute.arch.sync_threads()
            m_base = (cutlass.Int64(2 * seg) * heads + cutlass.Int64(head)) * (D * D)
            b_base = (cutlass.Int64(2 * seg + 1) * heads + cutlass.Int64(head)) * (D * D)
            for i in cutlass.range_constexpr(_K_PER):
                k = kg * _K_PER + i
                acc = cute.make_tensor(prescan + b_base + cutlass.Int64(k * D + v_col), cute.make_layout(1))[0]
                m_row = prescan + m_base + cutlass.Int64(k * D)
                for j4 in cutlass.range(D // 4, unroll=4):
                    m4 = cute.make_tensor(m_row + j4 * 4, cute.make_layout(4)).load()
                    for e in cutlass.range_constexpr(4):
                        acc += m4[e] * s_carry[j4 * 4 + e, col]
                carry[i] = acc
            # s_carry is rewritten by the next segment's step.
            cute.arch.sync_threads()


@cute.jit
def cp_merge_launch(
    initial_state: cute.Pointer,
    prescan: cute.Pointer,
    carries: cute.Pointer,
    seq_segments: cute.Pointer,
    num_seqs: cutlass.Int32,
    init_stride_k: cutlass.Int32,
    init_stride_v: cutlass.Int32,
    flags: cutlass.Int32,
    stream,
    heads: cutlass.Constexpr[int],
):
    cp_merge_kernel(
        initial_state, prescan, carries, seq_segments, num_seqs, init_stride_k, init_stride_v, flags, heads,
    ).launch(grid=[D // MERGE_V_BLOCK, heads, num_seqs], block=[THREADS, 1, 1], smem=SMEM_BYTES, stream=stream)
