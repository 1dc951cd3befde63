"""The fused KDA decode layer: from the projections' outputs to ``o_proj``'s input in one launch
(docs/CONTRACT.md §10, the layer step).  For request n, head h and tokens t = 0 .. T−1:

    x̃_t = silu(b + Σ_w W[:, w]·window[t + w])          per channel of q, k and v, rounded to bf16;
        window = [conv state (3 taps, oldest first); x_0 .. x_{T−1}], new conv state = its last 3
    the KDA step on (q̃, k̃, ṽ) exactly as ``kernels/decode.py`` (gate, l2norm, β, the state pool)
    o_t = bf16(scale·(S q̂ + …)),  y_t = o_t·rsqrt(mean_v o_t² + eps)·w_norm·σ(z_t)   per head

(the roundings are fla's: its convolution writes bf16, its recurrent kernel writes bf16 o and its
gated RMSNorm reads it).  The work splits as the decode token kernel's, over (V block, head,
request); the ``ctas = 128 / (items·v_block)`` V blocks of a (request, head) are one cluster:

* every CTA convolves all 128 q and k channels of its head (each needs k̂ and q̂ whole) and its
  own v rows; CTA r writes the new conv state of channels [r·rows, (r+1)·rows) of q, k and v,
  after a cluster barrier proves every CTA has read the old q and k state;
* each CTA sums o² over its rows per token into shared memory; after the barrier each reads the
  others' sums through distributed shared memory, and a second barrier keeps a CTA's sums alive
  until its peers have read them.

The conv states, conv weights / biases and the RMSNorm weight are bf16 or fp32 by ``flags``
(``specs.LAYER_FLAG_*``): read at run time, so the dtypes an engine keeps need no new build.
Conv states are addressed by element strides (slot, channel, tap), so dim-major ``[slots, C, 3]``,
token-major ``[slots, 3, C]`` and fla's ``[N, C, 4]`` cache (its last three taps) are all views.
A padding request (slot outside the pool) reads and writes nothing and gets zeros, as in decode.
"""

import cutlass
import cutlass.cute as cute

from ..layout import D
from ..layout import STATUS_DRAFT_OUT_OF_RANGE
from ..specs.decode_layer import (
    CONV_STATE_TAPS,
    CONV_WIDTH,
    DRAFT_BANKS,
    DRAFT_G,
    DRAFT_ROWS,
    DRAFT_TOKENS,
    DRAFT_U,
    DRAFT_X,
    draft_mark,
    LAYER_FLAG_DRAFTS,
    LAYER_FLAG_STATUS,
    LAYER_FLAG_VERIFY,
    LAYER_FLAG_CONV_BIAS,
    LAYER_FLAG_CONV_STATE_F32,
    LAYER_FLAG_CONV_WEIGHT_F32,
    LAYER_FLAG_NORM_WEIGHT_F32,
    layer_smem_bytes,
)
from .common import TRACE_HEADS, grid_heads, report_status, sigmoid
from .decode import (
    MAX_TOKENS,
    ROWS_PER_WARP,
    VALUES,
    _io_token,
    _item_stage_bytes,
    _step_decay,
    _store8,
    _store_state,
    _tile,
    _token_step,
    first_item,
    head_state,
    next_item,
    token_io,
    zero_outputs,
    threads,
    token_arrays,
)
from .gate import Gate
from .params import ConvGeometry, DecodeGeometry, LayerTensors, TokenScalars, grouped
from .warp_mma import ld_cluster_f32
from .token_step import (
    DecodeKernel,
    beta_offset,
    bf16_row8,
    defer_decay,
    direct_decay,
    f32x8,
    smem_run,
    token_offset,
    token_prepare,
)


