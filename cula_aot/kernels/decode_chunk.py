"""KDA decode of 2–4 tokens on a bf16 "vk" state pool, on tensor cores (the chunk form).

What it computes: what ``decode.py`` computes (docs/CONTRACT.md §10) for T = ``num_tokens`` ∈ {2, 3, 4}
tokens of one sequence and head, the state S ``[V, K]`` (keys contiguous) in a bf16 pool,
updated in place; no intermediate states (calls that ask for them run ``decode.py``).  With
the decay deferred as there (A_t = α_0⋯α_t, kd_t = A_t⊙k̂_t, qd_t = A_t⊙q̂_t, ki_t = k̂_t/A_t),
every dot product of every token is one of the *initial* state S_0 plus a T×T triangle:

    P = S_0·[kd_0 qd_0 kd_1 qd_1 …]                                  (rows × 2T, tensor cores)
    u_t = b_t·(v_t − P_kd,t − Σ_{s<t} (ki_s·kd_t)·u_s)          so   u = (v − P_kd)·W
    o_t = scale·(P_qd,t + Σ_{s<t} (ki_s·qd_t)·u_s + (k̂_t·q̂_t)·u_t)  so   o = scale·(P_qd + (v − P_kd)·Z)
    S_T = S_0·diag(A_{T−1}) + Σ_t u_t·(ki_t⊙A_{T−1})ᵀ                (a rank-T update, tensor cores)

Under an unbounded gate ("softplus", "precomputed": the ``gate`` codegen argument) A_t may reach
2^-112 over 8 tokens at the gate's floor, where ki_t = k̂_t/A_t would sit within 2^14 of fp32's
largest value, so nothing is deferred: the same products are
formed from their factors, each a decay over a range of tokens (≤ 1): kd_t = k̂_t⊙A_t,
ki_s·kd_t = Σ k̂_s⊙k̂_t⊙Π_{s<r≤t} α_r, ki_t⊙A_{T−1} = k̂_t⊙Π_{t<r<T} α_r.

W and Z are per-head T×T matrices (forward substitution, once per CTA), so [u | o] of a row is
one product [P_kd | P_qd | v]·G with a per-head G.  Per warp of 16 V rows that is 16 bf16 MMAs
for P (the fp32 key vectors as bf16 hi + lo halves: S_0 is exact in bf16, so P is good to
~2^-17), 5 tf32 MMAs for [u | o] (3xTF32 for P, v exact), 16 tf32 MMAs for the update (u as
tf32 hi + lo, K̃ = ki⊙A_{T−1} rounded to tf32), one multiply per value for the decay: against
three FMAs per state value and token in the token recurrence (``decode.py``).

Fragments (``mma.sync``, ``warp_mma``).  Lane l = 4g + c of a warp holds V rows g and g + 8 of
the warp's 16 and the physical keys ``key_of(c, p, e) = 32·(p // 4) + 8c + 2·(p % 4) + e`` (b32
pairs p = 0..15, e = low / high half): four 16-byte vectors per row (the four lanes c of a row
read 64 contiguous bytes per vector).  These registers are at once P's A fragments (k-step b:
pairs 2b, 2b + 1; a dot product does not care how keys are ordered, so P's B operands follow
the same map) and the update's C fragments (n-tile j: pair j).  Every map is a function here,
checked on the CPU against the PTX fragment definitions (``tests/kernels/test_decode_chunk.py``).

Per CTA: the slot index, the first item's state vectors and every item's v are issued first
(the second item's state streams into a shared-memory stage with ``cp.async``); the prologue
(``decode.py``'s token preparation and deferred decay, in natural key order, on the warps T
needs) runs while the state arrives; then the per-head operands: P's B fragments as bf16 hi /
lo, K̃ in the update's B order, and G (warp 0: the 2·T(T−1)/2 dot products and the solve).  The
CTA then walks its ``items`` blocks of 16·warps rows, item i + 1's state landing in the stage
while item i computes, each thread refilling only its own stage slots.  A padding row (slot < 0
or ≥ the pool) writes zeros to ``out`` and nothing else.

Launch: grid (128 / (16·warps·items), H, N), block (32·warps, 1, 1), ``smem_bytes(warps, items)``
dynamic shared memory.  Compile-time: H, warps, items.  Runtime: ``decode.py``'s parameter list
(``intermediate`` is not read, of ``flags`` the status bit and the input conventions;
``num_tokens`` must be 2..4: the host dispatches only those).
"""

