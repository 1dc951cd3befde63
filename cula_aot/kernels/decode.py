"""KDA decode: the token recurrence applied to states in a pool, in place (docs/CONTRACT.md §10).

What it computes, for one sequence n, one head h and one block of ``v_block`` value rows of
its state S (``[V, K]``, fp32 inside), for the tokens t = 0 .. T−1 in order
(T = ``num_tokens`` ≤ ``MAX_TOKENS``):

    γ = lower_bound·σ(exp(A_log[h])·(g + dt_bias[h]))   α = e^γ          (per key; the "safe" gate,
        or −exp(A_log[h])·softplus(g + dt_bias[h]) ("softplus") or min(g, 0) ("precomputed"))
    q̂, k̂ = x·rsqrt(Σx² + 1e-6) rounded to bf16         b = σ(β)
    (q, k as given under ``FLAG_QK_AS_GIVEN``, b = β under ``FLAG_BETA_PROBABILITY``: ``flags`` bits)
    S ← S·diag(α);   u = b·(v − S k̂);   o = scale·(S q̂ + u·(k̂·q̂));   S ← S + u k̂ᵀ

(``o = scale·S_new q̂`` written with the decayed state before the rank-1 update, so both dot
products of a row come from one pass and one reduction).  Every V row evolves independently,
so the work splits over (V block, head, sequence) with no communication between CTAs.

State.  ``slot = state_indices[index_offset + n]``; the head state is at
``state_pool + slot·slot_stride + h·128·128`` with S[v, k] at ``v·128 + k`` ("vk") or
``k·128 + v`` ("kv", ``kv_layout``), fp32 or bf16 (``bf16_state``; loaded once, carried fp32,
rounded once per store).  ``slot < 0`` or ``slot ≥ num_slots`` is a padding row: the CTA writes
zeros to its ``out`` rows and nothing else (no state read or written, never an out-of-range
access); a padding slot other than -1 is reported in the status word (``FLAG_STATUS``).  With ``flags & FLAG_INTERMEDIATE`` the state after every token t is also written to
``intermediate + ((n·T + t)·H + h)·128·128`` (same dtype and per-head layout as the pool).
With ``flags & FLAG_TOKEN_SLOTS`` (vLLM's speculative contract) ``state_indices`` is ``[N, T]``:
the state is read from slot ``state_indices[n, c]``, c = ``num_accepted[n] − 1`` clamped to
[0, T) under ``FLAG_ACCEPTED`` (a count outside [1, T] reported) or 0, and the state after
token t goes to slot ``state_indices[n, t]`` (skipped outside the pool) instead of back to the
slot read.

Thread tile.  Each thread owns 64 state values, ``VT`` V rows × ``KT`` keys, loaded and stored
as 16-byte vectors; the ``L = 128 / KT`` lanes that share its rows (a "group", one warp holds
``32 / L`` groups = 16 V rows) cover all 128 keys, and the row dot products are butterfly
shuffles over the group:

* "vk" (keys contiguous): VT = 4 rows, KT = 16 keys as 16/CE vectors of CE = 16 B / element
  keys; lane j of a group reads columns ``m·8·CE + j·CE ..``, so a group's lanes read 128
  contiguous bytes of a row per vector: L = 8.
* "kv" (V contiguous): one vector of CE V columns per key (VT = CE), keys ``j + L·i``
  (KT = 64 / CE): fp32 L = 8, bf16 L = 16.

Per CTA: the index load and the first token inputs go out together, the state loads then wait
for the index only; half-warps compute q̂, k̂, α, k̂·q̂, b per token into shared memory while
the state arrives; with ``items`` > 1 the CTA walks several V blocks of one head (one prologue),
the next block's state streaming into a shared-memory stage (cp.async) while the current one
computes: each thread refills its own part of the stage as soon as it has moved the last item
into registers, so loads stay in flight through the whole CTA.  Outputs are staged in smem
(bf16), stored as 16-byte vectors.

Launch: grid (128 / (items·v_block), H, N), block (2·v_block, 1, 1) (a warp per 16 V rows),
``specs.decode_smem_bytes(v_block, items, bf16_state, T)`` dynamic smem (built for T = 8; a launch asks
for its T: the per-token arrays are packed for the runtime T).  Compile-time: kv_layout, bf16_state, v_block,
items, gate (the unbounded gates decay the state token by token: ``token_step.direct_decay``).  Runtime: N, T, the pool's slot count and slot stride, every input's sequence and
token strides (q, k, v, g, out: ``[N, T, H, 128]`` with unit stride along D and head stride
128; β ``[N, T, H]`` with unit head stride), the element offsets of β and state_indices
(whose pointers are passed rounded down to 16 bytes), scale, lower_bound, flags.
"""

