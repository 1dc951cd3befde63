"""Public API: ``kda_prefill`` and the FlashKDA-compatible in-place ``fwd`` (docs/CONTRACT.md §6)."""

import torch

from .errors import fail
from .gates import DEFAULT_GATE
from .ops import decode, decode_layer, prefill
from .ops.call import PrefillCall
from .runtime.loader import default_loader


def kda_prefill(
    q,
    k,
    v,
    g,
    beta,
    *,
    A_log=None,
    dt_bias=None,
    lower_bound=None,
    gate=DEFAULT_GATE,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    cu_seqlens_cpu=None,
    state_layout="vk",
    intracard_cp="auto",
    out=None,
    final_state=None,
    state_indices=None,
    check_seqlens="auto",
    status=None,
    beta_sigmoid=True,
    qk_l2norm=True,
    checkpoint_every=0,
    checkpoint_pool=None,
    checkpoint_indices=None,
    checkpoint_offsets=None,
):
    """KDA chunked prefill forward on an sm_90a GPU, with AOT-compiled kernels (no JIT).

    q, k, v, g: bf16 ``[B, T, H, 128]``; beta: bf16 ``[B, T, H]`` logits.  All five may be
    token-strided views (e.g. slices of one fused projection): the trailing dims packed, rows
    16-byte aligned (beta: 16-byte aligned base), batches T rows apart.  g and beta may also be
    fp32 (a precomputed gate as vLLM passes it): they are rounded to bf16 first, one elementwise
    pass each (~6 bytes per element of g).  scale defaults to 128**-0.5.

    Input conventions (fla's ``use_beta_sigmoid_in_kernel`` / ``use_qk_l2norm_in_kernel``; runtime
    bits, no build): ``beta_sigmoid=True`` takes beta as logits (b = σ(beta)), False as the
    probabilities b themselves (in [0, 1]); ``qk_l2norm=True`` L2-normalises q and k in the kernel,
    False uses them as given (normalised by the caller: the delta rule needs ‖k‖ ≤ 1).

    ``gate`` (the per-token, per-key decay e^γ; every choice runs from the wheel):

    * "safe" (default): γ = lower_bound·σ(e^A_log·(g + dt_bias)); A_log fp32 ``[H]``, dt_bias fp32
      ``[H, 128]`` and lower_bound in [-5, 0) required.
    * "softplus" (fla's default, Kimi Linear's): γ = −e^A_log·softplus(g + dt_bias), unbounded;
      A_log None means e^A_log = 1, dt_bias None means 0; no lower_bound.
    * "precomputed": g is γ itself (the natural log-decay, ≤ 0; larger values count as 0), bf16
      or fp32; A_log, dt_bias and lower_bound must be None.

    The unbounded gates' decay per token is floored at 2^-14 (≈ 6e-5, below bf16's resolution):
    a token that decays faster keeps that much of the state it should drop.

    Varlen: ``cu_seqlens`` int32/int64 ``[N + 1]`` with B = 1.  Nothing is read back to the host
    on the serial path: with only a device ``cu_seqlens`` its values are trusted
    (``check_seqlens="auto"``, the default; "host" checks them at the cost of a sync, "off" never
    checks); pass ``cu_seqlens_cpu`` (a host copy) to have them checked for free.  The kernels
    never leave the buffers on a wrong device value: each entry is clamped into [0, T] and each
    sequence's end to at least its start (an end below its start: an empty sequence), and the
    results of a call with such a cu_seqlens are unspecified.

    States are fp32 or bf16 ``[N, H, 128, 128]``, laid out ``[N, H, V, K]`` (``state_layout="vk"``,
    default) or ``[N, H, K, V]`` (``"kv"``); the kernels carry fp32 inside.  State pools: with
    ``state_indices`` (int32 ``[N]``, device), ``initial_state`` / ``final_state`` are pools
    ``[slots, H, 128, 128]`` (slots may be padded apart) and sequence n reads and writes slot
    ``state_indices[n]`` (< 0 or ≥ slots: padding, a zero start and nothing written; -1 is the
    padding value, anything else outside the pool is reported); ``output_final_state=True`` with no
    ``final_state`` writes back into ``initial_state`` in place.  ``out`` / ``final_state`` are
    written in place when given.  Returns ``(o, final_state)``, ``final_state`` None unless
    requested (``output_final_state`` or a ``final_state`` buffer).

    ``intracard_cp``: "auto" (the planner's cost model decides from lengths, H and the SM count;
    short or many-head inputs stay serial; a device-only varlen call stays serial), False
    (serial), True (CP with the planner's split, at least 2) or an int ``s_split`` (cut each
    sequence into at most that many tile-aligned segments); CP plans on the host, so varlen CP
    needs ``cu_seqlens_cpu`` (or ``check_seqlens="host"``), whose values are then always checked.
    "truncated": each sequence cut into pieces that fill the machine, run by the fused kernel; a
    piece starts two tiles early from a zero state and goes on from there where the gates prove
    the dropped state attenuated below 2^-20, else from the exact end state of the piece before
    it (docs/DESIGN.md, Certified truncation): for few-head prompts whose heads forget within a
    few tiles; where a head keeps a long memory the pieces run one after another.  Host lengths
    as for CP, no checkpoints.

    ``status``: an optional one-element int32 tensor on the device, owned (and zeroed) by the
    caller: the kernels OR ``cula_aot.STATUS_CU_SEQLENS_MALFORMED`` (an entry outside [0, T], a
    decrease, a first entry other than 0) and ``cula_aot.STATUS_SLOT_OUT_OF_RANGE`` (a
    ``state_indices`` entry ≥ slots or below -1) into it, with no sync; read it whenever you like.

    Prefix-cache checkpoints (``checkpoint_every`` = N, a multiple of 16; 0: none): the state after
    every N-th token of each sequence is written into ``checkpoint_pool`` (fp32 or bf16
    ``[slots, H, 128, 128]`` in ``state_layout``, slots may be padded apart) at the slot
    ``checkpoint_indices[n, j]`` (int32 ``[N, M]``, device) for the j-th checkpoint of sequence n
    in this call; -1 (or any slot outside the pool, reported if not -1) skips one, and so does
    j ≥ M.  Positions count from the start of the request: with ``checkpoint_offsets`` (int32
    ``[N]``, device: the tokens of sequence n's request before this call, e.g. the tokens already
    in its cache when a chunked prefill resumes from ``initial_state``) the checkpoints of
    sequence n fall after its positions ``offset + i`` that are multiples of N, so they stay on
    the engine's cache-block boundaries across chunks; without it the offsets are 0 and the
    checkpoints fall after this call's tokens N, 2N, …  An offset must be ≥ 0 and a multiple of
    16: another writes no checkpoint for its sequence and reports
    ``cula_aot.STATUS_CHECKPOINT_MISALIGNED``.  A checkpoint at the sequence's last token is written
    too (it equals its final state).  Sync-free and capturable; nothing else changes (o, the final
    state and every other slot of the pool are untouched).  ``cula_aot.layout.checkpoint_tiles``
    lists the (tile, column) pairs a sequence writes.
    """
    return prefill.run(PrefillCall.of(locals()))


