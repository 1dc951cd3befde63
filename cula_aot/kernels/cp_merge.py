"""Intracard CP "merge": chain the segment transitions of each sequence into start states.

What it computes (docs/CONTRACT.md §2, CP), for one sequence, one head and one block of
``v_block`` (8 or 16) state columns: with ``carry_0`` = the sequence's initial state (or 0),

    carries[s] = carry_i,   carry_1 = B_0,   carry_{i+1} = M_i · carry_i + B_i (i ≥ 1)

over the sequence's segments i = 0, 1, … in order, where ``M_i`` (the product of the segment's
tile transitions) and ``B_i`` (its end state from S = 0) were written by the pre_scan (K2 in
segmented mode) to ``prescan[2i]`` and ``prescan[2i + 1]``; for the first segment the pre_scan
ran the chain from carry_0 itself, so ``B_0`` is carry_1 and ``M_0`` is neither written nor
read (one step fewer on the carry chain).  All states here are fp32
[K, V] row-major per head ("kv"); the user's initial state is read with its own strides and
dtype (fp32 or bf16), from a state pool slot ``state_indices[n]`` when ``flags`` say so (a slot
outside the pool's ``init_slots`` is a zero start, reported in the status word under ``FLAG_STATUS``).

Tensor cores, at fp32 accuracy: each step is a 128×128 · 128×v_block product done as three tf32
``mma.sync.m16n8k8`` per fragment (hi/lo splits of both operands, "3xTF32", ~2^-21 relative
per product), since the carries are states and must not lose precision here; the three
products accumulate in three chains (B_i seeds the hi·hi one), summed once per step.  Eight warps:
warp w owns rows [16w, 16w + 16) (one m16 tile) × the block's columns (v_block / 8 n8 tiles); its
carry slice lives in accumulator fragments.  Only the carries form a chain: the transitions
(M_i, 64 KB, and B_i's block) stream ``stages(v_block) − 1`` steps ahead into smem stages with
16-byte ``cp.async`` (three stages for 8 columns, two for 16: 227 KB), and carry_i's split B
fragments are shared through smem.

Launch: grid (128 / v_block, H, N), block (256, 1, 1), ``smem_bytes(v_block)`` dynamic shared
memory (one CTA per SM: the M stages).  ``seq_segments`` (int32 [N + 1]) gives each sequence's
segment range.  8-column blocks give twice the CTAs for the same chain where the 16-column grid
leaves SMs idle (``specs.merge_v_block``).  Launched as the pre_scan's programmatic dependent
(``griddepcontrol.wait`` before the first transition read).
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute

from ..layout import FLAG_BF16_INIT, FLAG_INDEXED_INIT, FLAG_INITIAL_STATE, FLAG_STATUS, STATUS_SLOT_OUT_OF_RANGE
from ..specs import MERGE_THREADS as THREADS
from .common import D, TRACE_HEADS, grid_heads, pool_slot, report_status, state_element
from .warp_mma import cp_async_16, mma_tf32_m16n8k8, tf32_split


# carry_i as split tf32 (hi, lo) bits, [128 rows][v_block] with rows padded so the B fragment
# loads (rows 2t.., column g) hit 32 distinct banks: 24 words for 16 columns, 8 for 8.
def _carry_row(v_block: int) -> int:
    return {8: 8, 16: 24}[v_block]


# M_i stages: fp32 [128][128] with rows padded to 132 words, so the A fragment loads (rows g,
# columns t) hit 32 distinct banks.
_M_ROW = D + 4
_M_STAGE_BYTES = D * _M_ROW * 4
_CHUNKS_PER_THREAD = D * D * 4 // 16 // THREADS
_M_TILES = D // 16 // (THREADS // 32)  # m16 tiles per warp: warp w owns rows [16·_M_TILES·w, …)


def _b_stage_bytes(v_block: int) -> int:
    """One stage of B_i's block: fp32 [128][v_block], unpadded."""
    return D * v_block * 4


def stages(v_block: int) -> int:
    """(M, B) stages: three where they fit the 227 KB of shared memory (8 columns), else two."""
    return 3 if v_block == 8 else 2


def smem_bytes(v_block: int) -> int:
    """The M and B stages, the split carry (hi, lo), alignment slack."""
    n = stages(v_block)
    return n * _M_STAGE_BYTES + n * _b_stage_bytes(v_block) + 2 * D * _carry_row(v_block) * 4 + 128


