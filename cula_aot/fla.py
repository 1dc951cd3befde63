"""flash-linear-attention's KDA calling convention on cula_aot's kernels (inference forward).

* ``chunk_kda`` and ``fused_recurrent_kda`` take fla 0.6.0's forward arguments under their names
  and return what fla returns, ``(o, final_state)`` (None unless ``output_final_state``).
  ``fused_recurrent_kda`` serves any T (it runs the chunked prefill: the same recurrence).
* ``unsupported(...)``: why a call is outside what the kernels run (None when they run it):
  they take bf16 q, k, v with K = V = 128 and as many value heads as key heads (no GVA), and no
  ``allow_neg_eigval``.  ``use_qk_l2norm_in_kernel`` and ``use_beta_sigmoid_in_kernel`` are the
  kernels' ``qk_l2norm`` and ``beta_sigmoid``.  The gate: ``use_gate_in_kernel`` with
  ``safe_gate`` (or, for the recurrent entry, a ``lower_bound``) is cula_aot's ``gate="safe"``,
  without it ``gate="softplus"``; ``use_gate_in_kernel=False`` is ``gate="precomputed"`` (g the
  log-decay).  g and β may be fp32 (as fla's callers pass a precomputed gate): ``kda_prefill``
  rounds them to bf16 first, one elementwise pass each.
* vLLM's speculative contract on the recurrent entry (``ssm_state_indices`` ``[N, T]``, a slot
  per token, and ``num_accepted_tokens``, ``inplace_final_state=True``) runs ``kda_decode``'s
  per-token slots when the N sequences hold T ≤ 8 tokens each (N·T tokens in all, which with
  T index columns per row leaves no sequence shorter) and g, β are bf16.
* ``register_backend()``: adds cula_aot to fla's backend registry (``fla.backends``) for
  ``fla.ops.kda.chunk_kda`` and for the ``kda`` operation's ``fused_recurrent_kda_fwd``, so that
  fla's entry points and its ``KimiDeltaAttention`` layer run here under ``torch.inference_mode()``
  (or ``no_grad``) and fall back to fla, which logs the reason, for anything ``unsupported`` or
  with gradients on.  ``FLA_CULA_AOT=0`` switches it off; priority 2 (fla tries lower first:
  FlashKDA's is 3).

* ``fuse_decode_layers(model)``: every ``KimiDeltaAttention`` layer of ``model`` runs its decode
  steps (1..8 tokens per sequence on its state cache, inference) as one ``kda_decode_layer``
  launch from the projections' outputs: the conv caches, the recurrent state and the gated
  norm as fla's own decode path computes them; any other call goes to fla's forward.

fla is imported only by ``register_backend`` and ``fuse_decode_layers``; the rest needs torch alone.
"""

import inspect

import torch

from .api import kda_decode, kda_decode_layer, kda_prefill
from .constants import device_constant
from .errors import KDAInputError
from .gates import fla_gate, fla_gate_problem
from .specs import DECODE_MAX_TOKENS

__all__ = ["chunk_kda", "fuse_decode_layers", "fused_recurrent_kda", "register_backend", "unsupported"]

BACKEND_ENV_VAR = "FLA_CULA_AOT"
BACKEND_PRIORITY = 2


def unsupported(
    q,
    k,
    v,
    g,
    beta,
    *,
    use_qk_l2norm_in_kernel=False,
    use_beta_sigmoid_in_kernel=False,
    allow_neg_eigval=False,
    use_gate_in_kernel=False,
    return_intermediate_states=False,
    cp_context=None,
    num_accepted_tokens=None,
    ssm_state_indices=None,
    inplace_final_state=False,
    cu_seqlens=None,
    **_,
):
    """The reason cula_aot's kernels cannot run this fla call, or None."""
    tensors = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            return f"{name} is not a tensor"
        if t.dtype not in ((torch.bfloat16, torch.float32) if name in ("g", "beta") else (torch.bfloat16,)):
            return f"{name} is {t.dtype}; cula_aot runs bf16 q, k, v and bf16 or fp32 g, beta"
    if q.dim() != 4 or q.shape[-1] != 128 or v.shape[-1] != 128:
        return f"cula_aot runs K = V = 128 on [B, T, H, D] inputs, got q {list(q.shape)}, v {list(v.shape)}"
    if v.shape[2] != q.shape[2]:
        return f"cula_aot has no GVA (value heads {v.shape[2]} != key heads {q.shape[2]})"
    if beta.dim() != 3:
        return "cula_aot takes one β per (token, head), not a head-wise vector"
    if allow_neg_eigval:
        return "cula_aot has no allow_neg_eigval (β in (0, 2))"
    if return_intermediate_states:
        return "cula_aot returns no intermediate chunk states"
    if cp_context is not None:
        return "fla's cross-GPU context parallelism is not cula_aot's"
    if num_accepted_tokens is not None or (ssm_state_indices is not None and ssm_state_indices.dim() != 1):
        return _token_slots_problem(q, g, beta, ssm_state_indices, inplace_final_state, cu_seqlens)
    return None


