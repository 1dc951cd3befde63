"""A decode token's preparation, shared by the token kernel (``decode.py``) and the chunk kernel
(``decode_chunk.py``), and their common base class (``DecodeKernel``): the token loads (q, k, g, β and the gate parameters), q̂, k̂, α = e^γ, k̂·q̂ and
b into shared memory by half-warps, and the deferred decay (A_t, k̂/A_t, A_t⊙k̂, A_t⊙q̂)."""

import cutlass
import cutlass.cute as cute

from ..layout import FLAG_BETA_PROBABILITY, FLAG_QK_AS_GIVEN, STATUS_SLOT_OUT_OF_RANGE, D
from ..specs import DECODE_FLAG_STATUS
from .common import LOG2E, TRACE_HEADS, beta_weight, exp2_fast, report_status
from .gate import Gate
from .params import DecodeGeometry, DecodeTensors, grouped


class DecodeKernel:
    """What the two decode kernel classes (``decode.KdaDecode``, ``decode_chunk.KdaDecodeChunk``)
    share (docs/DESIGN.md, Kernels as classes): the launch, ``str(self)``, and the device helpers
    that read their parameter groups.  A subclass sets ``rows`` (V rows per CTA), ``threads`` and
    ``smem_bytes`` (the built maximum) and defines the device method ``kernel``, which takes the
    runtime parameters as ``(DecodeTensors, DecodeGeometry, TokenScalars)``
    (``specs.DECODE_PARAMS``) and reads the codegen arguments from ``self``.

    The device method is defined under the former kernel function's name less ``_kernel``
    (``kda_decode``) and ``str(self)`` is ``"kernel"``, so the entry symbol is the function's,
    ``kernel_cutlass_kda_decode_kernel_<the pointers' types, cut at 180 characters>_0``: the
    codegen arguments, once trailing Constexpr arguments, never reached the cut symbol."""

    rows: int
    threads: int
    smem_bytes: int

    def __str__(self) -> str:
        return "kernel"  # the entry symbol's component for ``self`` (see the class docstring)

    @cute.jit
    def __call__(self, *params, stream):
        # ``params``: the kernel's runtime parameters (``specs.DECODE_PARAMS``); the grid is a
        # placeholder (the runtime launches the spec's).
        self.kernel(*grouped(self.kernel, *params)).launch(
            grid=[D // self.rows, TRACE_HEADS, 1], block=[self.threads, 1, 1], smem=self.smem_bytes, stream=stream
        )

    def coordinates(self):
        """(thread, warp, lane, V block, head, sequence) of this thread: the CTA's grid coordinates
        are (V block, head, sequence)."""
        tid, _, _ = cute.arch.thread_idx()
        vblk, head, seq = cute.arch.block_idx()
        return tid, tid // 32, tid % 32, vblk, head, seq

    def token_loads(self, tensors: DecodeTensors, geometry: DecodeGeometry, n64, t, head, hl):
        """Issue one half-warp lane's loads for token ``t`` of sequence ``n64`` (columns
        8·hl .. 8·hl + 7 of q, k, g and dt_bias, β, A_log); the values are consumed by
        ``token_prepare``."""
        q_at = token_offset(n64, geometry.q_stride_n, geometry.q_stride_t, t, head)
        k_at = token_offset(n64, geometry.k_stride_n, geometry.k_stride_t, t, head)
        g_at = token_offset(n64, geometry.g_stride_n, geometry.g_stride_t, t, head)
        beta_at = beta_offset(geometry, n64, t, head)
        col = hl * 8
        return (
            bf16_row8(tensors.step.q, q_at + col),
            bf16_row8(tensors.step.k, k_at + col),
            bf16_row8(tensors.step.g, g_at + col),
            f32x8(tensors.step.dt_bias, head * D + col),
            cute.make_tensor(tensors.step.beta + beta_at, cute.make_layout(1))[0].to(cutlass.Float32),
            cute.make_tensor(tensors.step.a_log + head, cute.make_layout(1))[0],
        )

    def slot(self, tensors: DecodeTensors, geometry: DecodeGeometry, at):
        """Entry ``at`` of the slot indices, ``state_indices[index_offset + at]``: sequence ``at``'s
        slot, or an entry of ``[N, T]`` indices."""
        return cute.make_tensor(tensors.step.state_indices + geometry.index_offset + at, cute.make_layout(1))[0]

    def report_padding(self, tensors: DecodeTensors, flags, slot, num_slots):
        """A padding row's report: a slot other than -1 (outside the pool) into the status word."""
        report_status(
            tensors.status,
            (flags & DECODE_FLAG_STATUS) != 0,
            cutlass.select_((slot >= num_slots) | (slot < -1), STATUS_SLOT_OUT_OF_RANGE, 0),
        )


def beta_offset(geometry: DecodeGeometry, n64, t, head):
    """β's element offset for token ``t`` of sequence ``n64`` and ``head`` (from the pointer
    rounded down to 16 bytes: ``beta_offset`` elements on)."""
    return (
        cutlass.Int64(geometry.beta_offset)
        + n64 * geometry.beta_stride_n
        + cutlass.Int64(t) * geometry.beta_stride_t
        + head
    )


def bf16_row8(base: cute.Pointer, offset):
    """Eight bf16 at ``base + offset`` (16-byte aligned) widened to fp32."""
    return cute.make_tensor(base + cute.assume(offset, divby=8), cute.make_layout(8)).load().to(cutlass.Float32)


def f32x8(base: cute.Pointer, offset):
    """Eight fp32 at ``base + offset`` (32-byte aligned: two 16-byte vectors)."""
    return cute.make_tensor(base + cute.assume(offset, divby=8), cute.make_layout(8)).load()


def smem_run(array: cute.Tensor, at, count: int):
    """``count`` consecutive fp32 of a shared-memory array (one vector read when count > 1)."""
    if count == 1:
        return [array[at]]
    vec = cute.make_tensor(array.iterator + cute.assume(at, divby=count), cute.make_layout(count)).load()
    return [vec[e] for e in range(count)]


def token_offset(n64, stride_n, stride_t, t, head):
    """Element offset of head ``head``'s row of token ``t`` of sequence ``n64`` (Int64) in a
    ``[N, T, H, 128]`` tensor with sequence and token strides ``stride_n``, ``stride_t``."""
    return n64 * stride_n + cutlass.Int64(t) * stride_t + head * D


def token_prepare(
    tile,
    inputs,
    s_alpha: cute.Tensor,
    s_khat: cute.Tensor,
    s_qhat: cute.Tensor,
    s_kq: cute.Tensor,
    s_b: cute.Tensor,
    t,
    hl,
    lower_bound,
    flags,
    gate: Gate,
):
    """q̂, k̂ (l2norm over the half-warp, or as given under ``FLAG_QK_AS_GIVEN``; rounded to bf16),
    α = e^γ (γ by ``gate``, as in K1), k̂·q̂ and b = σ(β) (β under ``FLAG_BETA_PROBABILITY``; bits of
    the kernel's ``flags``) of token ``t`` into shared memory, each key at its ``tile.pos_of_key`` position.  The half-warp's lanes hold bit-identical sums after the
    butterflies, so all of them store k̂·q̂ and b (same address, same value): no branch.  With q
    and β None (a committed draft token: ``s_qhat``, ``s_kq`` and ``s_b`` None too) only k̂ and α,
    by the same arithmetic."""
    vq, vk, vg, bias, beta_value, a_log_value = inputs
    with_q = vq is not None
    col = hl * 8
    ssq = cutlass.Float32(0.0)
    ssk = cutlass.Float32(0.0)
    for e in range(8):
        if with_q:
            ssq = ssq + vq[e] * vq[e]
        ssk = ssk + vk[e] * vk[e]
    for b in range(4):
        if with_q:
            ssq = ssq + cute.arch.shuffle_sync_bfly(ssq, offset=1 << b)
        ssk = ssk + cute.arch.shuffle_sync_bfly(ssk, offset=1 << b)
    qk_as_given = (flags & FLAG_QK_AS_GIVEN) != 0
    rq = cutlass.Float32(cutlass.select_(qk_as_given, cutlass.Float32(1.0), cute.math.rsqrt(ssq + 1e-6)))
    rk = cutlass.Float32(cutlass.select_(qk_as_given, cutlass.Float32(1.0), cute.math.rsqrt(ssk + 1e-6)))
    decay_rate = exp2_fast(a_log_value * cutlass.Float32(LOG2E))
    fq = cute.make_rmem_tensor(cute.make_layout(8), cutlass.Float32)
    fk = cute.make_rmem_tensor(cute.make_layout(8), cutlass.Float32)
    fa = cute.make_rmem_tensor(cute.make_layout(8), cutlass.Float32)
    kq = cutlass.Float32(0.0)
    for e in range(8):
        if with_q:
            fq[e] = (vq[e] * rq).to(cutlass.BFloat16).to(cutlass.Float32)
        fk[e] = (vk[e] * rk).to(cutlass.BFloat16).to(cutlass.Float32)
        if with_q:
            kq = kq + fq[e] * fk[e]
        fa[e] = exp2_fast(gate.token_log2_gamma(vg[e], bias, e, decay_rate, lower_bound))
    if with_q:
        for b in range(4):
            kq = kq + cute.arch.shuffle_sync_bfly(kq, offset=1 << b)
    arrays = ((s_qhat, fq), (s_khat, fk), (s_alpha, fa)) if with_q else ((s_khat, fk), (s_alpha, fa))
    for run in range(2):  # keys col + 4·run .. + 3
        at = t * D + tile.pos_of_key(col + 4 * run)
        for dst, values in arrays:
            if tile.kv:  # consecutive keys lie 4 positions apart
                for e in range(4):
                    dst[at + 4 * e] = values[4 * run + e]
            else:  # consecutive keys are consecutive positions: one 16-byte store
                run_values = cute.make_rmem_tensor(cute.make_layout(4), cutlass.Float32)
                for e in range(4):
                    run_values[e] = values[4 * run + e]
                cute.make_tensor(dst.iterator + cute.assume(at, divby=4), cute.make_layout(4)).store(run_values.load())
    if with_q:
        s_kq[t] = kq
        s_b[t] = beta_weight(beta_value, (flags & FLAG_BETA_PROBABILITY) != 0)


@cute.jit
def defer_decay(
    s_alpha: cute.Tensor,
    s_khat: cute.Tensor,
    s_qhat: cute.Tensor,
    s_decay: cute.Tensor,
    num_tokens,
    tid,
    n_threads: cutlass.Constexpr[int],
):
    """Deferred decay, in place per key (all four arrays share the key positions, so this walks
    positions): with A_t = α_0·…·α_t, the state after token t is
    S_t = S'_t·diag(A_t) where S' only takes rank-1 updates, so token t needs A_t⊙k̂ and A_t⊙q̂
    (for the dot products, over k̂ and q̂) and k̂/A_t (for the update, over α), and a stored state
    is S'·diag(A_t) (``s_decay``).  A_t ≥ e^(−5·8) stays a normal fp32 (lower_bound ≥ −5,
    T ≤ 8), and every product is exact to fp32 rounding relative to the state it contributes
    to."""
    for i in cutlass.range_constexpr(D // n_threads):
        position = tid + i * n_threads
        decay = cutlass.Float32(1.0)
        for t in cutlass.range(num_tokens, unroll=1):
            at = t * D + position
            decay = decay * s_alpha[at]
            khat = s_khat[at]
            s_khat[at] = khat * decay
            s_qhat[at] = s_qhat[at] * decay
            s_alpha[at] = khat / decay
            s_decay[at] = decay


@cute.jit
def direct_decay(
    s_alpha: cute.Tensor, s_khat: cute.Tensor, s_decay: cute.Tensor, num_tokens, tid, n_threads: cutlass.Constexpr[int]
):
    """The unbounded gates' form of ``defer_decay``: a product A_t of per-token decays may reach
    2^-112 (8 tokens at the gate's floor), where k̂/A_t would be near fp32's limit, so the state
    is decayed token by token
    (``s_decay`` = α_t, applied before each token's dot products) and updated with k̂ itself
    (``s_alpha`` ← k̂; ``s_khat`` and ``s_qhat`` stay k̂ and q̂)."""
    for i in cutlass.range_constexpr(D // n_threads):
        position = tid + i * n_threads
        for t in cutlass.range(num_tokens, unroll=1):
            at = t * D + position
            s_decay[at] = s_alpha[at]
            s_alpha[at] = s_khat[at]