import functools
from typing import NamedTuple

import cutlass
import cutlass.cute as cute

from ..layout import STATUS_DRAFT_OUT_OF_RANGE, D
from ..specs import (
    DECODE_FLAG_ACCEPTED,
    DECODE_FLAG_INTERMEDIATE,
    DECODE_FLAG_STATUS,
    DECODE_FLAG_TOKEN_SLOTS,
    DECODE_MAX_TOKENS,
    decode_smem_bytes,
    decode_stage_bytes,
    decode_token_bytes,
)
from .common import butterfly_reduce_scatter, grid_heads, kept_start, report_status
from .gate import Gate
from .params import DecodeGeometry, DecodeTensors, TokenScalars
from .token_step import DecodeKernel, bf16_row8, defer_decay, direct_decay, smem_run, token_offset, token_prepare
from .warp_mma import cp_async_16

WARP = 32
ROWS_PER_WARP = 16
VALUES = 64  # state values per thread
HALF = 16  # lanes per token in the prologue (8 columns each)
MAX_TOKENS = DECODE_MAX_TOKENS


def threads(v_block: int) -> int:
    return WARP * (v_block // ROWS_PER_WARP)


def smem_bytes(v_block: int, items: int, bf16_state: bool) -> int:
    """The built maximum (``specs.decode_smem_bytes`` at ``MAX_TOKENS``)."""
    return decode_smem_bytes(v_block, items, bf16_state)


def _item_stage_bytes(v_block: int, bf16_state: bool) -> int:
    """One staged item: a 16-byte vector per 16 bytes of a thread's 64 values (fp32: 16, bf16: 8),
    vector i of thread tid at (i·threads + tid)·16."""
    return threads(v_block) * (VALUES * (2 if bf16_state else 4) // 16) * 16


def _io_token(tid, chunks: int, n_threads: int, r: int):
    """The token thread ``tid`` moves in v / out staging round ``r`` (8 columns of it per round)."""
    return tid // chunks + r * (n_threads // chunks)


def token_io(tid, v_block: int, items: int) -> tuple:
    """A thread's part of the token I/O (``KdaDecode.kda_decode`` says who moves what): the
    8-column chunks of a CTA's rows, the rounds, this thread's column, and its half-warp lane,
    half-warp and the CTA's half-warp count in the prologue."""
    chunks = items * v_block // 8
    rounds = io_rounds(v_block, items)
    io_col = (tid % chunks) * 8
    return chunks, rounds, io_col, tid % HALF, tid // HALF, threads(v_block) // HALF


def io_rounds(v_block: int, items: int) -> int:
    """Rounds of the v / out staging: a thread moves 8 columns of one token per round."""
    chunks = items * v_block // 8
    return -(-MAX_TOKENS * chunks // threads(v_block))


@functools.lru_cache(maxsize=None)
class Tile:
    """Trace-time description of a thread's 64 state values for one variant."""

    def __init__(self, kv_layout: bool, bf16_state: bool):
        self.dtype = cutlass.BFloat16 if bf16_state else cutlass.Float32
        self.ce = 8 if bf16_state else 4  # elements per 16-byte vector
        self.kv = kv_layout
        if kv_layout:
            self.vt = self.ce
            self.kt = VALUES // self.ce
        else:
            self.vt = 4
            self.kt = VALUES // 4
        self.lanes = D // self.kt  # L: lanes of a group (they share the V rows)
        self.groups = WARP // self.lanes
        assert self.groups * self.vt == ROWS_PER_WARP
        # Lane = j + L·group ("vk") or group + groups·j ("kv"): the reduction partners.
        stride = 1 if not kv_layout else self.groups
        self.xor_offsets = [stride << b for b in range(self.lanes.bit_length() - 1)]

    def lane_parts(self, lane):
        """(group, j) of a lane: which V rows, which keys."""
        if self.kv:
            return lane % self.groups, lane // self.groups
        return lane // self.lanes, lane % self.lanes

    def key(self, j, ki: int):
        """Key of value column ``ki`` for group lane ``j``."""
        if self.kv:
            return j + self.lanes * ki
        return (ki // self.ce) * (self.lanes * self.ce) + j * self.ce + ki % self.ce

    def key_chunks(self):
        """[(first value column ki, 4)]: runs of four value columns whose keys sit at consecutive
        shared-memory positions (``key_pos``): one 16-byte vector read each."""
        return [(ki, 4) for ki in range(0, self.kt, 4)]

    def key_pos(self, j, ki):
        """Shared-memory position (within a token's 128) of the key of value column ``ki`` for
        group lane ``j``: a lane's runs of four columns are 16 contiguous bytes and the lanes of a
        group lie side by side, so a warp's vector read of a run is conflict-free (each 8-lane
        phase reads 128 contiguous bytes; the groups read the same ones)."""
        return (ki // 4) * (4 * self.lanes) + 4 * j + ki % 4

    def pos_of_key(self, key):
        """``key_pos`` of a key (works on trace-time ints and on dynamic Int32)."""
        if self.kv:
            return self.key_pos(key % self.lanes, key // self.lanes)
        span = self.lanes * self.ce
        rem = key % span
        return self.key_pos(rem // self.ce, (key // span) * self.ce + rem % self.ce)

    def row_of(self, j):
        """The row (0 .. VT − 1) whose two dot products lane ``j`` of a group holds after
        ``_reduce_rows``."""
        return kept_start(j, self.vt, len(self.xor_offsets))

    def holder(self, row: int) -> int:
        """A group lane holding ``row`` after ``_reduce_rows`` (the bit-reversal of ``row``)."""
        return next(j for j in range(self.lanes) if self.row_of(j) == row)

    def lane_of(self, group, j):
        """Warp lane of (group, j): the inverse of ``lane_parts``."""
        if self.kv:
            return group + self.groups * j
        return j + self.lanes * group

    def row_offset(self, rows: int) -> int:
        """Element offset of the same thread tile ``rows`` V rows further."""
        return rows if self.kv else rows * D

    def lane_offset(self, row0, j):
        """Element offset (in a head state) of this thread's first vector; ``row0`` = its first V row."""
        if self.kv:
            return j * D + row0
        return row0 * D + j * self.ce

    def vectors(self):
        """[(static element offset from lane_offset, [register index per vector element])]:
        register ``vi·KT + ki`` holds S[row0 + vi, key(j, ki)]."""
        out = []
        if self.kv:
            for ki in range(self.kt):
                out.append((self.lanes * ki * D, [vi * self.kt + ki for vi in range(self.vt)]))
        else:
            for vi in range(self.vt):
                for m in range(self.kt // self.ce):
                    regs = [vi * self.kt + m * self.ce + e for e in range(self.ce)]
                    out.append((vi * D + m * self.lanes * self.ce, regs))
        return out


def _tile(kv_layout: bool, bf16_state: bool) -> Tile:
    return Tile(bool(kv_layout), bool(bf16_state))


class TokenArrays(NamedTuple):
    """A decode CTA's shared memory (``token_arrays``)."""

    stage: cute.Tensor
    kq: cute.Tensor
    b: cute.Tensor
    alpha: cute.Tensor
    khat: cute.Tensor
    qhat: cute.Tensor
    decay: cute.Tensor
    v: cute.Tensor
    o: cute.Tensor


def token_arrays(smem, v_block: int, items: int, bf16_state: bool, num_tokens) -> TokenArrays:
    """A decode CTA's shared arrays from ``smem`` (the token kernel's and the fused layer's): one
    item's stage, refilled with item i + 1 as soon as item i is in registers (a placeholder for
    single items; a bf16 pool stages half the bytes, which lets more CTAs share an SM); k̂·q̂ and
    b per token; then the per-token arrays, packed for this call's T (the launch asks for only
    what T uses: ``specs.decode_smem_bytes``): four fp32 [T, 128] key vectors, then v and o staged
    as bf16 [T, rows] (exact for v; o is rounded once, where it is rounded anyway)."""
    rows = items * v_block
    stage = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(decode_stage_bytes(v_block, items, bf16_state)), 128)
    kq = smem.allocate_tensor(cutlass.Float32, cute.make_layout(MAX_TOKENS), 16)
    b = smem.allocate_tensor(cutlass.Float32, cute.make_layout(MAX_TOKENS), 16)
    per_token_floats = decode_token_bytes(v_block, items) // 4
    region = smem.allocate_tensor(cutlass.Float32, cute.make_layout(MAX_TOKENS * per_token_floats), 128)
    token_layout = cute.make_layout(MAX_TOKENS * D)
    token_floats = num_tokens * D
    alpha = cute.make_tensor(region.iterator, token_layout)
    khat = cute.make_tensor(region.iterator + cute.assume(token_floats, divby=D), token_layout)
    qhat = cute.make_tensor(region.iterator + cute.assume(2 * token_floats, divby=D), token_layout)
    decay = cute.make_tensor(region.iterator + cute.assume(3 * token_floats, divby=D), token_layout)
    staging = cute.recast_ptr(region.iterator + cute.assume(4 * token_floats, divby=D), dtype=cutlass.BFloat16)
    v = cute.make_tensor(staging, cute.make_layout(MAX_TOKENS * rows))
    o = cute.make_tensor(staging + cute.assume(num_tokens * rows, divby=32), cute.make_layout(MAX_TOKENS * rows))
    return TokenArrays(stage, kq, b, alpha, khat, qhat, decay, v, o)


# Plain Python helpers (trace-time loops, no dynamic control flow): they may take the Tile.
def _load_state(state: cute.Tensor, base: cute.Pointer, tile: Tile, lane_off):
    """This thread's 64 values of the head state at ``base`` into ``state`` (fp32)."""
    for static_off, regs in tile.vectors():
        at = cute.assume(lane_off + static_off, divby=tile.ce)  # lane_off: a multiple of CE
        vec = cute.make_tensor(base + at, cute.make_layout(tile.ce)).load().to(cutlass.Float32)
        for e in range(tile.ce):
            state[regs[e]] = vec[e]


def _store_state(state: cute.Tensor, base: cute.Pointer, tile: Tile, lane_off, s_decay, t, j, direct: bool = False):
    """The state ``state``·diag(A_t) (the deferred decay, A_t of token ``t`` from ``s_decay``; the
    state itself when it is decayed ``direct``ly) rounded once to the pool dtype, stored as
    16-byte vectors at ``base``."""
    decay = {}
    if not direct:
        for ki0, count in tile.key_chunks():
            for c, value in enumerate(smem_run(s_decay, t * D + tile.key_pos(j, ki0), count)):
                decay[ki0 + c] = value
    frag = cute.make_rmem_tensor(cute.make_layout(tile.ce), cutlass.Float32)
    for static_off, regs in tile.vectors():
        for e in range(tile.ce):
            frag[e] = state[regs[e]] if direct else state[regs[e]] * decay[regs[e] % tile.kt]
        at = cute.assume(lane_off + static_off, divby=tile.ce)
        cute.make_tensor(base + at, cute.make_layout(tile.ce)).store(frag.load().to(tile.dtype))


def _store8(dst: cute.Tensor, offset, values):
    """Eight values (a TensorSSA of ``dst``'s dtype) into shared memory at ``offset`` (a multiple of 8)."""
    cute.make_tensor(dst.iterator + cute.assume(offset, divby=8), cute.make_layout(8)).store(values)


def _reduce_rows(tile: Tile, dk, dq, j):
    """The group totals (S k, S q) of row ``tile.row_of(j)``: a reduce-scatter of the VT row
    pairs over the L lanes of a group (VT + VT/2 + … shuffle pairs instead of VT·log2 L)."""
    return butterfly_reduce_scatter(list(zip(dk, dq)), j, tile.xor_offsets)[0]


def _token_step(
    tile: Tile,
    state: cute.Tensor,
    s_kinv,
    s_kd,
    s_qd,
    s_kq,
    s_b,
    s_v,
    s_o,
    t,
    group,
    j,
    v_row,
    scale,
    v_stride: int,
    s_decay=None,
    u_record=None,
):
    """One token on this thread's 64 values of the decay-deferred state S' (S_t = S'·diag(A_t),
    see ``defer_decay``): the two row dot products S_t k̂ = S'(A_t⊙k̂) and S_t q̂ = S'(A_t⊙q̂),
    reduce-scattered over the group (``_reduce_rows``), u and o of the lane's row (o staged in
    ``s_o``), u of every row gathered back by shuffles, and the rank-1 update S' += u (k̂/A_t)ᵀ:
    three FMAs per value, no decay multiply.  The key vectors are read from shared memory in runs
    where they are used, so only the state and the dot products stay live.  ``v_row``: this
    thread's first V row within the CTA's staged v / o rows.  With ``s_decay`` (``direct_decay``)
    the state is first decayed by α_t, and the key vectors are k̂, q̂ and k̂ themselves.  With
    ``u_record`` = (pointer, element offset of token 0's u at the CTA's row 0, token stride) the
    lane's u is also stored there (a speculative draft's record; the lanes sharing a row store the
    same value)."""
    if s_decay is not None:
        for ki0, count in tile.key_chunks():
            alphas = smem_run(s_decay, t * D + tile.key_pos(j, ki0), count)
            for c in range(count):
                for vi in range(tile.vt):
                    state[vi * tile.kt + ki0 + c] = state[vi * tile.kt + ki0 + c] * alphas[c]
    dk = [cutlass.Float32(0.0) for _ in range(tile.vt)]
    dq = [cutlass.Float32(0.0) for _ in range(tile.vt)]
    for ki0, count in tile.key_chunks():
        at = t * D + tile.key_pos(j, ki0)
        kds = smem_run(s_kd, at, count)
        qds = smem_run(s_qd, at, count)
        for c in range(count):
            ki = ki0 + c
            for vi in range(tile.vt):
                s = state[vi * tile.kt + ki]
                dk[vi] = dk[vi] + s * kds[c]
                dq[vi] = dq[vi] + s * qds[c]
    dk_row, dq_row = _reduce_rows(tile, dk, dq, j)
    row = v_row + tile.row_of(j)
    u_row = s_b[t] * (s_v[t * v_stride + row].to(cutlass.Float32) - dk_row)
    if u_record is not None:
        records, u_at, token_stride = u_record
        cute.make_tensor(records + (u_at + cutlass.Int64(t) * token_stride + row), cute.make_layout(1))[0] = u_row
    # The lanes sharing a row hold bit-identical values: all of them store the same o.
    s_o[t * v_stride + row] = (scale * (dq_row + u_row * s_kq[t])).to(cutlass.BFloat16)
    u = [cute.arch.shuffle_sync(u_row, offset=tile.lane_of(group, tile.holder(vi))) for vi in range(tile.vt)]
    for ki0, count in tile.key_chunks():
        kinvs = smem_run(s_kinv, t * D + tile.key_pos(j, ki0), count)
        for c in range(count):
            for vi in range(tile.vt):
                state[vi * tile.kt + ki0 + c] = state[vi * tile.kt + ki0 + c] + u[vi] * kinvs[c]


def _step_decay(gate: Gate, s_decay):
    """``_token_step``'s per-token decay array: the unbounded gates decay the state token by
    token (``token_step.direct_decay``), the safe gate defers it (None)."""
    return None if gate.defers_decay else s_decay


def _stage_state(tile: Tile, base: cute.Pointer, lane_off, stage_address, tid, n_threads: int):
    """cp.async this thread's 16 state vectors at ``base`` into shared memory (vector i of
    thread tid at ``stage_address + (i·threads + tid)·16``: a warp's copies are contiguous)."""
    for i, (static_off, _) in enumerate(tile.vectors()):
        src = base + cute.assume(lane_off + static_off, divby=tile.ce)
        cp_async_16(stage_address + (i * n_threads + tid) * 16, src.toint(), 16)


@cute.jit
def zero_outputs(
    out: cute.Pointer, geometry, seq, n64, head, v0, io_col, tid, chunks: int, rounds: int, n_threads: int
):
    """A padding row's outputs: zeros in this thread's 8 columns (``v0 + io_col`` on) of its tokens."""
    for r in cutlass.range_constexpr(rounds):
        io_t = _io_token(tid, chunks, n_threads, r)
        if seq < geometry.num_seqs and io_t < geometry.num_tokens:
            o_at = token_offset(n64, geometry.out_stride_n, geometry.out_stride_t, io_t, head) + v0 + io_col
            frag = cute.make_rmem_tensor(cute.make_layout(8), cutlass.Float32)
            frag.fill(0.0)
            cute.make_tensor(out + cute.assume(o_at, divby=8), cute.make_layout(8)).store(
                frag.load().to(cutlass.BFloat16)
            )


def head_state(tile: Tile, tensors, geometry, slot, head_elems):
    """The head state's address in pool slot ``slot`` (``head_elems`` = head·128·128): the slot
    stride is a multiple of 16 bytes (validated), so every head state is 16-byte aligned."""
    return tensors.step.state_pool + cute.assume(
        cutlass.Int64(slot) * cutlass.Int64(geometry.slot_stride) + head_elems, divby=tile.ce
    )


def first_item(tile: Tile, state, s_stage, pool_head, lane_off, v_block: int, items: int, tid):
    """A CTA's first item: its state loaded into ``state``, and with more items the next one's
    streaming into the stage while the first computes."""
    _load_state(state, pool_head, tile, lane_off)
    if items > 1:
        _stage_state(
            tile, pool_head, lane_off + tile.row_offset(v_block), s_stage.iterator.toint(), tid, threads(v_block)
        )
    cute.arch.cp_async_commit_group()


def next_item(
    tile: Tile, state, s_stage, item_stage: int, pool_head, lane_off, v_block: int, item: int, items: int, tid
):
    """Item ``item`` (> 0) of a CTA walking ``items`` V blocks: its state from the stage into
    ``state`` once this thread's own staged vectors have landed, then the next item's state
    staged (each thread refills only its own vectors: no barrier between unstage and refill)."""
    n_threads = threads(v_block)
    cute.arch.cp_async_wait_group(0)
    _unstage_state(
        tile, state, cute.make_tensor(s_stage.iterator, cute.make_layout(item_stage)), tid, n_threads, tile.dtype
    )
    if item + 1 < items:
        _stage_state(
            tile, pool_head, lane_off + tile.row_offset((item + 1) * v_block), s_stage.iterator.toint(), tid, n_threads
        )
        cute.arch.cp_async_commit_group()


def _unstage_state(tile: Tile, state: cute.Tensor, stage: cute.Tensor, tid, n_threads: int, dtype):
    """This thread's staged vectors (``_stage_state``) from shared memory into ``state`` (fp32)."""
    for i, (_, regs) in enumerate(tile.vectors()):
        at = cute.assume((i * n_threads + tid) * tile.ce, divby=tile.ce)
        vec = (
            cute.make_tensor(cute.recast_ptr(stage.iterator, dtype=dtype) + at, cute.make_layout(tile.ce))
            .load()
            .to(cutlass.Float32)
        )
        for e in range(tile.ce):
            state[regs[e]] = vec[e]


class KdaDecode(DecodeKernel):
    """The token kernel of one variant (``specs.DecodeSpec``): the codegen arguments and what
    follows from them here, the device code in ``kernel`` (``token_step.DecodeKernel``)."""

    def __init__(self, kv_layout: bool, bf16_state: bool, v_block: int, items: int, gate: str):
        self.kv_layout = kv_layout
        self.bf16_state = bf16_state
        self.v_block = v_block
        self.items = items
        self.gate = Gate(gate)  # asked, not compared by name (kernels/gate.py)
        self.tile = _tile(kv_layout, bf16_state)
        self.threads = threads(v_block)
        self.smem_bytes = smem_bytes(v_block, items, bf16_state)
        self.rows = items * v_block  # V rows of a CTA: items blocks of v_block, one after the other

    @cute.jit
    def read_slot(self, tensors: DecodeTensors, geometry: DecodeGeometry, seq, flags, tid):
        """The slot the sequence's state is read from: ``state_indices[n]``, or under
        ``DECODE_FLAG_TOKEN_SLOTS`` column ``num_accepted[n] − 1`` (``DECODE_FLAG_ACCEPTED``;
        clamped to [0, T), a count outside [1, T] reported) or 0 of row n of ``[N, T]`` indices."""
        at = seq
        if (flags & DECODE_FLAG_TOKEN_SLOTS) != 0:
            column = cutlass.Int32(0)
            if (flags & DECODE_FLAG_ACCEPTED) != 0:
                accepted = cute.make_tensor(tensors.num_accepted + seq, cute.make_layout(1))[0]
                # Clamped before the subtraction, which would wrap INT32_MIN to the last column.
                column = cutlass.min(cutlass.max(accepted, 1), geometry.num_tokens) - 1
                if tid == 0:
                    report_status(
                        tensors.status,
                        (flags & DECODE_FLAG_STATUS) != 0,
                        cutlass.select_(column + 1 != accepted, STATUS_DRAFT_OUT_OF_RANGE, 0),
                    )
            at = seq * geometry.num_tokens + column
        return self.slot(tensors, geometry, at)

    @cute.jit
    def store_token_state(
        self,
        state,
        t,
        tensors,
        geometry,
        n64,
        seq,
        head_elems,
        item_off,
        s_decay,
        tid,
        j,
        flags,
        first_item: cutlass.Constexpr[bool],
    ):
        """The state after token ``t``: to slot ``state_indices[n, t]`` under
        ``DECODE_FLAG_TOKEN_SLOTS`` (nothing outside the pool; one other than -1 reported by
        thread 0 on the ``first_item``), else to the intermediate states."""
        direct = not self.gate.defers_decay
        if (flags & DECODE_FLAG_TOKEN_SLOTS) != 0:
            slot = self.slot(tensors, geometry, seq * geometry.num_tokens + t)
            if slot >= 0 and slot < geometry.num_slots:
                pool_head = head_state(self.tile, tensors, geometry, slot, head_elems)
                _store_state(state, pool_head, self.tile, item_off, s_decay, t, j, direct)
            if cutlass.const_expr(first_item):
                if tid == 0:
                    self.report_padding(tensors, flags, slot, geometry.num_slots)
        else:
            inter_at = (n64 * geometry.num_tokens + cutlass.Int64(t)) * grid_heads() * (D * D) + head_elems
            inter_head = tensors.intermediate + cute.assume(inter_at, divby=D * D)
            _store_state(state, inter_head, self.tile, item_off, s_decay, t, j, direct)

    @cute.kernel
    def kda_decode(self, tensors: DecodeTensors, geometry: DecodeGeometry, scalars: TokenScalars):
        tid, warp, lane, vblk, head, seq = self.coordinates()
        v_block, items, gate, rows, n_threads = self.v_block, self.items, self.gate, self.rows, self.threads
        num_tokens, num_slots, flags = geometry.num_tokens, geometry.num_slots, scalars.flags
        v0 = vblk * rows
        n64 = cutlass.Int64(seq)
        head_elems = cutlass.Int64(head) * (D * D)

        smem = cutlass.utils.SmemAllocator()
        s_stage, s_kq, s_b, s_alpha, s_khat, s_qhat, s_decay, s_v, s_o = token_arrays(
            smem, v_block, items, self.bf16_state, num_tokens
        )
        item_stage = _item_stage_bytes(v_block, self.bf16_state)

        slot = self.read_slot(tensors, geometry, seq, flags, tid)
        # v / out staging: in round r thread i moves 8 columns of token i // (rows / 8) + r·(tokens
        # per round) of this CTA's rows (one round up to 64 rows, two for 128); threads past the
        # last token repeat it (identical values: a benign duplicate store).
        chunks, rounds, io_col, hl, half_id, n_half = token_io(tid, v_block, items)

        # ---- issued before the slot is known: the first round of token inputs (token half_id,
        # clamped) and the v rows; the state loads then wait only for the index ----------------
        t0 = cutlass.min(half_id, num_tokens - 1)
        inputs0 = self.token_loads(tensors, geometry, n64, t0, head, hl)
        v_rows = cute.make_rmem_tensor(cute.make_layout(8 * rounds), cutlass.Float32)
        for r in cutlass.range_constexpr(rounds):
            io_tc = cutlass.min(_io_token(tid, chunks, n_threads, r), num_tokens - 1)
            v_at = token_offset(n64, geometry.v_stride_n, geometry.v_stride_t, io_tc, head)
            v_row = bf16_row8(tensors.step.v, v_at + v0 + io_col)
            for e in cutlass.range_constexpr(8):
                v_rows[8 * r + e] = v_row[e]

        group, j = self.tile.lane_parts(lane)
        # First of this thread's VT rows within a v_block item.
        row_local = warp * ROWS_PER_WARP + group * self.tile.vt
        lane_off = self.tile.lane_offset(v0 + row_local, j)
        state = cute.make_rmem_tensor(cute.make_layout(VALUES), cutlass.Float32)
        if seq < geometry.num_seqs and slot >= 0 and slot < num_slots:
            pool_head = head_state(self.tile, tensors, geometry, slot, head_elems)
            first_item(self.tile, state, s_stage, pool_head, lane_off, v_block, items, tid)

        # ---- prologue, overlapping the state loads: q̂, k̂, α, k̂·q̂, b per token into smem -----
        token_prepare(self.tile, inputs0, s_alpha, s_khat, s_qhat, s_kq, s_b, t0, hl, scalars.lower_bound, flags, gate)
        for r in cutlass.range_constexpr(rounds):
            io_tc = cutlass.min(_io_token(tid, chunks, n_threads, r), num_tokens - 1)
            _store8(
                s_v,
                io_tc * rows + io_col,
                cute.make_tensor(v_rows.iterator + 8 * r, cute.make_layout(8)).load().to(cutlass.BFloat16),
            )
        # Tokens past the first round (T > n_half): every lane runs every round (the shuffles need
        # the whole warp), with the token clamped like round 0.
        for base in cutlass.range(n_half, num_tokens, n_half, unroll=1):
            t = cutlass.min(base + half_id, num_tokens - 1)
            inputs = self.token_loads(tensors, geometry, n64, cutlass.Int64(t), head, hl)
            token_prepare(
                self.tile, inputs, s_alpha, s_khat, s_qhat, s_kq, s_b, t, hl, scalars.lower_bound, flags, gate
            )
        cute.arch.sync_threads()
        if cutlass.const_expr(gate.defers_decay):
            defer_decay(s_alpha, s_khat, s_qhat, s_decay, num_tokens, tid, n_threads)
        else:
            direct_decay(s_alpha, s_khat, s_decay, num_tokens, tid, n_threads)
        cute.arch.sync_threads()

        if seq < geometry.num_seqs and slot >= 0 and slot < num_slots:
            pool_head = head_state(self.tile, tensors, geometry, slot, head_elems)
            # Every token's state written (intermediates, or per-token slots), or only the last.
            write_every = (flags & (DECODE_FLAG_INTERMEDIATE | DECODE_FLAG_TOKEN_SLOTS)) != 0
            for item in cutlass.range_constexpr(items):
                item_off = lane_off + self.tile.row_offset(item * v_block)
                if cutlass.const_expr(item > 0):
                    next_item(self.tile, state, s_stage, item_stage, pool_head, lane_off, v_block, item, items, tid)

                # Two loops, not one with the store under `if`: ptxas predicates a store inside the
                # loop, so its ~110 instructions would issue on every token of every call.
                arrays = (s_alpha, s_khat, s_qhat, s_kq, s_b, s_v, s_o)
                decay = _step_decay(gate, s_decay)
                token_store = (tensors, geometry, n64, seq, head_elems, item_off, s_decay, tid, j, flags)
                if write_every:
                    for t in cutlass.range(num_tokens, unroll=1):
                        row = item * v_block + row_local
                        _token_step(self.tile, state, *arrays, t, group, j, row, scalars.scale, rows, decay)
                        self.store_token_state(state, t, *token_store, item == 0)
                else:
                    for t in cutlass.range(num_tokens, unroll=1):
                        row = item * v_block + row_local
                        _token_step(self.tile, state, *arrays, t, group, j, row, scalars.scale, rows, decay)
                if (flags & DECODE_FLAG_TOKEN_SLOTS) == 0:
                    _store_state(
                        state, pool_head, self.tile, item_off, s_decay, num_tokens - 1, j, not gate.defers_decay
                    )
            cute.arch.sync_threads()
            for r in cutlass.range_constexpr(rounds):
                io_t = _io_token(tid, chunks, n_threads, r)
                if io_t < num_tokens:
                    o_at = token_offset(n64, geometry.out_stride_n, geometry.out_stride_t, io_t, head) + v0 + io_col
                    staged = cute.make_tensor(
                        s_o.iterator + cute.assume(io_t * rows + io_col, divby=8), cute.make_layout(8)
                    )
                    cute.make_tensor(tensors.out + cute.assume(o_at, divby=8), cute.make_layout(8)).store(staged.load())
        else:
            # Padding row: zeros out, nothing else; a slot other than -1 is reported.
            if tid == 0:
                self.report_padding(tensors, flags, slot, num_slots)
            zero_outputs(tensors.out, geometry, seq, n64, head, v0, io_col, tid, chunks, rounds, n_threads)

    kernel = kda_decode