def fwd(
    q,
    k,
    v,
    g,
    beta,
    scale,
    out,
    A_log,
    dt_bias,
    lower_bound,
    initial_state=None,
    final_state=None,
    cu_seqlens=None,
    *,
    cu_seqlens_cpu=None,
    intracard_cp=False,
    state_indices=None,
    check_seqlens="auto",
    status=None,
    gate=DEFAULT_GATE,
    beta_sigmoid=True,
    qk_l2norm=True,
    checkpoint_every=0,
    checkpoint_pool=None,
    checkpoint_indices=None,
    checkpoint_offsets=None,
):
    """FlashKDA-compatible in-place forward: writes ``out`` (and ``final_state`` if given).

    States use FlashKDA's ``[N, H, V, K]`` layout (fp32 or bf16).  Serial by default, like
    FlashKDA (``intracard_cp="auto"`` opts in).  Sync-free and capturable in varlen with only a
    device ``cu_seqlens`` (see ``kda_prefill`` for ``gate``, ``check_seqlens``, ``state_indices``, ``status``,
    ``beta_sigmoid``, ``qk_l2norm`` and the ``checkpoint_*`` arguments).
    Returns None, like FlashKDA.
    """
    if out is None:
        fail("fwd writes in place: out must be a bf16 tensor shaped like v")
    prefill.run(PrefillCall.of(locals()))