def _token_slots_problem(q, g, beta, ssm_state_indices, inplace_final_state, cu_seqlens):
    """Why a call with per-token state indices (vLLM's speculative decoding) is not
    ``kda_decode``'s per-token slots, or None."""
    if not isinstance(ssm_state_indices, torch.Tensor) or ssm_state_indices.dim() != 2:
        return "num_accepted_tokens needs ssm_state_indices [N, T] (a state slot per token)"
    n, tokens = ssm_state_indices.shape
    if not 1 <= tokens <= DECODE_MAX_TOKENS:
        return f"per-token state indices run T = 1..{DECODE_MAX_TOKENS} tokens per sequence, got {tokens} columns"
    if not inplace_final_state:
        return "per-token state indices write the pool in place: pass inplace_final_state=True"
    if g.dtype != torch.bfloat16 or beta.dtype != torch.bfloat16:
        return f"per-token state indices run bf16 g and β (kda_decode), got {g.dtype} and {beta.dtype}"
    batch, total = q.shape[:2]
    sequences = batch if cu_seqlens is None else cu_seqlens.numel() - 1
    if sequences != n or batch * total != n * tokens:
        return (
            f"per-token state indices [{n}, {tokens}] need {n} sequences of {tokens} tokens "
            f"(q {list(q.shape)}, {'no cu_seqlens' if cu_seqlens is None else f'{sequences} sequences'})"
        )
    return None


def _kda_options(fla_args: dict, safe_gate: bool) -> dict:
    """``kda_prefill``'s options for an fla entry's arguments (``fla_args``, by fla's names): the call
    refused first when ``unsupported``; the gate (``gates.fla_gate``), the input conventions, the
    state layout, scale and cu_seqlens."""
    reason = unsupported(**fla_args)
    if reason is not None:
        raise KDAInputError(reason)
    q = fla_args["q"]
    gate = fla_gate(
        fla_args["use_gate_in_kernel"],
        safe_gate,
        fla_args["lower_bound"],
        fla_args["A_log"],
        fla_args["dt_bias"],
        q.shape[2],
        q.device,
    )
    return {
        **gate,
        "qk_l2norm": bool(fla_args["use_qk_l2norm_in_kernel"]),
        "beta_sigmoid": bool(fla_args["use_beta_sigmoid_in_kernel"]),
        "state_layout": "vk" if fla_args["state_v_first"] else "kv",
        "scale": fla_args["scale"],
        "cu_seqlens": fla_args["cu_seqlens"],
    }


def chunk_kda(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    use_gate_in_kernel=False,
    use_beta_sigmoid_in_kernel=False,
    allow_neg_eigval=False,
    safe_gate=False,
    lower_bound=None,
    disable_recompute=False,
    return_intermediate_states=False,
    state_v_first=False,
    cu_seqlens=None,
    cu_seqlens_cpu=None,
    cp_context=None,
    use_graph=False,
    max_num_seqs=None,
    *,
    A_log=None,
    dt_bias=None,
    **kwargs,
):
    """fla's ``chunk_kda`` forward on cula_aot's kernels: ``(o, final_state)``.  States are
    ``[N, H, K, V]`` (fla's default) or ``[N, H, V, K]`` with ``state_v_first``, fp32 or bf16;
    ``disable_recompute``, ``use_graph`` and ``max_num_seqs`` (fla's own execution options) are
    accepted and have nothing to change here.  Raises ``KDAInputError`` for what is ``unsupported``."""
    options = _kda_options(locals(), safe_gate)
    return kda_prefill(
        q,
        k,
        v,
        g,
        beta,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens_cpu=cu_seqlens_cpu,
        **options,
    )


def fused_recurrent_kda(
    q,
    k,
    v,
    g,
    beta,
    A_log=None,
    dt_bias=None,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    use_gate_in_kernel=False,
    use_beta_sigmoid_in_kernel=False,
    allow_neg_eigval=False,
    lower_bound=None,
    state_v_first=False,
    cu_seqlens=None,
    **kwargs,
):
    """fla's ``fused_recurrent_kda`` forward (a ``lower_bound`` selects the safe gate, as there) on
    cula_aot's kernels, for any T: ``(o, final_state)``."""
    return _recurrent(
        q,
        k,
        v,
        g,
        beta,
        A_log=A_log,
        dt_bias=dt_bias,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        inplace_final_state=False,
        state_v_first=state_v_first,
        cu_seqlens=cu_seqlens,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval,
        lower_bound=lower_bound,
        **kwargs,
    )