import cutlass
import cutlass.cute as cute

from ..layout import D
from ..specs import DECODE_CHUNK_MAX_TOKENS, decode_chunk_smem_bytes, decode_chunk_stage_bytes
from .common import butterfly_reduce_scatter, kept_start
from .gate import Gate
from .params import DecodeGeometry, DecodeTensors, TokenScalars
from .token_step import DecodeKernel, defer_decay, smem_run, token_offset, token_prepare
from .warp_mma import (
    bf16_as_f32,
    cp_async_16,
    f32_bits,
    mma_bf16_m16n8k16,
    mma_tf32_m16n8k4,
    mma_tf32_m16n8k8,
    pack_bf16x2,
    tf32_ready,
    tf32_split,
)

WARP = 32
ROWS = 16  # V rows per warp
PAIRS = 16  # b32 pairs of state values per row and lane
TOKENS = DECODE_CHUNK_MAX_TOKENS
HALF = 16  # lanes per token in the prologue (token_step's token preparation)
P_COLUMNS = 2 * TOKENS  # P = S_0·[kd_0 qd_0 kd_1 qd_1 …]
# The per-head dot products the triangle needs, in the order warp 0 reduces them: (kind, t, s)
# = ki_s·kd_t (kind 0) or ki_s·qd_t (kind 1) for s < t; padded to a power of two.
DOTS = [(kind, t, s) for t in range(1, TOKENS) for s in range(t) for kind in (0, 1)]
DOT_SLOTS = 16
KT_WORK = TOKENS * 16  # K̃ work items (kt_work)


def threads(warps: int) -> int:
    return WARP * warps


def smem_bytes(warps: int, items: int) -> int:
    return decode_chunk_smem_bytes(warps, items)