def preload(device=None) -> int:
    """Load every kernel on ``device`` (default: the current CUDA device) now instead of lazily at
    first use (each serves every head count).  Returns how many."""
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    return default_loader().preload(device)


def kda_decode(
    q,
    k,
    v,
    g,
    beta,
    *,
    A_log=None,
    dt_bias=None,
    lower_bound=None,
    gate=DEFAULT_GATE,
    scale=None,
    state_pool,
    state_indices,
    out=None,
    num_tokens=None,
    state_layout="vk",
    intermediate_states=None,
    status=None,
    beta_sigmoid=True,
    qk_l2norm=True,
    num_accepted=None,
):
    """KDA decode (the recurrent step, docs/CONTRACT.md §10): T = 1..8 tokens per sequence applied to states
    in a pool, in place, with AOT-compiled kernels (no JIT, no host sync, CUDA-graph capturable).

    q, k, v, g: bf16 ``[N, T, H, 128]`` (or token-major ``[N·T, H, 128]`` with ``num_tokens`` = T);
    token-strided views are fine (unit stride along D, a token's heads packed, 16-byte aligned
    rows: e.g. slices of one fused projection), nothing is copied.  beta: bf16 ``[N, T, H]``
    logits (``[N·T, H]``), unit stride along H.  ``gate``, A_log, dt_bias, lower_bound,
    ``beta_sigmoid`` and ``qk_l2norm`` as in ``kda_prefill``; scale defaults to 128**-0.5.  ``num_tokens`` defaults to q.shape[1]
    (4-D) or 1 (3-D); when given it must match.

    state_pool: fp32 or bf16 ``[slots, H, 128, 128]``, per head ``[V, K]`` (``state_layout="vk"``,
    the default, like kda_prefill) or ``[K, V]`` (``"kv"``); contiguous within a slot, the slot
    stride may be padded (``stride(0) >= H·128·128``, a multiple of 16 bytes).  Sequence n's
    state ``state_pool[state_indices[n]]`` is read, advanced over its T tokens (fp32 inside) and
    written back in place (rounded once to the pool dtype).  state_indices: int32 ``[N]`` on the
    GPU, never read by the host.  An index < 0 (or ≥ slots) is a padding row: nothing is read
    or written for it and its outputs are zeros; ``status`` (as in ``kda_prefill``) gets
    ``STATUS_SLOT_OUT_OF_RANGE`` for an index ≥ slots or below -1.  Indices must be distinct
    within one call (two sequences updating one slot race).

    intermediate_states (optional): ``[N, T, H, 128, 128]`` contiguous, the pool's dtype and
    per-head layout; receives the state after every token (t = T−1 equals the new pool state),
    what a rejected speculative draft rolls back to.  Padding rows are left unwritten.

    Speculative decoding in vLLM's form: state_indices int32 ``[N, T]`` (rows contiguous) gives a
    slot per token: the state after token t is written to ``state_indices[n, t]`` (skipped outside
    the pool; reported unless -1) and the state read is ``state_indices[n, num_accepted[n] − 1]``
    (``num_accepted``: int32 ``[N]`` on the GPU, the tokens the last call's draft kept, clamped to
    [1, T] on the device and reported as ``STATUS_DRAFT_OUT_OF_RANGE``), or column 0 without
    ``num_accepted``.  No intermediate_states then (the slots are the intermediate states).

    out: optional bf16 like v (written in place); returns ``out`` (allocated when not given).
    Every rule is checked before anything is written (``KDAInputError`` names the argument).
    """
    return decode.launch(
        q,
        k,
        v,
        g,
        beta,
        gate,
        A_log,
        dt_bias,
        lower_bound,
        scale,
        beta_sigmoid,
        qk_l2norm,
        state_pool,
        state_indices,
        out,
        num_tokens,
        state_layout,
        intermediate_states,
        status,
        num_accepted,
    )