def _recurrent(
    q,
    k,
    v,
    g,
    beta,
    A_log=None,
    dt_bias=None,
    initial_state=None,
    scale=None,
    output_final_state=False,
    inplace_final_state=True,
    state_v_first=False,
    cu_seqlens=None,
    ssm_state_indices=None,
    num_accepted_tokens=None,
    use_qk_l2norm_in_kernel=False,
    use_gate_in_kernel=False,
    use_beta_sigmoid_in_kernel=False,
    allow_neg_eigval=False,
    lower_bound=None,
    out=None,
    **kwargs,
):
    """fla's ``fused_recurrent_kda_fwd`` (argument order and defaults as there): in place into
    ``initial_state`` (slot ``ssm_state_indices[n]`` for sequence n, when given) or into a new
    fp32 final state; ``out`` written when given."""
    options = _kda_options(locals(), lower_bound is not None)
    if ssm_state_indices is not None and ssm_state_indices.dim() == 2:
        return _token_slots(q, k, v, g, beta, initial_state, ssm_state_indices, num_accepted_tokens, out, options)
    options.update(out=out, intracard_cp=False)
    if inplace_final_state:
        if initial_state is None:
            raise KDAInputError("inplace_final_state=True needs an initial_state to update")
        slots = ssm_state_indices
        if slots is None:
            slots = _identity_slots(q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1, q.device)
        o, _ = kda_prefill(
            q,
            k,
            v,
            g,
            beta,
            initial_state=initial_state,
            final_state=initial_state,
            state_indices=_slot_table(slots),
            **options,
        )
        return o, initial_state
    return kda_prefill(q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state, **options)


def _token_slots(q, k, v, g, beta, pool, slots, num_accepted, out, options):
    """fla's per-token state indices as ``kda_decode``'s per-token slots (``_token_slots_problem``
    has checked the shapes): varlen inputs viewed ``[N, T, ...]``; returns fla's ``(o, pool)``."""
    n, tokens = slots.shape
    varlen = options.pop("cu_seqlens") is not None

    def per_sequence(x):
        return x[0].unflatten(0, (n, tokens)) if varlen and x is not None else x

    o = kda_decode(
        *(per_sequence(x) for x in (q, k, v, g, beta)),
        **options,
        state_pool=pool,
        state_indices=_slot_table(slots),
        num_accepted=None if num_accepted is None else _slot_table(num_accepted),
        out=per_sequence(out),
    )
    if out is not None:
        return out, pool
    return (o.view(1, n * tokens, *o.shape[2:]) if varlen else o), pool


def _slot_table(t: torch.Tensor) -> torch.Tensor:
    """An index tensor as the kernels read it: int32 and contiguous.  vLLM passes slices of its
    block table outside full CUDA graphs (``block_table[:, 0]``, ``block_table[:, :T]``), whose
    rows are the table's width apart: those are copied (N·T integers, one small kernel)."""
    return t.to(torch.int32).contiguous()


def _identity_slots(n: int, device):
    """Slot n for sequence n: fla's in-place states as a pool."""
    return device_constant(("identity_slots", n), device, lambda: torch.arange(n, dtype=torch.int32, device=device))


def _verdict(kwargs) -> tuple:
    """A backend verifier's (accepted, reason) for a call's bound arguments."""
    if torch.is_grad_enabled():
        return False, "cula_aot runs the forward only: call under torch.inference_mode() or torch.no_grad()"
    q = kwargs["q"]
    if not (isinstance(q, torch.Tensor) and q.is_cuda and torch.cuda.get_device_capability(q.device) == (9, 0)):
        return False, "cula_aot runs on sm_90 (Hopper) GPUs"
    reason = unsupported(**kwargs)
    return reason is None, reason


def _bind(function, args, kwargs) -> dict:
    """A call's arguments by name, defaults filled in, as ``function`` would receive them."""
    bound = inspect.signature(function).bind(*args, **kwargs)
    bound.apply_defaults()
    values = dict(bound.arguments)
    values.update(values.pop("kwargs", {}))
    return values


def register_backend() -> None:
    """Register cula_aot with fla's backend registry (needs flash-linear-attention ≥ 0.6.0)."""
    from fla.backends import BaseBackend, register
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    class CulaAotBackend(BaseBackend):
        backend_type = "cula_aot"
        package_name = "cula_aot"
        env_var = BACKEND_ENV_VAR
        default_enable = True
        priority = BACKEND_PRIORITY

    class CulaAotChunkBackend(CulaAotBackend):
        """cula_aot's AOT Hopper kernels for fla's chunk_kda (inference only)."""

        def chunk_kda_verifier(self, *args, **kwargs):
            values = _bind(chunk_kda, args, kwargs)
            problem = fla_gate_problem(values["use_gate_in_kernel"], values["safe_gate"], values["lower_bound"])
            if problem:
                return False, problem
            return _verdict(values)

        def chunk_kda(self, *args, **kwargs):
            return chunk_kda(*args, **kwargs)

    class CulaAotRecurrentBackend(CulaAotBackend):
        """cula_aot's kernels for fla's fused_recurrent_kda_fwd (any T; inference only)."""

        def fused_recurrent_kda_fwd_verifier(self, *args, **kwargs):
            return _verdict(_bind(_recurrent, args, kwargs))

        def fused_recurrent_kda_fwd(self, *args, **kwargs):
            return _recurrent(*args, **kwargs)

    register(fla_chunk_kda)(CulaAotChunkBackend)
    register("kda")(CulaAotRecurrentBackend)