def _typed(base: cute.Pointer, dtype):
    """``base`` (a byte pointer) as a pointer to ``dtype`` aligned to its size: a conv state is
    declared 2-byte aligned (any bf16 view), and an fp32 one is then 4-byte aligned, so each
    element stays one access."""
    return cute.make_ptr(dtype, base.toint(), cute.AddressSpace.gmem, assumed_align=dtype.width // 8)


@cute.jit
def load_value(base: cute.Pointer, offset, is_f32):
    """One element at ``base + offset`` (elements) of a tensor that is fp32 when ``is_f32``, else bf16."""
    value = cutlass.Float32(0.0)
    if is_f32:
        value = cute.make_tensor(_typed(base, cutlass.Float32) + offset, cute.make_layout(1))[0]
    else:
        value = cute.make_tensor(_typed(base, cutlass.BFloat16) + offset, cute.make_layout(1))[0].to(cutlass.Float32)
    return value


@cute.jit
def store_value(base: cute.Pointer, offset, value, is_f32):
    """``value`` into element ``offset`` of a tensor that is fp32 when ``is_f32``, else bf16."""
    if is_f32:
        cute.make_tensor(_typed(base, cutlass.Float32) + offset, cute.make_layout(1))[0] = value
    else:
        cute.make_tensor(_typed(base, cutlass.BFloat16) + offset, cute.make_layout(1))[0] = value.to(cutlass.BFloat16)


@cute.jit
def load8(base: cute.Pointer, offset, is_f32):
    """Eight elements at ``base + offset`` (a multiple of 8 elements; 16-byte aligned) as fp32:
    one 16-byte vector of bf16, or two of fp32."""
    values = cute.make_rmem_tensor(cute.make_layout(8), cutlass.Float32)
    if is_f32:
        values.store(f32x8(cute.recast_ptr(base, dtype=cutlass.Float32), offset))
    else:
        values.store(bf16_row8(cute.recast_ptr(base, dtype=cutlass.BFloat16), offset))
    return values


@cute.jit
def conv8(x: cute.Pointer, x_at, x_token_stride, state: cute.Pointer, state_at, history, weight, bias, t, conv, flags):
    """The convolution output of 8 channels at token ``t`` (an rmem fp32[8], rounded to bf16).
    The window runs over E = [conv state (3 taps); the ``accepted`` inputs of a committed draft;
    this call's inputs]: token t reads E[a + t .. a + t + 3], position p being conv-state tap p
    while p < 3 (``state_at``: the element offset of the first channel's tap 0 in its slot), a
    draft record's input while p < 3 + a (``history`` = (records, offset of token 0's row, a)),
    else input token p − 3 − a (``x_at``: the first channel at token 0, tokens ``x_token_stride``
    apart).  ``weight``: the channels' [8, 4] taps, ``bias`` their biases (fp32 rmem)."""
    records, record_at, accepted = history
    state_f32 = (flags & LAYER_FLAG_CONV_STATE_F32) != 0
    acc = cute.make_rmem_tensor(cute.make_layout(8), cutlass.Float32)
    for e in cutlass.range_constexpr(8):
        acc[e] = bias[e]
    for w in cutlass.range_constexpr(CONV_WIDTH):
        p = accepted + t + w
        window = cute.make_rmem_tensor(cute.make_layout(8), cutlass.Float32)
        if p < CONV_STATE_TAPS:
            for e in cutlass.range_constexpr(8):
                window[e] = load_value(
                    state,
                    state_at + cutlass.Int64(e * conv.channel_stride + p * conv.tap_stride),
                    state_f32,
                )
        else:
            if p < CONV_STATE_TAPS + accepted:
                window.store(bf16_row8(records, record_at + cutlass.Int64(p - CONV_STATE_TAPS) * draft_token_stride()))
            else:
                window.store(bf16_row8(x, x_at + cutlass.Int64(p - CONV_STATE_TAPS - accepted) * x_token_stride))
        for e in cutlass.range_constexpr(8):
            acc[e] = acc[e] + weight[e * CONV_WIDTH + w] * window[e]
    out = cute.make_rmem_tensor(cute.make_layout(8), cutlass.Float32)
    for e in cutlass.range_constexpr(8):
        out[e] = (acc[e] * sigmoid(acc[e])).to(cutlass.BFloat16).to(cutlass.Float32)
    return out


def draft_offset(slot, bank, t, head, row):
    """Element (bf16) offset of row ``row`` (``specs.DRAFT_*``) of token ``t`` and head ``head`` in
    bank ``bank`` of slot ``slot``'s draft records ``[slots, banks, tokens, H, rows, 128]``."""
    at = (cutlass.Int64(slot) * DRAFT_BANKS + bank) * DRAFT_TOKENS + t
    return ((at * grid_heads() + head) * DRAFT_ROWS + row) * D


def draft_token_stride():
    """Elements (bf16) between one token's draft records and the next's."""
    return cutlass.Int64(grid_heads()) * (DRAFT_ROWS * D)


def draft_updates(records: cute.Pointer, slot, bank, head):
    """(The records as fp32, the fp32 offset of token 0's u row of head ``head`` in a bank): u of
    token t lies ``t · draft_token_stride() // 2`` fp32 further.  (The base pointer is recast, not
    an offset one: that kept 60 more registers live in the token loop.)"""
    return cute.recast_ptr(records, dtype=cutlass.Float32), draft_offset(slot, bank, 0, head, DRAFT_U) // 2


def _replay_token(tile, state: cute.Tensor, s_khat: cute.Tensor, s_alpha: cute.Tensor, updates, d, j, row0):
    """Committed draft token ``d`` on this thread's 64 state values: S ← S·diag(α) + u k̂ᵀ with α
    and k̂ at its keys from the commit's replay arrays and u at its rows ``row0 ..`` from the
    record (``updates``: ``draft_updates``)."""
    records, u0 = updates
    u_at = u0 + cutlass.Int64(d) * (draft_token_stride() // 2) + row0
    u = [cute.make_tensor(records + (u_at + vi), cute.make_layout(1))[0] for vi in range(tile.vt)]
    for ki0, count in tile.key_chunks():
        at = d * D + tile.key_pos(j, ki0)
        khats = smem_run(s_khat, at, count)
        alphas = smem_run(s_alpha, at, count)
        for c in range(count):
            for vi in range(tile.vt):
                value = state[vi * tile.kt + ki0 + c]
                state[vi * tile.kt + ki0 + c] = value * alphas[c] + u[vi] * khats[c]


@cute.jit
def conv_params8(weight: cute.Pointer, bias: cute.Pointer, channel, flags):
    """The [8, 4] taps (row-major) and the biases (zeros without ``LAYER_FLAG_CONV_BIAS``) of
    channels ``channel .. channel + 7`` (a multiple of 8) of a conv weight ``[C, 4]``."""
    weight_f32 = (flags & LAYER_FLAG_CONV_WEIGHT_F32) != 0
    taps = cute.make_rmem_tensor(cute.make_layout(8 * CONV_WIDTH), cutlass.Float32)
    for part in cutlass.range_constexpr(CONV_WIDTH):
        chunk = load8(weight, cutlass.Int64(channel) * CONV_WIDTH + 8 * part, weight_f32)
        for e in cutlass.range_constexpr(8):
            taps[8 * part + e] = chunk[e]
    biases = cute.make_rmem_tensor(cute.make_layout(8), cutlass.Float32)
    biases.fill(0.0)
    if (flags & LAYER_FLAG_CONV_BIAS) != 0:
        biases.store(load8(bias, cutlass.Int64(channel), weight_f32).load())
    return taps, biases


class KdaDecodeLayer(DecodeKernel):
    """The fused layer of one variant (``specs.DecodeLayerSpec``)."""

    def __init__(self, kv_layout: bool, bf16_state: bool, v_block: int, items: int, gate: str):
        self.kv_layout = kv_layout
        self.bf16_state = bf16_state
        self.v_block = v_block
        self.items = items
        self.gate = Gate(gate)
        self.tile = _tile(kv_layout, bf16_state)
        self.threads = threads(v_block)
        self.smem_bytes = layer_smem_bytes(v_block, items, bf16_state, drafts=True)
        self.rows = items * v_block
        self.ctas = D // self.rows  # the cluster: the V blocks of one (request, head)

    @cute.jit
    def __call__(self, *params, stream):
        # ``params``: the kernel's runtime parameters (``specs.LAYER_PARAMS``); the grid is a
        # placeholder (the runtime launches the spec's, in clusters of ``ctas``).
        self.kernel(*grouped(self.kernel, *params)).launch(
            grid=[self.ctas, TRACE_HEADS, 1],
            block=[self.threads, 1, 1],
            smem=self.smem_bytes,
            stream=stream,
            min_blocks_per_mp=6,
            preferred_smem_carveout=100,
            **({"cluster": [self.ctas, 1, 1]} if self.ctas > 1 else {}),
        )

    def layer_token_loads(self, tensors, geometry, conv, n64, t, head, hl, conv_at, draft, flags):
        """``token_step.token_prepare``'s inputs for token ``t``, q and k convolved (this lane's 8
        channels, ``hl``; ``draft`` = (slot, old bank, accepted) for the history), g, dt_bias, β and
        A_log as in decode."""
        col = hl * 8
        channel = head * D + col
        q_params = conv_params8(tensors.conv_weight_q, tensors.conv_bias_q, channel, flags)
        k_params = conv_params8(tensors.conv_weight_k, tensors.conv_bias_k, channel, flags)
        state_at = conv_at + cutlass.Int64(channel) * conv.channel_stride
        q_at = token_offset(n64, geometry.q_stride_n, 0, 0, head) + col
        k_at = token_offset(n64, geometry.k_stride_n, 0, 0, head) + col
        slot, bank, accepted = draft
        history = [
            (tensors.draft_records, draft_offset(slot, bank, 0, head, DRAFT_X + s) + col, accepted) for s in (0, 1)
        ]
        vq = conv8(
            tensors.step.q,
            q_at,
            geometry.q_stride_t,
            tensors.conv_state_q,
            state_at,
            history[0],
            *q_params,
            t,
            conv,
            flags,
        )
        vk = conv8(
            tensors.step.k,
            k_at,
            geometry.k_stride_t,
            tensors.conv_state_k,
            state_at,
            history[1],
            *k_params,
            t,
            conv,
            flags,
        )
        g_at = token_offset(n64, geometry.g_stride_n, geometry.g_stride_t, t, head)
        beta_at = beta_offset(geometry, n64, t, head)
        return (
            vq.load(),
            vk.load(),
            bf16_row8(tensors.step.g, g_at + col),
            f32x8(tensors.step.dt_bias, head * D + col),
            cute.make_tensor(tensors.step.beta + beta_at, cute.make_layout(1))[0].to(cutlass.Float32),
            cute.make_tensor(tensors.step.a_log + head, cute.make_layout(1))[0],
        )

    def replay_token_loads(self, tensors, geometry, conv, d, head, hl, conv_at, draft, flags):
        """``token_prepare``'s inputs for token ``d`` of the pending draft being committed: k
        convolved over the committed conv state and the recorded inputs, g from the record,
        dt_bias and A_log as in decode (q and β are not needed: only k̂ and α are kept)."""
        col = hl * 8
        channel = head * D + col
        slot, bank, accepted = draft
        vk = conv8(
            tensors.step.k,
            cutlass.Int64(0),  # the window ends in the record: no input token is read
            geometry.k_stride_t,
            tensors.conv_state_k,
            conv_at + cutlass.Int64(channel) * conv.channel_stride,
            (tensors.draft_records, draft_offset(slot, bank, 0, head, DRAFT_X + 1) + col, accepted),
            *conv_params8(tensors.conv_weight_k, tensors.conv_bias_k, channel, flags),
            d - accepted,
            conv,
            flags,
        )
        return (
            None,
            vk.load(),
            bf16_row8(tensors.draft_records, draft_offset(slot, bank, d, head, DRAFT_G) + col),
            f32x8(tensors.step.dt_bias, head * D + col),
            None,
            cute.make_tensor(tensors.step.a_log + head, cute.make_layout(1))[0],
        )

    @cute.kernel
    def kda_decode_layer(
        self,
        tensors: LayerTensors,
        geometry: DecodeGeometry,
        conv: ConvGeometry,
        scalars: TokenScalars,
        norm_eps: cutlass.Float32,
    ):
        tid, warp, lane, vblk, head, seq = self.coordinates()
        v_block, items, gate, rows, n_threads, ctas = (
            self.v_block,
            self.items,
            self.gate,
            self.rows,
            self.threads,
            self.ctas,
        )
        num_tokens, num_slots, flags = geometry.num_tokens, geometry.num_slots, scalars.flags
        v0 = vblk * rows
        n64 = cutlass.Int64(seq)
        head_elems = cutlass.Int64(head) * (D * D)

        smem = cutlass.utils.SmemAllocator()
        # The RMSNorm's sums first: the per-token arrays must stay last (a launch sizes them for its T).
        s_sumsq = smem.allocate_tensor(cutlass.Float32, cute.make_layout(MAX_TOKENS), 16)
        s_stage, s_kq, s_b, s_alpha, s_khat, s_qhat, s_decay, s_v, s_o = token_arrays(
            smem, v_block, items, self.bf16_state, num_tokens
        )
        item_stage = _item_stage_bytes(v_block, self.bf16_state)
        # A commit's k̂ and α of the accepted tokens, behind this T's arrays (``DRAFT_REPLAY_BYTES``:
        # a launch with drafts asks for them).
        replay = cute.recast_ptr(s_o.iterator + cute.assume(num_tokens * rows, divby=32), dtype=cutlass.Float32)
        s_replay_khat = cute.make_tensor(replay, cute.make_layout(DRAFT_TOKENS * D))
        s_replay_alpha = cute.make_tensor(replay + DRAFT_TOKENS * D, cute.make_layout(DRAFT_TOKENS * D))

        slot = self.slot(tensors, geometry, seq)
        chunks, rounds, io_col, hl, half_id, n_half = token_io(tid, v_block, items)
        group, j = self.tile.lane_parts(lane)
        row_local = warp * ROWS_PER_WARP + group * self.tile.vt
        lane_off = self.tile.lane_offset(v0 + row_local, j)

        if seq < geometry.num_seqs and slot >= 0 and slot < num_slots:
            conv_at = cutlass.Int64(slot) * cutlass.Int64(conv.slot_stride)
            # This (slot, head)'s pending draft, if any (``specs.draft_mark``: its bank and length),
            # and how many of its tokens to commit; this call's draft, if it is one, goes to the
            # other bank.  Each head's cluster owns its mark: heads of one request may run in
            # different waves.
            drafts = (flags & LAYER_FLAG_DRAFTS) != 0
            verify = drafts & ((flags & LAYER_FLAG_VERIFY) != 0)
            mark_at = cutlass.Int64(slot) * grid_heads() + head
            mark = cutlass.Int32(0)
            accepted = cutlass.Int32(0)
            if drafts:
                mark = cute.make_tensor(tensors.draft_marks + mark_at, cute.make_layout(1))[0]
                bad = (mark != 0) & ((mark < draft_mark(0, 1)) | (mark > draft_mark(1, DRAFT_TOKENS)))
                mark = cutlass.select_(bad, cutlass.Int32(0), mark)
                if mark > 0:
                    drafted = (mark - 1) >> 1  # the pending draft's tokens
                    requested = cute.make_tensor(tensors.num_accepted + seq, cute.make_layout(1))[0]
                    bad = bad | (requested < 0) | (requested > drafted)
                    accepted = cutlass.min(cutlass.max(requested, cutlass.Int32(0)), drafted)
                if tid == 0 and vblk == 0:
                    report_status(
                        tensors.status,
                        (flags & LAYER_FLAG_STATUS) != 0,
                        cutlass.select_(bad, cutlass.Int32(STATUS_DRAFT_OUT_OF_RANGE), cutlass.Int32(0)),
                    )
            old_bank = cutlass.select_(mark > 0, (mark - 1) & 1, cutlass.Int32(0))
            new_bank = cutlass.select_(mark > 0, 1 - old_bank, cutlass.Int32(0))
            pool_head = head_state(self.tile, tensors, geometry, slot, head_elems)
            state = cute.make_rmem_tensor(cute.make_layout(VALUES), cutlass.Float32)

            # ---- prologue: q̃, k̃ by the convolution, then q̂, k̂, α, k̂·q̂, b per token; ṽ staged --
            for base in cutlass.range(0, num_tokens, n_half, unroll=1):
                t = cutlass.min(base + half_id, num_tokens - 1)
                inputs = self.layer_token_loads(
                    tensors, geometry, conv, n64, t, head, hl, conv_at, (slot, old_bank, accepted), flags
                )
                token_prepare(
                    self.tile, inputs, s_alpha, s_khat, s_qhat, s_kq, s_b, t, hl, scalars.lower_bound, flags, gate
                )
            for base in cutlass.range(0, accepted, n_half, unroll=1):
                d = cutlass.min(base + half_id, accepted - 1)
                inputs = self.replay_token_loads(
                    tensors, geometry, conv, d, head, hl, conv_at, (slot, old_bank, accepted), flags
                )
                token_prepare(
                    self.tile,
                    inputs,
                    s_replay_alpha,
                    s_replay_khat,
                    None,
                    None,
                    None,
                    d,
                    hl,
                    scalars.lower_bound,
                    flags,
                    gate,
                )
            v_channel = head * D + v0 + io_col
            v_params = conv_params8(tensors.conv_weight_v, tensors.conv_bias_v, v_channel, flags)
            v_state_at = conv_at + cutlass.Int64(v_channel) * conv.channel_stride
            v_at = token_offset(n64, geometry.v_stride_n, 0, 0, head) + v0 + io_col
            v_history = (
                tensors.draft_records,
                draft_offset(slot, old_bank, 0, head, DRAFT_X + 2) + v0 + io_col,
                accepted,
            )
            for r in cutlass.range_constexpr(rounds):
                io_tc = cutlass.min(_io_token(tid, chunks, n_threads, r), num_tokens - 1)
                v_conv = conv8(
                    tensors.step.v,
                    v_at,
                    geometry.v_stride_t,
                    tensors.conv_state_v,
                    v_state_at,
                    v_history,
                    *v_params,
                    io_tc,
                    conv,
                    flags,
                )
                _store8(s_v, io_tc * rows + io_col, v_conv.load().to(cutlass.BFloat16))
            if cutlass.const_expr(ctas > 1):
                # This CTA has read the old q / k conv state: its peers may overwrite it.
                cute.arch.cluster_arrive()
            cute.arch.sync_threads()
            if verify:  # this CTA's keys of the draft's raw g (its decays are computed again at commit)
                for e in cutlass.range(tid, num_tokens * rows, n_threads, unroll=1):
                    t = e // rows
                    key = v0 + e % rows
                    g_at = token_offset(n64, geometry.g_stride_n, geometry.g_stride_t, t, head) + key
                    at = draft_offset(slot, new_bank, t, head, DRAFT_G) + key
                    cute.make_tensor(tensors.draft_records + at, cute.make_layout(1))[0] = cute.make_tensor(
                        tensors.step.g + g_at, cute.make_layout(1)
                    )[0]
            if cutlass.const_expr(gate.defers_decay):
                defer_decay(s_alpha, s_khat, s_qhat, s_decay, num_tokens, tid, n_threads)
            else:
                direct_decay(s_alpha, s_khat, s_decay, num_tokens, tid, n_threads)
            cute.arch.sync_threads()

            # The state after the prologue: loaded before it, its 64 registers stayed live through
            # the convolutions and capped the CTAs per SM (240-255 registers: 4 CTAs).
            first_item(self.tile, state, s_stage, pool_head, lane_off, v_block, items, tid)
            for item in cutlass.range_constexpr(items):
                item_off = lane_off + self.tile.row_offset(item * v_block)
                if cutlass.const_expr(item > 0):
                    next_item(self.tile, state, s_stage, item_stage, pool_head, lane_off, v_block, item, items, tid)
                if accepted > 0:  # commit the pending draft's accepted tokens, then (a draft) keep them
                    row0 = v0 + item * v_block + row_local
                    updates = draft_updates(tensors.draft_records, slot, old_bank, head)
                    for d in cutlass.range(accepted, unroll=1):
                        _replay_token(self.tile, state, s_replay_khat, s_replay_alpha, updates, d, j, row0)
                    if verify:
                        _store_state(state, pool_head, self.tile, item_off, s_decay, 0, j, True)
                step = (self.tile, state, s_alpha, s_khat, s_qhat, s_kq, s_b, s_v, s_o)
                decay = _step_decay(gate, s_decay)
                if verify:  # the draft: its u recorded, the pool keeps the committed state
                    records, u0 = draft_updates(tensors.draft_records, slot, new_bank, head)
                    u_record = (records, u0 + v0, draft_token_stride() // 2)
                    for t in cutlass.range(num_tokens, unroll=1):
                        row = item * v_block + row_local
                        _token_step(*step, t, group, j, row, scalars.scale, rows, decay, u_record)
                else:
                    for t in cutlass.range(num_tokens, unroll=1):
                        row = item * v_block + row_local
                        _token_step(*step, t, group, j, row, scalars.scale, rows, decay)
                    _store_state(
                        state, pool_head, self.tile, item_off, s_decay, num_tokens - 1, j, not gate.defers_decay
                    )
            cute.arch.sync_threads()

            # The RMSNorm's weight and output-gate rows of this thread's output chunks, loaded only
            # now: live from the start they held 8 + 8·rounds registers through the token loop.
            norm_w = load8(tensors.norm_weight, v0 + io_col, (flags & LAYER_FLAG_NORM_WEIGHT_F32) != 0)
            gates_in = cute.make_rmem_tensor(cute.make_layout(8 * rounds), cutlass.Float32)
            for r in cutlass.range_constexpr(rounds):
                io_tc = cutlass.min(_io_token(tid, chunks, n_threads, r), num_tokens - 1)
                z_at = token_offset(n64, conv.out_gate_stride_n, conv.out_gate_stride_t, io_tc, head) + v0 + io_col
                z_row = bf16_row8(tensors.out_gate, z_at)
                for e in cutlass.range_constexpr(8):
                    gates_in[8 * r + e] = z_row[e]

            # ---- RMSNorm: Σ o² of this CTA's rows per token (a warp per token) ----------------
            for t in cutlass.range(warp, num_tokens, n_threads // 32, unroll=1):
                partial = cutlass.Float32(0.0)
                for m in cutlass.range_constexpr(rows // 32):
                    o = s_o[t * rows + lane + 32 * m].to(cutlass.Float32)
                    partial = partial + o * o
                for b in cutlass.range_constexpr(5):
                    partial = partial + cute.arch.shuffle_sync_bfly(partial, offset=1 << b)
                if lane == 0:
                    s_sumsq[t] = partial
            if cutlass.const_expr(ctas > 1):
                cute.arch.cluster_wait()  # every peer has read the old q / k conv state
                cute.arch.cluster_arrive()  # … and this CTA's sums are written
            self.write_conv_state(
                tensors,
                geometry,
                conv,
                n64,
                head,
                v0,
                conv_at,
                tid,
                (slot, old_bank, new_bank, accepted, verify),
                flags,
            )
            if cutlass.const_expr(ctas > 1):
                cute.arch.cluster_wait()  # every peer has read the mark
            else:
                cute.arch.sync_threads()
            if drafts and tid == 0 and vblk == 0:  # a draft pending now, or none (committed)
                cute.make_tensor(tensors.draft_marks + mark_at, cute.make_layout(1))[0] = cutlass.select_(
                    verify, draft_mark(new_bank, num_tokens), cutlass.Int32(0)
                )
            sums = cute.make_rmem_tensor(cute.make_layout(rounds), cutlass.Float32)
            for r in cutlass.range_constexpr(rounds):
                io_tc = cutlass.min(_io_token(tid, chunks, n_threads, r), num_tokens - 1)
                total = cutlass.Float32(0.0)
                for peer in cutlass.range_constexpr(ctas):
                    if cutlass.const_expr(ctas > 1):
                        remote = cute.arch.map_dsmem_ptr(s_sumsq.iterator + io_tc, peer)
                        total = total + ld_cluster_f32(remote.toint())
                    else:
                        total = total + s_sumsq[io_tc]
                sums[r] = total
            if cutlass.const_expr(ctas > 1):
                cute.arch.cluster_arrive()  # this CTA is done reading its peers' sums
            for r in cutlass.range_constexpr(rounds):
                io_t = _io_token(tid, chunks, n_threads, r)
                if io_t < num_tokens:
                    rstd = cute.math.rsqrt(sums[r] * cutlass.Float32(1.0 / D) + norm_eps)
                    y = cute.make_rmem_tensor(cute.make_layout(8), cutlass.Float32)
                    for e in cutlass.range_constexpr(8):
                        o = s_o[io_t * rows + io_col + e].to(cutlass.Float32)
                        z = gates_in[8 * r + e]
                        y[e] = o * rstd * norm_w[e] * sigmoid(z)
                    o_at = token_offset(n64, geometry.out_stride_n, geometry.out_stride_t, io_t, head) + v0 + io_col
                    cute.make_tensor(tensors.out + cute.assume(o_at, divby=8), cute.make_layout(8)).store(
                        y.load().to(cutlass.BFloat16)
                    )
            if cutlass.const_expr(ctas > 1):
                cute.arch.cluster_wait()  # peers have read this CTA's sums: its shared memory may go
        else:
            if tid == 0 and vblk == 0:
                self.report_padding(tensors, flags, slot, num_slots)
            zero_outputs(tensors.out, geometry, seq, n64, head, v0, io_col, tid, chunks, rounds, n_threads)

    @cute.jit
    def write_conv_state(self, tensors, geometry, conv, n64, head, v0, conv_at, tid, draft, flags):
        """This CTA's channels [v0, v0 + rows) of q's, k's and v's conv state.  Over E = [old taps;
        the committed draft's ``accepted`` inputs; this call's T inputs] (``conv8``), tap i becomes
        E[a + T + i], or E[a + i] for a draft (``LAYER_FLAG_VERIFY``: the committed history), whose
        raw inputs go to its record instead.  A thread reads all three new taps of a channel before
        it writes any, so the shift never reads a tap it has overwritten."""
        slot, old_bank, new_bank, accepted, verify = draft
        state_f32 = (flags & LAYER_FLAG_CONV_STATE_F32) != 0
        num_tokens = geometry.num_tokens
        first = accepted + cutlass.select_(verify, cutlass.Int32(0), num_tokens)
        streams = (
            (tensors.step.q, geometry.q_stride_n, geometry.q_stride_t, tensors.conv_state_q),
            (tensors.step.k, geometry.k_stride_n, geometry.k_stride_t, tensors.conv_state_k),
            (tensors.step.v, geometry.v_stride_n, geometry.v_stride_t, tensors.conv_state_v),
        )
        for s, (x, stride_n, stride_t, state) in enumerate(streams):
            for m in cutlass.range_constexpr(-(-self.rows // self.threads)):
                c = tid + m * self.threads
                if c < self.rows:
                    channel = head * D + v0 + c
                    state_at = conv_at + cutlass.Int64(channel) * conv.channel_stride
                    x_at = n64 * stride_n + channel
                    history_at = draft_offset(slot, old_bank, 0, head, DRAFT_X + s) + v0 + c
                    taps = cute.make_rmem_tensor(cute.make_layout(CONV_STATE_TAPS), cutlass.Float32)
                    for i in cutlass.range_constexpr(CONV_STATE_TAPS):
                        p = first + i
                        if p < CONV_STATE_TAPS:
                            taps[i] = load_value(state, state_at + cutlass.Int64(p * conv.tap_stride), state_f32)
                        else:
                            if p < CONV_STATE_TAPS + accepted:
                                record = tensors.draft_records + (
                                    history_at + cutlass.Int64(p - CONV_STATE_TAPS) * draft_token_stride()
                                )
                                taps[i] = cute.make_tensor(record, cute.make_layout(1))[0].to(cutlass.Float32)
                            else:
                                x_elem = x + (x_at + cutlass.Int64(p - CONV_STATE_TAPS - accepted) * stride_t)
                                taps[i] = cute.make_tensor(x_elem, cute.make_layout(1))[0].to(cutlass.Float32)
                    for i in cutlass.range_constexpr(CONV_STATE_TAPS):
                        store_value(state, state_at + cutlass.Int64(i * conv.tap_stride), taps[i], state_f32)
                    if verify:
                        draft_at = draft_offset(slot, new_bank, 0, head, DRAFT_X + s) + v0 + c
                        for t in cutlass.range(num_tokens, unroll=1):
                            value = cute.make_tensor(x + (x_at + cutlass.Int64(t) * stride_t), cute.make_layout(1))[0]
                            record = tensors.draft_records + (draft_at + cutlass.Int64(t) * draft_token_stride())
                            cute.make_tensor(record, cute.make_layout(1))[0] = value

    kernel = kda_decode_layer