def kda_decode_layer(
    q,
    k,
    v,
    g,
    beta,
    *,
    conv_weight,
    conv_state,
    out_gate,
    norm_weight,
    conv_bias=None,
    conv_layout="dim",
    norm_eps=1e-5,
    A_log=None,
    dt_bias=None,
    lower_bound=None,
    gate=DEFAULT_GATE,
    scale=None,
    state_pool,
    state_indices,
    out=None,
    num_tokens=None,
    state_layout="vk",
    status=None,
    beta_sigmoid=True,
    qk_l2norm=True,
    drafts=None,
    num_accepted=None,
    verify=False,
):
    """The KDA layer's decode step in one launch, from the projections' outputs to ``o_proj``'s
    input (docs/CONTRACT.md §10): the short convolutions of q, k and v (width 4, SiLU) with their
    conv states updated in place, the gate, the KDA step of ``kda_decode`` on the pool, and the
    sigmoid-gated RMSNorm ``o = RMSNorm(o_kda)·norm_weight·σ(out_gate)`` per head, as fla's
    ``KimiDeltaAttention`` decodes (its conv output and o_kda rounded to bf16 as fla does).

    q, k, v: bf16 ``[N, T, H, 128]`` (or ``[N·T, H, 128]`` with ``num_tokens``) *before* their
    convolution; g, beta and every option shared with ``kda_decode`` as there (T = 1..8; the
    state pool and ``state_indices`` address the recurrent state; padding rows get zeros and
    touch nothing).  out_gate: bf16 like q (the output gate's input, before σ); norm_weight:
    bf16 or fp32 ``[128]``; norm_eps in (0, 1).

    conv_weight: ``[3·H·128, 4]`` with q's, k's then v's channels (or ``[3·H·128, 1, 4]`` as
    ``nn.Conv1d`` holds it), or a (q, k, v) tuple of ``[H·128, 4]``; bf16 or fp32, contiguous.
    conv_bias: None, ``[3·H·128]`` or a tuple, the weights' dtype.  conv_state: the conv-state
    pool, one slot per state-pool slot, addressed by the same ``state_indices``: ``[slots,
    3·H·128, 3]`` (``conv_layout="dim"``) or ``[slots, 3, 3·H·128]`` (``"token"``), or a (q, k, v)
    tuple of ``[slots, H·128, 3]`` / ``[slots, 3, H·128]``; bf16 or fp32, any strides (the three
    must share them): fla's ``[N, C, 4]`` cache is ``cache[..., 1:]``.  It holds the last three
    inputs, oldest first, and is advanced in place.

    Speculative decoding (``cula_aot.drafts``): ``drafts = cula_aot.draft_buffers(slots, H,
    device)`` beside the pool and ``num_accepted`` int32 ``[N]`` on the device.  A call first
    commits each slot's pending draft, if any: its first ``num_accepted[n]`` tokens (clamped to
    [0, the draft's T]; ``status`` reports one outside) are applied to the recurrent and conv
    states.  With
    ``verify=True`` the call's T tokens are a draft: their outputs are written, the pool keeps
    the committed state, and a compact record per token is kept for the next call to commit;
    with ``verify=False`` they are committed like any decode step.  So a serving step stays one
    launch and the pool one state per request.  Zero ``drafts.marks[slot]`` when a slot is given
    to a new request; commit a pending draft (any call on the slot) before another kernel reads
    the slot's state, with the layer parameters it was drafted with (conv weights and bias,
    ``A_log``, ``dt_bias``, ``lower_bound``, gate and conventions): the commit recomputes the
    draft's keys and decays from its recorded inputs.

    Returns ``out`` (bf16 like q; allocated when not given).  Every rule is checked before
    anything is written (``KDAInputError`` names the argument)."""
    conv = (conv_weight, conv_bias, conv_state, conv_layout)
    norm = (out_gate, norm_weight, norm_eps)
    speculation = (drafts, num_accepted, verify)
    return decode_layer.launch(
        q,
        k,
        v,
        g,
        beta,
        gate,
        A_log,
        dt_bias,
        lower_bound,
        scale,
        beta_sigmoid,
        qk_l2norm,
        state_pool,
        state_indices,
        out,
        num_tokens,
        state_layout,
        status,
        conv,
        norm,
        speculation,
    )