def fuse_decode_layers(model) -> int:
    """Route the decode steps of every fla ``KimiDeltaAttention`` in ``model`` (a layer or any
    module holding some) through ``kda_decode_layer``; returns how many layers were hooked.  A step
    is fused when it runs without gradients on a Hopper GPU with the layer's cache in place (its
    ``[B, C, 4]`` conv caches, of which the kernel keeps the last three taps, fla's only live
    ones, and its ``[B, H, V, K]`` recurrent state, both updated in place), 1..8 tokens per
    sequence, no ``cu_seqlens`` and every sequence's new tokens valid under ``attention_mask``
    (a host read of its last columns, as fla's own unpadding makes), a short convolution of
    width 4 and one value head per key head of 128; otherwise fla's forward runs."""
    from fla.layers.kda import KimiDeltaAttention

    hooked = 0
    for layer in model.modules() if hasattr(model, "modules") else [model]:
        if isinstance(layer, KimiDeltaAttention) and not getattr(layer, "_cula_aot_decode", False):
            layer.forward = _fused_decode_forward(layer, layer.forward)
            layer._cula_aot_decode = True
            hooked += 1
    return hooked


def _fused_decode_forward(layer, fla_forward):
    def forward(hidden_states, attention_mask=None, past_key_values=None, use_cache=False, **kwargs):
        o = _fused_decode(layer, hidden_states, attention_mask, past_key_values, use_cache, kwargs)
        if o is None:
            return fla_forward(
                hidden_states,
                attention_mask=attention_mask,
                past_key_values=past_key_values,
                use_cache=use_cache,
                **kwargs,
            )
        return o, None, past_key_values

    return forward


def _fused_decode(layer, hidden_states, attention_mask, past_key_values, use_cache, kwargs):
    """The layer's output for a decode step it can fuse (``fuse_decode_layers``), else None."""
    from fla.layers.utils import get_layer_cache, update_layer_cache

    if torch.is_grad_enabled() or layer.training or not use_cache or kwargs.get("cu_seqlens") is not None:
        return None
    batch, tokens, _ = hidden_states.shape
    heads, dim = layer.num_heads, layer.head_dim
    shape_ok = (
        layer.use_short_conv
        and layer.conv_size == 4
        and layer.num_v_heads == heads
        and dim == layer.head_v_dim == 128
        and not layer.allow_neg_eigval
        and layer.o_norm.activation == "sigmoid"
        and layer.o_norm.weight is not None
    )
    if not (shape_ok and 1 <= tokens <= 8 and hidden_states.is_cuda and hidden_states.dtype == torch.bfloat16):
        return None
    if torch.cuda.get_device_capability(hidden_states.device) != (9, 0):
        return None
    last = get_layer_cache(layer, past_key_values)
    if last is None or last.get("recurrent_state") is None or last.get("conv_state") is None:
        return None
    if attention_mask is not None and not bool(attention_mask[:, -tokens:].all()):
        return None
    state, caches = last["recurrent_state"], last["conv_state"]
    gate = fla_gate(True, layer.safe_gate, layer.lower_bound, layer.A_log, layer.dt_bias, heads, hidden_states.device)

    def heads_of(x):
        return x.unflatten(-1, (heads, dim))

    convs = (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d)
    o = kda_decode_layer(
        heads_of(layer.q_proj(hidden_states)),
        heads_of(layer.k_proj(hidden_states)),
        heads_of(layer.v_proj(hidden_states)),
        heads_of(layer.f_proj(hidden_states)),
        layer.b_proj(hidden_states),
        conv_weight=tuple(c.weight for c in convs),
        conv_bias=tuple(c.bias for c in convs) if layer.conv_bias else None,
        conv_state=tuple(cache[..., 1:] for cache in caches),
        out_gate=heads_of(layer.g_proj(hidden_states)),
        norm_weight=layer.o_norm.weight,
        norm_eps=layer.o_norm.eps,
        state_pool=state,
        state_indices=_identity_slots(batch, hidden_states.device),
        **gate,
    )
    update_layer_cache(layer, past_key_values, recurrent_state=state, conv_state=caches, offset=tokens)
    return layer.o_proj(o.flatten(-2))