# ---- the fragment maps (plain integer functions: trace-time ints or dynamic Int32) -------------
def key_of(c, p: int, e: int):
    """Physical key of lane column c's pair p, half e (the same for both of its rows)."""
    return 32 * (p // 4) + 8 * c + 2 * (p % 4) + e


def p_column(n: int) -> tuple:
    """(kind, token) of P's column n: kind 0 = kd, 1 = qd."""
    return n % 2, n // 2


def pb_chunk(m, n, c):
    """16-byte chunk (8 bf16) of a P operand half holding column n at keys ``key_of(c, 4m ..
    4m + 3, ·)``: a lane (g = n, c) reads chunks (m, g, c), and the eight lanes of a quarter
    warp read eight consecutive chunks."""
    return (m * P_COLUMNS + n) * 4 + c


def pb_work(i):
    """(m, n, c) of P operand work item i: (c, m) fastest, so that consecutive threads read
    consecutive 32-byte runs of a column's key vector (keys 32m + 8c ..)."""
    return (i // 4) % 4, i // 16, i % 4


def kt_work(i):
    """(t, m, c_key) of K̃ work item i (TOKENS·16 of them): keys 32m + 8·c_key .. + 7 of token t,
    read as two 16-byte vectors, written as the two 4-value chunks of parity e = 0, 1 (keys
    ``key_of(c_key, 4m + jj, e)``, jj = 0..3)."""
    return i // 16, (i // 4) % 4, i % 4


def kt_index(t, e, c_key, j: int):
    """fp32 index of K̃_t at key ``key_of(c_key, j, e)`` (the update's B operand of n-tile j for
    the lanes g = 2·c_key + e, token t = c): rows of 16 values, 16-byte chunks rotated by t so a
    quarter warp (t = 0..3, e = 0/1) reads eight distinct bank groups."""
    row = (c_key * TOKENS + t) * 2 + e
    return row * 16 + 4 * ((j // 4) ^ t) + j % 4


def g1_index(k: int, n):
    """fp32 index of G's first k-step (k rows: P_kd,0..3 then P_qd,0..3; n = 2·token + (0: u, 1: o))."""
    return k * 8 + n


def g2_index(k, n):
    """fp32 index of G's v rows (k = token)."""
    return 64 + k * 8 + n


class _NaturalKeys:
    """``token_step.token_prepare`` writes key k at position k here."""

    kv = False

    @staticmethod
    def pos_of_key(key):
        return key


def _state_word(row_g, r: int, m: int, cl):
    """b32-word offset, in a head state, of lane column cl's vector m of row ``row_g + 8r``:
    keys 32m + 8·cl .. + 7 (pairs 4m .. 4m + 3 of ``key_of``)."""
    return (row_g + 8 * r) * (D // 2) + 16 * m + 4 * cl


# ---- device helpers ---------------------------------------------------------------------------
def _load_pairs(base_i32: cute.Pointer, offset, count: int) -> list:
    """``count`` b32 words at ``base_i32 + offset`` (16-byte aligned, one vector load)."""
    vec = cute.make_tensor(base_i32 + cute.assume(offset, divby=4), cute.make_layout(count)).load()
    return [vec[e] for e in range(count)]


def _store_words(dst: cute.Pointer, offset, words: list):
    frag = cute.make_rmem_tensor(cute.make_layout(len(words)), cutlass.Int32)
    for e, w in enumerate(words):
        frag[e] = w
    cute.make_tensor(dst + cute.assume(offset, divby=4), cute.make_layout(len(words))).store(frag.load())


def _build_p_operands(
    s_kdqd: cute.Tensor, s_decay: cute.Tensor, s_pb: cute.Tensor, num_tokens, tid, workers: int, deferred: bool
):
    """P's B operands: column n's fp32 key vector (zero for tokens ≥ T; ``deferred``: kd or qd
    as the prologue left them, else k̂ or q̂ times A_t here) as bf16 hi and lo halves, hi at
    ``pb_chunk``, lo a whole half (P_COLUMNS·128 bf16) later; ``workers`` threads."""
    for i in range(4 * P_COLUMNS * 4 // workers):
        m, n, c = pb_work(tid + i * workers)
        chunk = pb_chunk(m, n, c)
        kind, t = p_column(n)
        src = smem_run(s_kdqd, (kind * TOKENS + t) * D + 32 * m + 8 * c, 8)
        if not deferred:
            decay = smem_run(s_decay, t * D + 32 * m + 8 * c, 8)
        hi = cute.make_rmem_tensor(cute.make_layout(8), cutlass.Float32)
        lo = cute.make_rmem_tensor(cute.make_layout(8), cutlass.Float32)
        for e in range(8):
            x = cutlass.Float32(
                cutlass.select_(t < num_tokens, src[e] if deferred else src[e] * decay[e], cutlass.Float32(0.0))
            )
            high = x.to(cutlass.BFloat16).to(cutlass.Float32)
            hi[e] = high
            lo[e] = x - high
        for half, values in ((0, hi), (1, lo)):
            at = half * P_COLUMNS * D + chunk * 8
            cute.make_tensor(s_pb.iterator + cute.assume(at, divby=8), cute.make_layout(8)).store(
                values.load().to(cutlass.BFloat16)
            )


def _later_decay(s_alpha: cute.Tensor, first, at, num_tokens) -> list:
    """Π α_r over the tokens first < r < T at 8 keys from ``at``: each factor ≤ 1, so the product
    stays normal (≥ 2^-98 over 7 tokens at the gate's floor)."""
    product = [cutlass.Float32(1.0)] * 8
    for r in range(1, TOKENS):
        alpha = smem_run(s_alpha, r * D + at, 8)
        take = (first < r) & (r < num_tokens)
        product = [cutlass.Float32(cutlass.select_(take, product[e] * alpha[e], product[e])) for e in range(8)]
    return product


@cute.jit
def _prefix_decay(s_alpha: cute.Tensor, s_decay: cute.Tensor, num_tokens, tid, n_threads: cutlass.Constexpr[int]):
    """The unbounded gates' prologue: A_t = α_0·…·α_t per key into ``s_decay``, α, k̂ and q̂ kept
    (their products are formed where they are used: a product of per-token decays may reach
    2^-112, where the deferred k̂/A_t of ``token_step.defer_decay`` would be near fp32's limit)."""
    for i in cutlass.range_constexpr(D // n_threads):
        position = tid + i * n_threads
        decay = cutlass.Float32(1.0)
        for t in cutlass.range(num_tokens, unroll=1):
            decay = decay * s_alpha[t * D + position]
            s_decay[t * D + position] = decay


def _build_update_operands(
    s_kinv: cute.Tensor, s_khat: cute.Tensor, s_decay: cute.Tensor, s_kt: cute.Tensor, num_tokens, item, deferred: bool
):
    """K̃_t = k̂_t⊙A_{T−1}/A_t (zero for tokens ≥ T), rounded for tf32, for ``kt_work`` item
    ``item`` (one per thread): 8 keys read as vectors, written at ``kt_index``.  ``deferred``:
    ki_t⊙A_{T−1} (``s_kinv`` holds ki); else k̂_t times the decay of the tokens after t
    (``s_kinv`` holds α)."""
    t, m, c_key = kt_work(item)
    at = 32 * m + 8 * c_key
    if deferred:
        kinv = smem_run(s_kinv, t * D + at, 8)
        final = smem_run(s_decay, (num_tokens - 1) * D + at, 8)
    else:
        kinv = smem_run(s_khat, t * D + at, 8)
        final = _later_decay(s_kinv, t, at, num_tokens)
    for e in range(2):
        vals = cute.make_rmem_tensor(cute.make_layout(4), cutlass.Float32)
        for jj in range(4):
            x = kinv[2 * jj + e] * final[2 * jj + e]
            vals[jj] = tf32_ready(cutlass.select_(t < num_tokens, x, cutlass.Float32(0.0)))
        dst = kt_index(t, e, c_key, 4 * m)
        cute.make_tensor(s_kt.iterator + cute.assume(dst, divby=4), cute.make_layout(4)).store(vals.load())


def _reduce_dots(s_kinv: cute.Tensor, s_kdqd: cute.Tensor, lane, deferred: bool):
    """Warp 0's share of G: the per-head dot products ``DOTS`` (lane l sums keys 4l .. 4l + 3,
    then a reduce-scatter over the warp); returns the total lane l holds, that of
    ``DOTS[kept_start(l, DOT_SLOTS, 5)]`` (slots past ``len(DOTS)`` are zero).  ``deferred``:
    ki_s·kd_t and ki_s·qd_t; else the same products formed as k̂_s·(k̂_t or q̂_t)·Π_{s<r≤t} α_r
    (``s_kinv`` holds α, ``s_kdqd`` k̂ and q̂)."""
    ki = [smem_run(s_kinv if deferred else s_kdqd, t * D + 4 * lane, 4) for t in range(TOKENS)]
    alpha = None if deferred else [smem_run(s_kinv, t * D + 4 * lane, 4) for t in range(TOKENS)]
    partial = []
    for kind, t, s in DOTS:
        other = smem_run(s_kdqd, (kind * TOKENS + t) * D + 4 * lane, 4)
        acc = cutlass.Float32(0.0)
        for e in range(4):
            pair = ki[s][e] * other[e]
            if not deferred:
                for r in range(s + 1, t + 1):  # tokens r ≥ T are selected away with the dot itself
                    pair = pair * alpha[r][e]
            acc = acc + pair
        partial.append((acc,))
    partial += [(cutlass.Float32(0.0),)] * (DOT_SLOTS - len(DOTS))
    return butterfly_reduce_scatter(partial, lane, [1, 2, 4, 8, 16])[0][0]


def _solve_g(s_kq: cute.Tensor, s_b: cute.Tensor, s_dots: cute.Tensor, s_g: cute.Tensor, num_tokens, i, scale):
    """Lane i < TOKENS: row i of W and Z (the response of u and of o/scale to x = v − P_kd = e_i,
    by forward substitution; tokens ≥ T have b = 0, so their u is 0), written as G's rows P_kd,i,
    P_qd,i and v_i.  Entries of tokens ≥ T are selected away before use (the prologue never
    wrote them)."""
    zero = cutlass.Float32(0.0)

    def live(t, x):
        return cutlass.Float32(cutlass.select_(t < num_tokens, x, zero))

    b = [live(t, s_b[t]) for t in range(TOKENS)]
    kq = [live(t, s_kq[t]) for t in range(TOKENS)]
    dots = {key: live(key[1], s_dots[n]) for n, key in enumerate(DOTS)}
    w = []
    for t in range(TOKENS):
        acc = cutlass.Float32(cutlass.select_(i == t, cutlass.Float32(1.0), zero))
        for s in range(t):
            acc = acc - dots[(0, t, s)] * w[s]
        w.append(b[t] * acc)
    for t in range(TOKENS):
        z = kq[t] * w[t]
        for s in range(t):
            z = z + dots[(1, t, s)] * w[s]
        sz = scale * z
        s_g[g1_index(i, 2 * t)] = -w[t]
        s_g[g1_index(i, 2 * t + 1)] = -sz
        s_g[g1_index(i + TOKENS, 2 * t)] = zero
        s_g[g1_index(i + TOKENS, 2 * t + 1)] = cutlass.Float32(cutlass.select_(i == t, scale, zero))
        s_g[g2_index(i, 2 * t)] = w[t]
        s_g[g2_index(i, 2 * t + 1)] = sz


def _stage_item(pool_head: cute.Pointer, row_g, cl, stage_address, tid, n_threads: int):
    """cp.async this thread's 8 state vectors of rows ``row_g``, ``row_g + 8`` (an item's) into the
    stage: vector i = 4r + m of thread tid at ``(i·threads + tid)·16`` (a warp's copies contiguous)."""
    for i in range(8):
        r, m = divmod(i, 4)
        src = pool_head + cute.assume((row_g + 8 * r) * D + 32 * m + 8 * cl, divby=8)
        cp_async_16(stage_address + (i * n_threads + tid) * 16, src.toint(), 16)


def _compute_item(
    state: cute.Tensor,
    s_pb: cute.Tensor,
    s_g: cute.Tensor,
    s_decay: cute.Tensor,
    s_kt: cute.Tensor,
    s_o: cute.Tensor,
    v_lo,
    v_hi,
    num_tokens,
    warp,
    gl,
    cl,
):
    """One warp's 16 rows: P on tensor cores, [u | o] through G, o staged in ``s_o``, and the
    rank-T update of ``state`` in place (bf16 pairs, rounded once)."""
    # P = S_0·[kd | qd] as hi + lo halves, two accumulators (two short chains).
    pb_words = cute.recast_ptr(s_pb.iterator, dtype=cutlass.Int32)
    acc_hi = [cutlass.Float32(0.0)] * 4
    acc_lo = [cutlass.Float32(0.0)] * 4
    for m in range(4):
        b_hi = _load_pairs(pb_words, pb_chunk(m, gl, cl) * 4, 4)
        b_lo = _load_pairs(pb_words, (P_COLUMNS * D) // 2 + pb_chunk(m, gl, cl) * 4, 4)
        for half in range(2):
            p = 4 * m + 2 * half  # k-step 2m + half: pairs p, p + 1
            a = [state[p], state[PAIRS + p], state[p + 1], state[PAIRS + p + 1]]
            acc_hi = mma_bf16_m16n8k16(a, [b_hi[2 * half], b_hi[2 * half + 1]], acc_hi)
            acc_lo = mma_bf16_m16n8k16(a, [b_lo[2 * half], b_lo[2 * half + 1]], acc_lo)
    pk_g, pq_g, pk_g8, pq_g8 = [acc_hi[i] + acc_lo[i] for i in range(4)]
    # [u | o] = [P_kd | P_qd]·G1 + v·G2 (tf32: 3xTF32 for P, v is exact).
    a_parts = [tf32_split(x) for x in (pk_g, pk_g8, pq_g, pq_g8)]
    b_parts = [tf32_split(s_g[g1_index(cl, gl)]), tf32_split(s_g[g1_index(cl + TOKENS, gl)])]
    a_hi = [x[0] for x in a_parts]
    a_lo = [x[1] for x in a_parts]
    b_hi = [x[0] for x in b_parts]
    b_lo = [x[1] for x in b_parts]
    uo = mma_tf32_m16n8k8(a_lo, b_hi, [cutlass.Float32(0.0)] * 4)
    uo = mma_tf32_m16n8k8(a_hi, b_lo, uo)
    uo = mma_tf32_m16n8k8(a_hi, b_hi, uo)
    v_words = [f32_bits(cutlass.select_(cl < num_tokens, x, cutlass.Float32(0.0))) for x in (v_lo, v_hi)]
    g2_hi, g2_lo = tf32_split(s_g[g2_index(cl, gl)])
    uo = mma_tf32_m16n8k4(v_words, [g2_lo], uo)
    uo = mma_tf32_m16n8k4(v_words, [g2_hi], uo)
    u_g, o_g, u_g8, o_g8 = uo
    # o of token c, rows g and g + 8, staged per warp for 16-byte stores.
    o_base = (warp * TOKENS + cl) * ROWS
    s_o[o_base + gl] = o_g.to(cutlass.BFloat16)
    s_o[o_base + gl + 8] = o_g8.to(cutlass.BFloat16)
    # The rank-T update on the decayed state: n-tile j is pair j of both rows.
    uh_g, ul_g = tf32_split(u_g)
    uh_g8, ul_g8 = tf32_split(u_g8)
    a_u = [uh_g, uh_g8, ul_g, ul_g8]
    last = (num_tokens - 1) * D
    for m in range(4):
        decay = smem_run(s_decay, last + 32 * m + 8 * cl, 8)
        kt = smem_run(s_kt, kt_index(cl, gl % 2, gl // 2, 4 * m), 4)
        for jj in range(4):
            j = 4 * m + jj
            kb = f32_bits(kt[jj])
            c_frag = [
                bf16_as_f32(state[j], False) * decay[2 * jj],
                bf16_as_f32(state[j], True) * decay[2 * jj + 1],
                bf16_as_f32(state[PAIRS + j], False) * decay[2 * jj],
                bf16_as_f32(state[PAIRS + j], True) * decay[2 * jj + 1],
            ]
            new = mma_tf32_m16n8k8(a_u, [kb, kb], c_frag)
            state[j] = pack_bf16x2(new[0], new[1])
            state[PAIRS + j] = pack_bf16x2(new[2], new[3])


class KdaDecodeChunk(DecodeKernel):
    """The chunk kernel of one variant (``specs.DecodeChunkSpec``): the codegen arguments and what
    follows from them here, the device code in ``kernel`` (``token_step.DecodeKernel``)."""

    def __init__(self, warps: int, items: int, gate: str):
        self.warps = warps
        self.items = items
        self.gate = Gate(gate)  # asked, not compared by name (kernels/gate.py)
        self.threads = threads(warps)
        self.smem_bytes = smem_bytes(warps, items)
        self.rows = ROWS * warps * items  # V rows of a CTA

    @cute.kernel
    def kda_decode_chunk(self, tensors: DecodeTensors, geometry: DecodeGeometry, scalars: TokenScalars):
        tid, warp, lane, vblk, head, seq = self.coordinates()
        warps, items, gate, n_threads = self.warps, self.items, self.gate, self.threads
        num_tokens, num_slots, flags = geometry.num_tokens, geometry.num_slots, scalars.flags
        gl = lane // 4  # fragment row group
        cl = lane % 4  # fragment column (thread in group)
        cta_row0 = vblk * (ROWS * warps * items) + warp * ROWS  # this warp's first V row (item 0)
        n64 = cutlass.Int64(seq)

        smem = cutlass.utils.SmemAllocator()
        # decode.py's per-token arrays in natural key order: α (then ki), k̂ and q̂ (then kd, qd:
        # one [2, T, 128] array), A.
        s_kinv = smem.allocate_tensor(cutlass.Float32, cute.make_layout(TOKENS * D), 16)
        s_kdqd = smem.allocate_tensor(cutlass.Float32, cute.make_layout(2 * TOKENS * D), 16)
        s_decay = smem.allocate_tensor(cutlass.Float32, cute.make_layout(TOKENS * D), 16)
        s_pb = smem.allocate_tensor(cutlass.BFloat16, cute.make_layout(2 * P_COLUMNS * D), 16)
        s_kt = smem.allocate_tensor(cutlass.Float32, cute.make_layout(TOKENS * D), 16)
        s_g = smem.allocate_tensor(cutlass.Float32, cute.make_layout(64 + 8 * TOKENS), 16)
        s_dots = smem.allocate_tensor(cutlass.Float32, cute.make_layout(DOT_SLOTS), 16)
        s_kq = smem.allocate_tensor(cutlass.Float32, cute.make_layout(TOKENS), 16)
        s_b = smem.allocate_tensor(cutlass.Float32, cute.make_layout(TOKENS), 16)
        s_o = smem.allocate_tensor(cutlass.BFloat16, cute.make_layout(warps * TOKENS * ROWS), 16)
        # The next item's state (items > 1), refilled item by item (a placeholder for single items).
        s_stage = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(decode_chunk_stage_bytes(warps, items)), 128)
        s_khat = cute.make_tensor(s_kdqd.iterator, cute.make_layout(TOKENS * D))
        s_qhat = cute.make_tensor(s_kdqd.iterator + TOKENS * D, cute.make_layout(TOKENS * D))

        slot = self.slot(tensors, geometry, seq)
        hl = tid % HALF
        # v of token c (this lane's u / o column) for rows g, g + 8; zero past the last token.
        v_token = cutlass.min(cl, num_tokens - 1)
        v_at = token_offset(n64, geometry.v_stride_n, geometry.v_stride_t, v_token, head) + cta_row0 + gl
        v_rows = cute.make_rmem_tensor(cute.make_layout(2 * items), cutlass.Float32)
        for item in cutlass.range_constexpr(items):
            for r in cutlass.range_constexpr(2):
                at = v_at + item * ROWS * warps + 8 * r
                v_rows[2 * item + r] = cute.make_tensor(tensors.step.v + at, cute.make_layout(1))[0].to(cutlass.Float32)

        state = cute.make_rmem_tensor(cute.make_layout(2 * PAIRS), cutlass.Int32)  # [row g pairs, row g + 8 pairs]
        if seq < geometry.num_seqs and slot >= 0 and slot < num_slots:
            # slot_stride is a multiple of 16 bytes (validated): every head state is 16-byte aligned.
            head_at = cutlass.Int64(slot) * cutlass.Int64(geometry.slot_stride) + cutlass.Int64(head) * (D * D)
            pool_words = cute.recast_ptr(tensors.step.state_pool + cute.assume(head_at, divby=8), dtype=cutlass.Int32)
            for r in cutlass.range_constexpr(2):
                for m in cutlass.range_constexpr(4):
                    words = _load_pairs(pool_words, _state_word(cta_row0 + gl, r, m, cl), 4)
                    for e in cutlass.range_constexpr(4):
                        state[r * PAIRS + 4 * m + e] = words[e]
            if cutlass.const_expr(items > 1):  # the next item streams into shared memory meanwhile
                _stage_item(
                    tensors.step.state_pool + cute.assume(head_at, divby=8),
                    cta_row0 + ROWS * warps + gl,
                    cl,
                    s_stage.iterator.toint(),
                    tid,
                    n_threads,
                )
                cute.arch.cp_async_commit_group()

        # ---- prologue, overlapping the state loads: half-warp t prepares token t (whole warps, since
        # the norms shuffle over the warp; the last token is repeated past T: identical values) ------
        if warp * 2 < num_tokens:
            t0 = cutlass.min(tid // HALF, num_tokens - 1)
            inputs = self.token_loads(tensors, geometry, n64, t0, head, hl)
            token_prepare(
                _NaturalKeys, inputs, s_kinv, s_khat, s_qhat, s_kq, s_b, t0, hl, scalars.lower_bound, flags, gate
            )
        cute.arch.sync_threads()
        deferred = gate.defers_decay  # the safe gate's A_t ≥ e^(−5·4) keeps k̂/A_t finite
        if cutlass.const_expr(deferred):
            defer_decay(s_kinv, s_khat, s_qhat, s_decay, num_tokens, tid, n_threads)
        else:
            _prefix_decay(s_kinv, s_decay, num_tokens, tid, n_threads)
        cute.arch.sync_threads()
        _build_p_operands(s_kdqd, s_decay, s_pb, num_tokens, tid, n_threads, deferred)
        for i in cutlass.range_constexpr(-(-KT_WORK // n_threads)):
            if tid + i * n_threads < KT_WORK:
                _build_update_operands(s_kinv, s_khat, s_decay, s_kt, num_tokens, tid + i * n_threads, deferred)
        if warp == 0:
            total = _reduce_dots(s_kinv, s_kdqd, lane, deferred)
            if lane < DOT_SLOTS:
                s_dots[kept_start(lane, DOT_SLOTS, 5)] = total
            cute.arch.sync_warp()
            if lane < TOKENS:
                _solve_g(s_kq, s_b, s_dots, s_g, num_tokens, lane, scalars.scale)
        cute.arch.sync_threads()

        out_lane_token = lane // 2  # lanes 0 .. 2T − 1 store the warp's outputs: token, 8-row half
        out_base = token_offset(n64, geometry.out_stride_n, geometry.out_stride_t, out_lane_token, head) + 8 * (
            lane % 2
        )
        if seq < geometry.num_seqs and slot >= 0 and slot < num_slots:
            head_at = cutlass.Int64(slot) * cutlass.Int64(geometry.slot_stride) + cutlass.Int64(head) * (D * D)
            pool_head = tensors.step.state_pool + cute.assume(head_at, divby=8)
            pool_words = cute.recast_ptr(pool_head, dtype=cutlass.Int32)
            for item in cutlass.range_constexpr(items):
                row0 = cta_row0 + item * ROWS * warps
                if cutlass.const_expr(item > 0):
                    cute.arch.cp_async_wait_group(0)  # this thread's own staged vectors have landed
                    stage_words = cute.recast_ptr(s_stage.iterator, dtype=cutlass.Int32)
                    for i in cutlass.range_constexpr(8):
                        words = _load_pairs(stage_words, (i * n_threads + tid) * 4, 4)
                        for e in cutlass.range_constexpr(4):
                            state[(i // 4) * PAIRS + 4 * (i % 4) + e] = words[e]
                    if cutlass.const_expr(item + 1 < items):
                        # Each thread refills only its own vectors: no barrier between unstage and refill.
                        _stage_item(pool_head, row0 + ROWS * warps + gl, cl, s_stage.iterator.toint(), tid, n_threads)
                        cute.arch.cp_async_commit_group()
                _compute_item(
                    state,
                    s_pb,
                    s_g,
                    s_decay,
                    s_kt,
                    s_o,
                    v_rows[2 * item],
                    v_rows[2 * item + 1],
                    num_tokens,
                    warp,
                    gl,
                    cl,
                )
                for r in cutlass.range_constexpr(2):
                    for m in cutlass.range_constexpr(4):
                        _store_words(
                            pool_words,
                            _state_word(row0 + gl, r, m, cl),
                            [state[r * PAIRS + 4 * m + e] for e in range(4)],
                        )
                cute.arch.sync_warp()
                if lane < 2 * num_tokens:
                    staged = cute.make_tensor(
                        s_o.iterator + cute.assume((warp * TOKENS + out_lane_token) * ROWS + 8 * (lane % 2), divby=8),
                        cute.make_layout(8),
                    )
                    out_at = out_base + row0
                    cute.make_tensor(tensors.out + cute.assume(out_at, divby=8), cute.make_layout(8)).store(
                        staged.load()
                    )
                if cutlass.const_expr(item + 1 < items):
                    cute.arch.sync_warp()  # the next item's o overwrites this one's staging
        else:
            # Padding row: zeros out, nothing else; a slot other than -1 is reported.
            if tid == 0:
                self.report_padding(tensors, flags, slot, num_slots)
            if seq < geometry.num_seqs and lane < 2 * num_tokens:
                frag = cute.make_rmem_tensor(cute.make_layout(8), cutlass.Float32)
                frag.fill(0.0)
                for item in cutlass.range_constexpr(items):
                    out_at = out_base + cta_row0 + item * ROWS * warps
                    cute.make_tensor(tensors.out + cute.assume(out_at, divby=8), cute.make_layout(8)).store(
                        frag.load().to(cutlass.BFloat16)
                    )

    kernel = kda_decode_chunk
