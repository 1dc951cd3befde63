"""KDA decode for bf16 "vk" pools and T ≥ 2 tokens: dot products on tensor cores, the update on CUDA cores.

What it computes: exactly what ``kernels/decode.py`` computes (SPEC §10: T = ``num_tokens`` ≤ 8
tokens per sequence from the pool slot ``state_indices[n]``, the state updated in place, the state
after every token optionally written to ``intermediate``), in the chunked form of its
deferred-decay recurrence.  With A_t = α_0⋯α_t per key, Kd_t = A_t⊙k̂_t, Qd_t = A_t⊙q̂_t and
Kinv_t = k̂_t / A_t (per CTA, in shared memory) and S' = S_0 + Σ_s u_s Kinv_sᵀ (S_t = S'_t·diag(A_t)):

    P = S_0·[Kd_0 … Kd_7 | Qd_0 … Qd_7]                      (V × 16: mma.m16n8k16, bf16)
    u_t = b_t·(v_t − P[Kd_t] − Σ_{s<t} (Kinv_s·Kd_t)·u_s)     (forward substitution per row)
    o_t = scale·(P[Qd_t] + Σ_{s<t} (Kinv_s·Qd_t)·u_s + (k̂_t·q̂_t)·u_t)
    S'  += u_t Kinv_tᵀ for t = 0 .. T−1; stored S'·diag(A_t)   (one FMA per value and token)

so the two dot products of every value and token (two thirds of the per-token kernel's FMAs)
become two tensor-core products per 16 × 16 block, and the CUDA cores keep one FMA per value
and token.  The T×T matrices Kinv_s·Kd_t and Kinv_s·Qd_t are per head: each CTA computes them
once (fp32, a half-warp per entry).

Precision: S_0 is exact as a bf16 MMA operand (the pool is bf16); Kd and Qd enter as bf16
hi + lo pairs (two MMAs, ~2^-16 relative), so the products are fp32-level; the state
accumulates in fp32 from the exact S_0 and is rounded once per store, like the per-token kernel.

Fragments: a warp owns 16-row tiles of V.  Lane (g, c) = (lane // 4, lane % 4) holds rows g and
g + 8 of a tile at keys 32i + 8c .. 32i + 8c + 7 (i = 0 .. 3): eight 16-byte vectors, loaded
and stored directly (a row's 256 bytes by four lanes).  The MMA's k index is a permutation of the
keys, the same for A (the state) and B (Kd, Qd): vector i of a lane gives the A registers of
k-steps 2i and 2i + 1 as they are (words 0, 1 and 2, 3), and the B registers come from the same
keys of vector g of the operand arrays, so neither operand is shuffled.

Tiles: with ``tiles`` > 1 a warp walks several tiles of the head, the next tile's state
streaming into its shared-memory stage (cp.async) while the current one computes; each lane
refills its own part of the stage as soon as it has the tile in registers (no barrier).

Launch: grid (128 / (16·warps·tiles), H, N), block (32·warps, 1, 1), ``smem_bytes(warps, tiles)``
dynamic smem.  Compile-time: H, warps, tiles.  Runtime: the parameters of ``kda_decode``
(``specs.DECODE_PARAMS`` with a bf16 pool; "vk" layout only).
"""

import cutlass
import cutlass.cute as cute

from ..layout import D
from ..specs import DECODE_FLAG_INTERMEDIATE, DECODE_MAX_TOKENS
from .decode import (HALF, WARP, _bf16_row8, _defer_decay, _io_token, _store8, _token_loads, _token_prepare,
                     io_rounds)
from .warp_mma import bf16_as_f32, cp_async_16, mma_bf16_m16n8k16, pack_bf16x2

TOKENS = DECODE_MAX_TOKENS  # B columns per product (tokens past T are never read back)
TILE_ROWS = 16
VECTORS = 8  # 16-byte state vectors per lane and tile: 2 rows × 4 key runs
OPERAND_PITCH = D + 32  # bf16 per token row of the B arrays: a phase's 16-byte reads are conflict-free
P_PITCH = 2 * TOKENS + 1  # fp32 per row of a warp's product stage: the solve's column reads are conflict-free


def cta_threads(warps: int) -> int:
    return WARP * warps


def cta_rows(warps: int, tiles: int) -> int:
    return TILE_ROWS * warps * tiles