def _fragment_index(m_tile: int, n_tile: int, c: int, n_tiles: int) -> int:
    return (m_tile * n_tiles + n_tile) * 4 + c


def fragment_entry(warp, lane, m_tile: int, n_tile: int, c: int):
    """(row k, column within the block) of accumulator value c of tile (m_tile, n_tile)."""
    return (warp * _M_TILES + m_tile) * 16 + lane // 4 + 8 * (c // 2), n_tile * 8 + 2 * (lane % 4) + c % 2


def _entry_of_value(warp, lane, i: int, n_tiles: int):
    """(row k, column) of value i of a thread's carry (``_fragment_index`` order)."""
    return fragment_entry(warp, lane, i // (4 * n_tiles), (i // 4) % n_tiles, i % 4)


class InitialState(NamedTuple):
    """The caller's start states (``specs.state_params("init")``): state ``index`` of head h at
    element ``index·slot_stride + h·128·128 + k·stride_k + v·stride_v``."""

    states: cute.Pointer
    slot_stride: cutlass.Int32
    stride_k: cutlass.Int32
    stride_v: cutlass.Int32


class TransitionSource(NamedTuple):
    """Where this CTA's transitions come from: the pre_scan's (M_i, B_i) pairs, for head ``head``
    of ``heads`` and the block's first state column ``col0``."""

    prescan: cute.Pointer
    heads: cutlass.Int32
    head: cutlass.Int32
    col0: cutlass.Int32


class StageBases(NamedTuple):
    """Shared-memory addresses of the first M and B stages."""

    m: cutlass.Int32
    b: cutlass.Int32


class CpMerge:
    """The merge of one ``v_block`` (``specs.MergeSpec``): compile-time configuration here, the
    launch in ``__call__``, the device code in ``kernel`` (docs/DESIGN.md, Kernels as classes).

    CuTeDSL names a kernel's entry ``kernel_cutlass_<function name>_<str of each positional
    argument, self included>_<n>``, and the name is part of the cubin.  The device function is
    defined as ``cp_merge`` (bound to ``kernel`` below) and ``str(self)`` is ``"kernel"``, so the
    entry is the one the former function ``cp_merge_kernel`` had; ``v_block`` stays a trailing
    positional Constexpr argument for the same reason (it names the specialization)."""

    def __init__(self, v_block: int):
        self.v_block = v_block
        self.n_tiles = v_block // 8
        self.n_stages = stages(v_block)
        self.n_values = _M_TILES * self.n_tiles * 4  # a thread's carry values
        self.b_stage_bytes = _b_stage_bytes(v_block)
        self.smem_bytes = smem_bytes(v_block)

    def __str__(self) -> str:
        return "kernel"  # the entry symbol's component for ``self`` (see the class docstring)

    @cute.jit
    def __call__(self, *params, stream):
        # ``params``: the kernel's runtime parameters (``specs.MERGE_PARAMS``); the grid is a
        # placeholder (the runtime launches the spec's).
        self.kernel(*params, self.v_block).launch(
            grid=[D // self.v_block, TRACE_HEADS, 1], block=[THREADS, 1, 1], smem=self.smem_bytes, stream=stream
        )

    @cute.jit
    def prefetch_transition(self, source: TransitionSource, bases: StageBases, stage, seg, tid, with_m):
        """Issue this thread's 16-byte ``cp.async`` chunks of M_seg (where ``with_m``: not for a
        sequence's first segment) into padded smem stage ``stage`` (a warp copies one 512-byte row
        per round, so the reads coalesce) and of B_seg's [128][v_block] block into B stage
        ``stage``, so the step's bias comes from shared memory too."""
        v_block = self.v_block
        m_stage_address = bases.m + stage * _M_STAGE_BYTES
        b_stage_address = bases.b + stage * self.b_stage_bytes
        prescan = source.prescan
        m_base = (cutlass.Int64(2 * seg) * source.heads + cutlass.Int64(source.head)) * (D * D)
        if with_m:
            for j in cutlass.range_constexpr(_CHUNKS_PER_THREAD):
                row = tid // 32 + j * (THREADS // 32)
                col = (tid % 32) * 4
                cp_async_16(
                    m_stage_address + (row * _M_ROW + col) * 4,
                    (prescan + m_base + cutlass.Int64(row * D + col)).toint(),
                    16,
                )
        b_base = m_base + cutlass.Int64(source.heads) * (D * D)
        row_chunks = v_block // 4
        for j in cutlass.range_constexpr(D * row_chunks // THREADS):
            chunk = tid + j * THREADS
            row = chunk // row_chunks
            col = (chunk % row_chunks) * 4
            cp_async_16(
                b_stage_address + (row * v_block + col) * 4,
                (prescan + b_base + cutlass.Int64(row * D + source.col0 + col)).toint(),
                16,
            )

    @cute.jit
    def load_initial_carry(self, carry: cute.Tensor, init: InitialState, index, head, col0, warp, lane, dtype):
        """carry ← the thread's fragment values of start state ``index`` (stored as ``dtype``,
        fp32 or bf16)."""
        for i in cutlass.range_constexpr(self.n_values):
            k, c = _entry_of_value(warp, lane, i, self.n_tiles)
            value = state_element(
                init.states, index, init.slot_stride, head, k, col0 + c, init.stride_k, init.stride_v, dtype
            )[0]
            carry[i] = value if dtype is cutlass.Float32 else value.to(cutlass.Float32)

    @cute.kernel
    def cp_merge(
        self,
        initial_state: cute.Pointer,
        prescan: cute.Pointer,
        carries: cute.Pointer,
        seq_segments: cute.Pointer,
        state_indices: cute.Pointer,
        num_seqs: cutlass.Int32,
        init_slot_stride: cutlass.Int32,
        init_stride_k: cutlass.Int32,
        init_stride_v: cutlass.Int32,
        flags: cutlass.Int32,
        status: cute.Pointer,
        init_slots: cutlass.Int32,
        v_block: cutlass.Constexpr[int],
    ):
        tid, _, _ = cute.arch.thread_idx()
        vblk, head, seq = cute.arch.block_idx()
        heads = grid_heads()
        warp = tid // 32
        lane = tid % 32
        g = lane // 4
        t = lane % 4
        col0 = vblk * v_block
        n_tiles = self.n_tiles
        n_stages = self.n_stages
        init = InitialState(initial_state, init_slot_stride, init_stride_k, init_stride_v)

        smem = cutlass.utils.SmemAllocator()
        carry_layout = cute.make_layout((D, v_block), stride=(_carry_row(v_block), 1))
        s_hi = smem.allocate_tensor(cutlass.Int32, carry_layout, 16)
        s_lo = smem.allocate_tensor(cutlass.Int32, carry_layout, 16)
        s_m = smem.allocate_tensor(
            cutlass.Float32, cute.make_layout((n_stages, D, D), stride=(D * _M_ROW, _M_ROW, 1)), 16
        )
        s_b = smem.allocate_tensor(
            cutlass.Float32, cute.make_layout((n_stages, D, v_block), stride=(D * v_block, v_block, 1)), 16
        )
        bases = StageBases(s_m.iterator.toint(), s_b.iterator.toint())
        source = TransitionSource(prescan, heads, head, col0)

        bounds = cute.make_tensor(seq_segments, cute.make_layout(num_seqs + 1))
        first = bounds[seq]
        last = bounds[seq + 1]

        n_values = self.n_values
        carry = cute.make_rmem_tensor(cute.make_layout(n_values), cutlass.Float32)
        carry.fill(0.0)
        read_init = flags & FLAG_INITIAL_STATE
        init_index = seq
        if (flags & FLAG_INDEXED_INIT) != 0:  # a state pool: slot state_indices[seq]; outside the pool: zero start
            init_index, usable, out_of_range = pool_slot(state_indices, seq, init_slots)
            read_init = cutlass.select_(usable, read_init, 0)
            if tid == 0:
                report_status(
                    status, (flags & FLAG_STATUS) != 0, cutlass.select_(out_of_range, STATUS_SLOT_OUT_OF_RANGE, 0)
                )
        if read_init != 0:
            if (flags & FLAG_BF16_INIT) != 0:
                self.load_initial_carry(carry, init, init_index, head, col0, warp, lane, cutlass.BFloat16)
            else:
                self.load_initial_carry(carry, init, init_index, head, col0, warp, lane, cutlass.Float32)

        # Launched as the pre_scan's programmatic dependent: the lengths and the caller's start state
        # above overlap its tail; the transition pairs are its output.
        cute.arch.griddepcontrol_wait()
        for j in cutlass.range_constexpr(n_stages - 1):  # the first steps' transitions, one group each
            if first + j + 1 < last:
                self.prefetch_transition(source, bases, j, first + j, tid, j > 0)
            cute.arch.cp_async_commit_group()
        acc_lh = cute.make_rmem_tensor(cute.make_layout(n_values), cutlass.Float32)
        acc_hl = cute.make_rmem_tensor(cute.make_layout(n_values), cutlass.Float32)
        for seg in cutlass.range(first, last, unroll=1):
            stage = (seg - first) % n_stages
            # The transition n_stages − 1 steps ahead into the stage step seg − 1 read (freed by its
            # barrier).
            ahead = seg + (n_stages - 1)
            ahead_stage = (stage + (n_stages - 1)) % n_stages
            if ahead + 1 < last:
                self.prefetch_transition(source, bases, ahead_stage, ahead, tid, True)
            cute.arch.cp_async_commit_group()
            for i in cutlass.range_constexpr(n_values):
                k, c = _entry_of_value(warp, lane, i, n_tiles)
                element = state_element(carries, seg, heads * D * D, head, k, col0 + c, D, 1)
                element[0] = carry[i]
            if (seg == first) & (first + 1 < last):
                # carry_1 = B_0, the first segment's end state from carry_0 (the pre_scan's).
                cute.arch.cp_async_wait_group(n_stages - 1)
                cute.arch.sync_threads()
                for i in cutlass.range_constexpr(n_values):
                    k, c = _entry_of_value(warp, lane, i, n_tiles)
                    carry[i] = s_b[stage, k, c]
                cute.arch.sync_threads()  # the stage is refilled n_stages − 1 steps on
            elif seg + 1 < last:
                for i in cutlass.range_constexpr(n_values):
                    k, c = _entry_of_value(warp, lane, i, n_tiles)
                    hi, lo = tf32_split(carry[i])
                    s_hi[k, c] = hi
                    s_lo[k, c] = lo
                # This thread's chunks of M_seg and B_seg have landed (the later steps' may not have).
                cute.arch.cp_async_wait_group(n_stages - 1)
                cute.arch.sync_threads()  # everyone's chunks, and the split carry, are visible
                # Three accumulation chains, one per product (hi·hi from the bias B_seg, lo·hi, hi·lo),
                # summed once at the end: each chain is 16 MMAs deep instead of one chain of 48.
                for i in cutlass.range_constexpr(n_values):
                    k, c = _entry_of_value(warp, lane, i, n_tiles)
                    carry[i] = s_b[stage, k, c]
                acc_lh.fill(0.0)
                acc_hl.fill(0.0)
                for ks in cutlass.range_constexpr(D // 8):
                    k0 = ks * 8
                    b_hi = [[s_hi[k0 + t, n * 8 + g], s_hi[k0 + t + 4, n * 8 + g]] for n in range(n_tiles)]
                    b_lo = [[s_lo[k0 + t, n * 8 + g], s_lo[k0 + t + 4, n * 8 + g]] for n in range(n_tiles)]
                    for m in cutlass.range_constexpr(_M_TILES):
                        row = (warp * _M_TILES + m) * 16 + g
                        m_at = [(row, k0 + t), (row + 8, k0 + t), (row, k0 + t + 4), (row + 8, k0 + t + 4)]
                        a_hi, a_lo = [], []
                        for r, kk in m_at:
                            hi, lo = tf32_split(s_m[stage, r, kk])
                            a_hi.append(hi)
                            a_lo.append(lo)
                        for n in cutlass.range_constexpr(n_tiles):
                            base = _fragment_index(m, n, 0, n_tiles)
                            for acc, a, b in (
                                (acc_lh, a_lo, b_hi[n]),
                                (acc_hl, a_hi, b_lo[n]),
                                (carry, a_hi, b_hi[n]),
                            ):
                                out = mma_tf32_m16n8k8(a, b, [acc[base + c] for c in range(4)])
                                for c in cutlass.range_constexpr(4):
                                    acc[base + c] = out[c]
                for i in cutlass.range_constexpr(n_values):
                    carry[i] = carry[i] + (acc_lh[i] + acc_hl[i])
                # s_hi/s_lo are rewritten by the next segment's step.
                cute.arch.sync_threads()

    kernel = cp_merge