def _stage_bytes(warps: int, tiles: int) -> int:
    """One staged tile per warp (tiles > 1; a placeholder otherwise)."""
    return warps * VECTORS * WARP * 16 if tiles > 1 else 128


def smem_bytes(warps: int, tiles: int) -> int:
    """fp32 [TOKENS, 128] α/Kinv, k̂/Kd, q̂/Qd and A; bf16 hi/lo of Kd and Qd ([TOKENS, OPERAND_PITCH]
    each); the two T×T matrices; k̂·q̂ and b; v and o staging (bf16 [TOKENS, rows] each); per warp
    the products of a tile ([16, P_PITCH] fp32) and its u ([TOKENS, 16] fp32); the state stage;
    alignment slack."""
    rows = cta_rows(warps, tiles)
    return (4 * TOKENS * D * 4 + 4 * TOKENS * OPERAND_PITCH * 2 + 2 * TOKENS * TOKENS * 4 + 2 * TOKENS * 4
            + 2 * TOKENS * rows * 2 + warps * (TILE_ROWS * P_PITCH + TOKENS * TILE_ROWS) * 4
            + _stage_bytes(warps, tiles) + 512)


class _NaturalKeys:
    """Key placement for ``decode._token_prepare``: key k at position k."""

    kv = False

    @staticmethod
    def pos_of_key(key):
        return key


@cute.jit
def _split_operands(s_kd: cute.Tensor, s_qd: cute.Tensor, s_kd_hi: cute.Tensor, s_kd_lo: cute.Tensor,
                    s_qd_hi: cute.Tensor, s_qd_lo: cute.Tensor, num_tokens, tid, n_threads: cutlass.Constexpr[int]):
    """Kd and Qd (fp32, after ``_defer_decay``) as bf16 hi + lo pairs in the MMA operand arrays."""
    for i in cutlass.range_constexpr(D // n_threads):
        key = tid + i * n_threads
        for t in cutlass.range(num_tokens, unroll=1):
            kd = s_kd[t * D + key]
            kd_hi = kd.to(cutlass.BFloat16)
            s_kd_hi[t * OPERAND_PITCH + key] = kd_hi
            s_kd_lo[t * OPERAND_PITCH + key] = (kd - kd_hi.to(cutlass.Float32)).to(cutlass.BFloat16)
            qd = s_qd[t * D + key]
            qd_hi = qd.to(cutlass.BFloat16)
            s_qd_hi[t * OPERAND_PITCH + key] = qd_hi
            s_qd_lo[t * OPERAND_PITCH + key] = (qd - qd_hi.to(cutlass.Float32)).to(cutlass.BFloat16)


def _f32x4(array: cute.Tensor, at):
    return cute.make_tensor(array.iterator + cute.assume(at, divby=4), cute.make_layout(4)).load()


@cute.jit
def _token_matrices(s_kinv: cute.Tensor, s_kd: cute.Tensor, s_qd: cute.Tensor, s_kq: cute.Tensor,
                    s_mk: cute.Tensor, s_mq: cute.Tensor, num_tokens, tid, n_threads: cutlass.Constexpr[int]):
    """Mk[t, s] = Kinv_s·Kd_t (s < t) and Mq[t, s] = Kinv_s·Qd_t (s < t; Mq[t, t] = k̂_t·q̂_t) into
    ``s_mk`` / ``s_mq`` ([TOKENS, TOKENS]; entries past the triangle unused).  Half-warp h takes the
    pairs h, h + n_half, … of the T×T square, 8 keys a lane, summed by butterflies."""
    hl = tid % HALF
    n_half = n_threads // HALF
    for base in cutlass.range(0, num_tokens * num_tokens, n_half, unroll=1):
        pair = cutlass.min(base + tid // HALF, num_tokens * num_tokens - 1)  # clamped: a duplicate store
        t = pair // num_tokens
        s = pair - t * num_tokens
        mk = cutlass.Float32(0.0)
        mq = cutlass.Float32(0.0)
        for half in cutlass.range_constexpr(2):
            at = 8 * hl + 4 * half
            kinv = _f32x4(s_kinv, s * D + at)
            kd = _f32x4(s_kd, t * D + at)
            qd = _f32x4(s_qd, t * D + at)
            for e in cutlass.range_constexpr(4):
                mk = mk + kinv[e] * kd[e]
                mq = mq + kinv[e] * qd[e]
        for b in cutlass.range_constexpr(4):
            mk = mk + cute.arch.shuffle_sync_bfly(mk, offset=1 << b)
            mq = mq + cute.arch.shuffle_sync_bfly(mq, offset=1 << b)
        s_mk[t * TOKENS + s] = mk
        s_mq[t * TOKENS + s] = cutlass.Float32(cutlass.select_(s == t, s_kq[t], mq))


def _vector_offset(r: int, i: int, g, c):
    """Element offset within a tile (rows × 128) of vector (row half r, key run i) of lane (g, c)."""
    return (g + 8 * r) * D + 32 * i + 8 * c


def _load_tile(raw: cute.Tensor, tile_base: cute.Pointer, g, c):
    """This lane's eight state vectors of the tile at ``tile_base`` as b32 words (bf16 pairs):
    word w of vector (r, i) at ``raw[(4r + i)·4 + w]``."""
    words = cute.recast_ptr(tile_base, dtype=cutlass.Int32)
    for r in range(2):
        for i in range(4):
            at = cute.assume(_vector_offset(r, i, g, c) // 2, divby=4)
            vec = cute.make_tensor(words + at, cute.make_layout(4)).load()
            for w in range(4):
                raw[(4 * r + i) * 4 + w] = vec[w]


def _stage_tile(tile_base: cute.Pointer, stage_address, lane, g, c):
    """cp.async this lane's eight vectors of the tile at ``tile_base`` into its warp's stage
    (vector v of lane l at ``stage_address + (v·32 + l)·16``: a warp's copies are contiguous)."""
    for r in range(2):
        for i in range(4):
            src = tile_base + cute.assume(_vector_offset(r, i, g, c), divby=8)
            cp_async_16(stage_address + ((4 * r + i) * WARP + lane) * 16, src.toint(), 16)


def _unstage_tile(raw: cute.Tensor, stage: cute.Tensor, lane):
    """This lane's staged vectors (``_stage_tile``) into ``raw``."""
    for v in range(VECTORS):
        vec = cute.make_tensor(stage.iterator + cute.assume((v * WARP + lane) * 4, divby=4), cute.make_layout(4)).load()
        for w in range(4):
            raw[v * 4 + w] = vec[w]


def _products(raw: cute.Tensor, s_kd_hi, s_kd_lo, s_qd_hi, s_qd_lo, s_p: cute.Tensor, g, c):
    """P = S_0·[Kd | Qd] of this warp's tile (S_0 from ``raw``), hi and lo products in separate
    accumulators (shorter chains), into the warp's product stage: P[row, t] and P[row, 8 + t]."""
    zero = cutlass.Float32(0.0)
    acc = [[zero] * 4 for _ in range(4)]  # Kd hi, Kd lo, Qd hi, Qd lo
    arrays = (s_kd_hi, s_kd_lo, s_qd_hi, s_qd_lo)
    for i in range(4):
        b_words = []
        for array in arrays:
            words = cute.recast_ptr(array.iterator, dtype=cutlass.Int32)
            at = cute.assume((g * OPERAND_PITCH + 32 * i + 8 * c) // 2, divby=4)
            b_words.append(cute.make_tensor(words + at, cute.make_layout(4)).load())
        for h in range(2):  # k-steps 2i and 2i + 1: words 2h, 2h + 1 of vector i
            a = [raw[(4 * 0 + i) * 4 + 2 * h], raw[(4 * 1 + i) * 4 + 2 * h],
                 raw[(4 * 0 + i) * 4 + 2 * h + 1], raw[(4 * 1 + i) * 4 + 2 * h + 1]]
            for n in range(4):
                acc[n] = mma_bf16_m16n8k16(a, [b_words[n][2 * h], b_words[n][2 * h + 1]], acc[n])
    for part in range(2):  # Kd columns 0 .. 7, Qd columns 8 .. 15
        for e in range(4):
            row = g + 8 * (e // 2)
            col = part * TOKENS + 2 * c + e % 2
            s_p[row * P_PITCH + col] = acc[2 * part][e] + acc[2 * part + 1][e]


@cute.jit
def _solve(s_p: cute.Tensor, s_u: cute.Tensor, s_mk: cute.Tensor, s_mq: cute.Tensor, s_b: cute.Tensor,
           s_v: cute.Tensor, s_o: cute.Tensor, row_in_cta, r, num_tokens, scale, rows: cutlass.Constexpr[int]):
    """Forward substitution of tile row ``r`` (u into ``s_u``, o staged in ``s_o``).  Lanes r and
    r + 16 compute bit-identical values and both store them."""
    for t in cutlass.range(num_tokens, unroll=1):
        acc = s_v[t * rows + row_in_cta].to(cutlass.Float32) - s_p[r * P_PITCH + t]
        o = s_p[r * P_PITCH + TOKENS + t]
        for s in cutlass.range(t, unroll=1):
            u_s = s_u[s * TILE_ROWS + r]
            acc = acc - s_mk[t * TOKENS + s] * u_s
            o = o + s_mq[t * TOKENS + s] * u_s
        u_t = s_b[t] * acc
        s_u[t * TILE_ROWS + r] = u_t
        s_o[t * rows + row_in_cta] = (scale * (o + s_mq[t * TOKENS + t] * u_t)).to(cutlass.BFloat16)


def _widen(raw: cute.Tensor, state: cute.Tensor):
    """The b32 bf16 pairs of ``raw`` as fp32 state values: value (r, i, e) at ``state[32r + 8i + e]``."""
    for v in range(VECTORS):
        for w in range(4):
            state[8 * v + 2 * w] = bf16_as_f32(raw[4 * v + w], False)
            state[8 * v + 2 * w + 1] = bf16_as_f32(raw[4 * v + w], True)


def _update(state: cute.Tensor, s_u: cute.Tensor, s_kinv: cute.Tensor, t, g, c):
    """S' += u_t Kinv_tᵀ on this lane's 64 values."""
    u = [s_u[t * TILE_ROWS + g], s_u[t * TILE_ROWS + g + 8]]
    for i in range(4):
        for half in range(2):
            kinv = _f32x4(s_kinv, t * D + 32 * i + 8 * c + 4 * half)
            for e in range(4):
                for r in range(2):
                    at = 32 * r + 8 * i + 4 * half + e
                    state[at] = state[at] + u[r] * kinv[e]


def _store_tile(state: cute.Tensor, tile_base: cute.Pointer, s_decay: cute.Tensor, t, g, c):
    """The tile's state S'·diag(A_t) rounded to bf16, stored as this lane's eight 16-byte vectors."""
    words = cute.recast_ptr(tile_base, dtype=cutlass.Int32)
    frag = cute.make_rmem_tensor(cute.make_layout(4), cutlass.Int32)
    for i in range(4):
        decay = [_f32x4(s_decay, t * D + 32 * i + 8 * c + 4 * half) for half in range(2)]
        for r in range(2):
            for w in range(4):
                at = 32 * r + 8 * i + 2 * w
                frag[w] = pack_bf16x2(state[at] * decay[w // 2][2 * (w % 2)],
                                      state[at + 1] * decay[w // 2][2 * (w % 2) + 1])
            dst = words + cute.assume(_vector_offset(r, i, g, c) // 2, divby=4)
            cute.make_tensor(dst, cute.make_layout(4)).store(frag.load())


@cute.kernel
def kda_decode_chunk_kernel(
    q: cute.Pointer,
    k: cute.Pointer,
    v: cute.Pointer,
    g: cute.Pointer,
    beta: cute.Pointer,
    a_log: cute.Pointer,
    dt_bias: cute.Pointer,
    state_indices: cute.Pointer,
    state_pool: cute.Pointer,
    intermediate: cute.Pointer,
    out: cute.Pointer,
    num_seqs: cutlass.Int32,
    num_tokens: cutlass.Int32,
    num_slots: cutlass.Int32,
    slot_stride: cutlass.Int32,
    q_stride_n: cutlass.Int32,
    q_stride_t: cutlass.Int32,
    k_stride_n: cutlass.Int32,
    k_stride_t: cutlass.Int32,
    v_stride_n: cutlass.Int32,
    v_stride_t: cutlass.Int32,
    g_stride_n: cutlass.Int32,
    g_stride_t: cutlass.Int32,
    beta_stride_n: cutlass.Int32,
    beta_stride_t: cutlass.Int32,
    beta_offset: cutlass.Int32,
    index_offset: cutlass.Int32,
    out_stride_n: cutlass.Int32,
    out_stride_t: cutlass.Int32,
    scale: cutlass.Float32,
    lower_bound: cutlass.Float32,
    flags: cutlass.Int32,
    heads: cutlass.Constexpr[int],
    warps: cutlass.Constexpr[int],
    tiles: cutlass.Constexpr[int],
):
    tid, _, _ = cute.arch.thread_idx()
    vblk, head, seq = cute.arch.block_idx()
    warp = tid // WARP
    lane = tid % WARP
    lg = lane // 4
    lc = lane % 4
    rows = cta_rows(warps, tiles)
    n_threads = cta_threads(warps)
    v0 = vblk * rows
    n64 = cutlass.Int64(seq)
    head_elems = cutlass.Int64(head) * (D * D)

    smem = cutlass.utils.SmemAllocator()
    token_layout = cute.make_layout(TOKENS * D)
    operand_layout = cute.make_layout(TOKENS * OPERAND_PITCH)
    s_alpha = smem.allocate_tensor(cutlass.Float32, token_layout, 32)  # α, then Kinv
    s_khat = smem.allocate_tensor(cutlass.Float32, token_layout, 32)  # k̂, then Kd
    s_qhat = smem.allocate_tensor(cutlass.Float32, token_layout, 32)  # q̂, then Qd
    s_decay = smem.allocate_tensor(cutlass.Float32, token_layout, 32)  # A
    s_kd_hi = smem.allocate_tensor(cutlass.BFloat16, operand_layout, 16)
    s_kd_lo = smem.allocate_tensor(cutlass.BFloat16, operand_layout, 16)
    s_qd_hi = smem.allocate_tensor(cutlass.BFloat16, operand_layout, 16)
    s_qd_lo = smem.allocate_tensor(cutlass.BFloat16, operand_layout, 16)
    s_mk = smem.allocate_tensor(cutlass.Float32, cute.make_layout(TOKENS * TOKENS), 16)
    s_mq = smem.allocate_tensor(cutlass.Float32, cute.make_layout(TOKENS * TOKENS), 16)
    s_kq = smem.allocate_tensor(cutlass.Float32, cute.make_layout(TOKENS), 16)
    s_b = smem.allocate_tensor(cutlass.Float32, cute.make_layout(TOKENS), 16)
    s_v = smem.allocate_tensor(cutlass.BFloat16, cute.make_layout(TOKENS * rows), 16)
    s_o = smem.allocate_tensor(cutlass.BFloat16, cute.make_layout(TOKENS * rows), 16)
    s_p_all = smem.allocate_tensor(cutlass.Float32, cute.make_layout(warps * TILE_ROWS * P_PITCH), 16)
    s_u_all = smem.allocate_tensor(cutlass.Float32, cute.make_layout(warps * TOKENS * TILE_ROWS), 16)
    s_stage = smem.allocate_tensor(cutlass.Int32, cute.make_layout(_stage_bytes(warps, tiles) // 4), 128)
    s_p = cute.make_tensor(s_p_all.iterator + warp * (TILE_ROWS * P_PITCH), cute.make_layout(TILE_ROWS * P_PITCH))
    s_u = cute.make_tensor(s_u_all.iterator + warp * (TOKENS * TILE_ROWS), cute.make_layout(TOKENS * TILE_ROWS))
    warp_stage = cute.make_tensor(s_stage.iterator + warp * (VECTORS * WARP * 4), cute.make_layout(VECTORS * WARP * 4))
    stage_address = warp_stage.iterator.toint()

    slot = cute.make_tensor(state_indices + index_offset + seq, cute.make_layout(1))[0]
    # v / out staging as in kernels/decode.py (rounds of 8 columns of one token per thread).
    chunks = rows // 8
    rounds = io_rounds(TILE_ROWS * warps, tiles)
    io_col = (tid % chunks) * 8
    hl = tid % HALF
    half_id = tid // HALF
    n_half = n_threads // HALF

    # ---- issued before the slot is known: the first round of token inputs and the v rows ----
    t0 = cutlass.min(half_id, num_tokens - 1)
    inputs0 = _token_loads(q, k, g, beta, a_log, dt_bias, hl,
                           n64 * q_stride_n + cutlass.Int64(t0) * q_stride_t + head * D,
                           n64 * k_stride_n + cutlass.Int64(t0) * k_stride_t + head * D,
                           n64 * g_stride_n + cutlass.Int64(t0) * g_stride_t + head * D,
                           cutlass.Int64(beta_offset) + n64 * beta_stride_n + cutlass.Int64(t0) * beta_stride_t
                           + head, head)
    v_rows = cute.make_rmem_tensor(cute.make_layout(8 * rounds), cutlass.Float32)
    for r in cutlass.range_constexpr(rounds):
        io_tc = cutlass.min(_io_token(tid, chunks, n_threads, r), num_tokens - 1)
        v_row = _bf16_row8(v, n64 * v_stride_n + cutlass.Int64(io_tc) * v_stride_t + head * D + v0 + io_col)
        for e in cutlass.range_constexpr(8):
            v_rows[8 * r + e] = v_row[e]

    # Rows of warp w's tile τ within the CTA: (w·tiles + τ)·16 ..
    warp_row0 = warp * (tiles * TILE_ROWS)
    raw = cute.make_rmem_tensor(cute.make_layout(4 * VECTORS), cutlass.Int32)
    if seq < num_seqs and slot >= 0 and slot < num_slots:
        # slot_stride is a multiple of 16 bytes (validated): every head state is 16-byte aligned.
        pool_head = state_pool + cute.assume(cutlass.Int64(slot) * cutlass.Int64(slot_stride) + head_elems, divby=8)
        _load_tile(raw, pool_head + cute.assume((v0 + warp_row0) * D, divby=8), lg, lc)
        if cutlass.const_expr(tiles > 1):
            _stage_tile(pool_head + cute.assume((v0 + warp_row0 + TILE_ROWS) * D, divby=8), stage_address, lane,
                        lg, lc)
        cute.arch.cp_async_commit_group()

    # ---- prologue, overlapping the state loads ---------------------------------------------
    _token_prepare(_NaturalKeys, inputs0, s_alpha, s_khat, s_qhat, s_kq, s_b, t0, hl, lower_bound)
    for r in cutlass.range_constexpr(rounds):
        io_tc = cutlass.min(_io_token(tid, chunks, n_threads, r), num_tokens - 1)
        _store8(s_v, io_tc * rows + io_col,
                cute.make_tensor(v_rows.iterator + 8 * r, cute.make_layout(8)).load().to(cutlass.BFloat16))
    for base in cutlass.range(n_half, num_tokens, n_half, unroll=1):
        t = cutlass.min(base + half_id, num_tokens - 1)
        t64 = cutlass.Int64(t)
        inputs = _token_loads(q, k, g, beta, a_log, dt_bias, hl,
                              n64 * q_stride_n + t64 * q_stride_t + head * D,
                              n64 * k_stride_n + t64 * k_stride_t + head * D,
                              n64 * g_stride_n + t64 * g_stride_t + head * D,
                              cutlass.Int64(beta_offset) + n64 * beta_stride_n + t64 * beta_stride_t + head, head)
        _token_prepare(_NaturalKeys, inputs, s_alpha, s_khat, s_qhat, s_kq, s_b, t, hl, lower_bound)
    cute.arch.sync_threads()
    _defer_decay(s_alpha, s_khat, s_qhat, s_decay, num_tokens, tid, n_threads)
    cute.arch.sync_threads()
    _split_operands(s_khat, s_qhat, s_kd_hi, s_kd_lo, s_qd_hi, s_qd_lo, num_tokens, tid, n_threads)
    _token_matrices(s_alpha, s_khat, s_qhat, s_kq, s_mk, s_mq, num_tokens, tid, n_threads)
    cute.arch.sync_threads()

    if seq < num_seqs and slot >= 0 and slot < num_slots:
        pool_head = state_pool + cute.assume(cutlass.Int64(slot) * cutlass.Int64(slot_stride) + head_elems, divby=8)
        write_inter = (flags & DECODE_FLAG_INTERMEDIATE) != 0
        state = cute.make_rmem_tensor(cute.make_layout(4 * 2 * VECTORS), cutlass.Float32)
        for tile in cutlass.range_constexpr(tiles):
            tile_row = warp_row0 + tile * TILE_ROWS  # within the CTA
            if cutlass.const_expr(tile > 0):
                cute.arch.cp_async_wait_group(0)  # this lane's own staged vectors have landed
                _unstage_tile(raw, warp_stage, lane)
                if cutlass.const_expr(tile + 1 < tiles):
                    _stage_tile(pool_head + cute.assume((v0 + tile_row + TILE_ROWS) * D, divby=8), stage_address,
                                lane, lg, lc)
                    cute.arch.cp_async_commit_group()
            _products(raw, s_kd_hi, s_kd_lo, s_qd_hi, s_qd_lo, s_p, lg, lc)
            cute.arch.sync_warp()
            _solve(s_p, s_u, s_mk, s_mq, s_b, s_v, s_o, tile_row + lane % TILE_ROWS, lane % TILE_ROWS,
                   num_tokens, scale, rows)
            _widen(raw, state)
            cute.arch.sync_warp()
            tile_base = pool_head + cute.assume((v0 + tile_row) * D, divby=8)
            # Two loops (see kernels/decode.py): a store under `if` in the loop is predicated.
            if write_inter:
                for t in cutlass.range(num_tokens, unroll=1):
                    _update(state, s_u, s_alpha, t, lg, lc)
                    inter_at = ((n64 * num_tokens + cutlass.Int64(t)) * heads * (D * D) + head_elems
                                + (v0 + tile_row) * D)
                    _store_tile(state, intermediate + cute.assume(inter_at, divby=8), s_decay, t, lg, lc)
            else:
                for t in cutlass.range(num_tokens, unroll=1):
                    _update(state, s_u, s_alpha, t, lg, lc)
            _store_tile(state, tile_base, s_decay, num_tokens - 1, lg, lc)
        cute.arch.sync_threads()
        for r in cutlass.range_constexpr(rounds):
            io_t = _io_token(tid, chunks, n_threads, r)
            if io_t < num_tokens:
                o_at = n64 * out_stride_n + cutlass.Int64(io_t) * out_stride_t + head * D + v0 + io_col
                staged = cute.make_tensor(s_o.iterator + cute.assume(io_t * rows + io_col, divby=8),
                                          cute.make_layout(8))
                cute.make_tensor(out + cute.assume(o_at, divby=8), cute.make_layout(8)).store(staged.load())
    else:
        # Padding row: zeros out, nothing else.
        for r in cutlass.range_constexpr(rounds):
            io_t = _io_token(tid, chunks, n_threads, r)
            if seq < num_seqs and io_t < num_tokens:
                o_at = n64 * out_stride_n + cutlass.Int64(io_t) * out_stride_t + head * D + v0 + io_col
                frag = cute.make_rmem_tensor(cute.make_layout(8), cutlass.Float32)
                frag.fill(0.0)
                cute.make_tensor(out + cute.assume(o_at, divby=8), cute.make_layout(8)).store(
                    frag.load().to(cutlass.BFloat16))


@cute.jit
def kda_decode_chunk_launch(
    q: cute.Pointer,
    k: cute.Pointer,
    v: cute.Pointer,
    g: cute.Pointer,
    beta: cute.Pointer,
    a_log: cute.Pointer,
    dt_bias: cute.Pointer,
    state_indices: cute.Pointer,
    state_pool: cute.Pointer,
    intermediate: cute.Pointer,
    out: cute.Pointer,
    num_seqs: cutlass.Int32,
    num_tokens: cutlass.Int32,
    num_slots: cutlass.Int32,
    slot_stride: cutlass.Int32,
    q_stride_n: cutlass.Int32,
    q_stride_t: cutlass.Int32,
    k_stride_n: cutlass.Int32,
    k_stride_t: cutlass.Int32,
    v_stride_n: cutlass.Int32,
    v_stride_t: cutlass.Int32,
    g_stride_n: cutlass.Int32,
    g_stride_t: cutlass.Int32,
    beta_stride_n: cutlass.Int32,
    beta_stride_t: cutlass.Int32,
    beta_offset: cutlass.Int32,
    index_offset: cutlass.Int32,
    out_stride_n: cutlass.Int32,
    out_stride_t: cutlass.Int32,
    scale: cutlass.Float32,
    lower_bound: cutlass.Float32,
    flags: cutlass.Int32,
    stream,
    heads: cutlass.Constexpr[int],
    warps: cutlass.Constexpr[int],
    tiles: cutlass.Constexpr[int],
):
    kda_decode_chunk_kernel(
        q, k, v, g, beta, a_log, dt_bias, state_indices, state_pool, intermediate, out,
        num_seqs, num_tokens, num_slots, slot_stride, q_stride_n, q_stride_t, k_stride_n, k_stride_t,
        v_stride_n, v_stride_t, g_stride_n, g_stride_t, beta_stride_n, beta_stride_t, beta_offset,
        index_offset, out_stride_n, out_stride_t, scale, lower_bound, flags,
        heads, warps, tiles,
    ).launch(grid=[D // cta_rows(warps, tiles), heads, num_seqs], block=[cta_threads(warps), 1, 1],
             smem=smem_bytes(warps, tiles), stream=stream)
