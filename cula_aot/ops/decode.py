"""KDA decode over a state pool: validation and one launch on the current stream (docs/CONTRACT.md §10).

Every rule is checked before the launch (and before ``out`` is allocated), so a rejected call
writes nothing; the device check is last, so every other rule is testable on the CPU.  Nothing
here reads a device tensor on the host (``state_indices`` stays on the device): the call is
sync-free and CUDA-graph capturable, and it allocates only ``out`` when it is not given.
"""

from typing import NamedTuple

import torch

from ..layout import D
from ..runtime.loader import default_loader
from ..runtime.manifest import ArtifactError
from ..specs import (
    DECODE_CHUNK_MAX_TOKENS,
    DECODE_FLAG_ACCEPTED,
    DECODE_FLAG_INTERMEDIATE,
    DECODE_FLAG_STATUS,
    DECODE_FLAG_TOKEN_SLOTS,
    DECODE_MAX_TOKENS,
    chunk_applies,
    pick_variant,
    variant_spec,
)
from .plan_cache import CheckedPlan, LaunchPlans
from .call import DecodeCall, Inputs
from . import checks
from .checks import fail

_ALIGN = 16  # bytes: every base pointer and every row the kernel reads as 16-byte vectors
_INPUT_NAMES = ("q", "k", "v", "g", "beta", "state_pool")  # what out must not alias


def _is_tensor(name, t):
    if not isinstance(t, torch.Tensor):
        fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _check_base(name, t):
    if t.data_ptr() % _ALIGN:
        fail(
            f"{name} must start on a {_ALIGN}-byte boundary (data_ptr {t.data_ptr():#x}); "
            f"pass {name}.clone() or a view of an aligned buffer"
        )


def _check_rows(name, t):
    """A [N, T, H, 128] bf16 view read as 16-byte vectors: unit stride along D, heads packed
    (stride 128), any token and sequence strides that keep rows 16-byte aligned."""
    n, tokens, heads, _ = t.shape
    if t.stride(3) != 1 or (heads > 1 and t.stride(2) != D):
        fail(
            f"{name} must have unit stride along D and head stride {D} (a token's heads packed), got "
            f"strides {list(t.stride())}; slice heads from a fused projection along its last dim "
            f"or call {name}.contiguous()"
        )
    for axis, size in ((0, n), (1, tokens)):
        if size > 1 and t.stride(axis) % 8:
            fail(
                f"{name}.stride({axis}) = {t.stride(axis)} must be a multiple of 8 elements (16-byte "
                f"aligned rows); call {name}.contiguous()"
            )
    _check_base(name, t)


def _stride(t, axis):
    """A stride the kernel multiplies by an index: 0 for a size-1 axis (never stepped)."""
    return t.stride(axis) if t.shape[axis] > 1 else 0


class _Extent(NamedTuple):
    """What the address rules read of a tensor, fixed by its layout: whether it is empty, dense,
    and how many bytes its first to past its last element span."""

    nonempty: bool
    dense: bool
    span: int


def _extent(t) -> _Extent:
    if t.numel() == 0:
        return _Extent(False, t.is_contiguous(), 0)
    span = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1
    return _Extent(True, t.is_contiguous(), span * t.element_size())


# The address rules, as the open interval (lo, hi) of offsets b − a between two tensors' first
# bytes at which the rule is broken: fixed by the tensors' extents (the signature's), so that a
# cached plan tests each pair of a call's addresses with one chained comparison.


def _overlap_bounds(a: _Extent, b: _Extent) -> tuple[int, int]:
    """Where the byte ranges of extents ``a`` and ``b`` intersect: a < b + b.span and b < a + a.span."""
    return -b.span, a.span


def _alias_bounds(a: _Extent, b: _Extent) -> tuple[int, int]:
    """Where ``a`` aliases ``b``: the same first element, or intersecting extents where one of
    them is dense (interleaved views of one fused buffer, e.g. q and g columns of a projection,
    do not alias); never for an empty one."""
    if not (a.nonempty and b.nonempty):
        return 0, 0
    return _overlap_bounds(a, b) if a.dense or b.dense else (-1, 1)


def _as_4d(name, t, num_tokens):
    """[N·T, H, 128] (or [N·T, H] for β) token-major input viewed as [N, T, ...] (no copy)."""
    if t.shape[0] % num_tokens:
        fail(f"{name} has {t.shape[0]} token rows, not a multiple of num_tokens = {num_tokens}")
    return t.unflatten(0, (t.shape[0] // num_tokens, num_tokens))


def validate(call: DecodeCall, device_check: bool = True):
    """Check every argument of ``call``; returns the (possibly [N, T]-unflattened) q, k, v, g,
    beta, out and (num_seqs, num_tokens, heads, scale).  ``device_check`` False leaves the device
    rule to a caller that checks more arguments (the fused layer), so that it stays last."""
    q, k, v, g, beta = call.inputs[:5]
    out, num_tokens = call.out, call.num_tokens
    _is_tensor("q", q)
    if q.dim() not in (3, 4):
        fail(f"q must be [N, T, H, {D}] (or token-major [N·T, H, {D}] with num_tokens), got shape {list(q.shape)}")
    if num_tokens is not None and (type(num_tokens) is not int or not 1 <= num_tokens <= DECODE_MAX_TOKENS):
        fail(f"num_tokens must be an int in [1, {DECODE_MAX_TOKENS}], got {num_tokens!r}")
    if q.dim() == 3:
        tokens = 1 if num_tokens is None else num_tokens
        q = _as_4d("q", q, tokens)
        for name, t in (("k", k), ("v", v), ("g", g), ("beta", beta)):
            _is_tensor(name, t)
        if out is not None:
            _is_tensor("out", out)
        k, v, g = (_as_4d(n, t, tokens) for n, t in (("k", k), ("v", v), ("g", g)))
        beta = _as_4d("beta", beta, tokens)
        out = None if out is None else _as_4d("out", out, tokens)
    num_seqs, tokens, heads, dim = q.shape
    checks.check_num_seqs(num_seqs, "q")
    if dim != D:
        fail(f"head dim must be {D} (cula_aot builds D = K = V = {D} only), got q.shape[-1] = {dim}")
    if num_tokens is not None and tokens != num_tokens:
        fail(f"num_tokens = {num_tokens} but q has T = {tokens} tokens per sequence (q.shape[1])")
    if not 1 <= tokens <= DECODE_MAX_TOKENS:
        fail(
            f"decode runs T = 1..{DECODE_MAX_TOKENS} tokens per sequence, got T = {tokens} "
            f"(q.shape[1]); use kda_prefill for longer chunks"
        )
    if heads == 0:
        fail(f"q must have H > 0, got shape {list(q.shape)}")
    device = q.device
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g)):
        checks.check_dtype_shape(name, t, torch.bfloat16, (num_seqs, tokens, heads, D), device)
        _check_rows(name, t)
    checks.check_dtype_shape("beta", beta, torch.bfloat16, (num_seqs, tokens, heads), device)
    if heads > 1 and beta.stride(2) != 1:
        fail(f"beta must have unit stride along H, got strides {list(beta.stride())}; call beta.contiguous()")
    gate = call.inputs.gate
    A_log, dt_bias = gate.A_log, gate.dt_bias
    checks.check_dtype_shape("A_log", A_log, torch.float32, (heads,), device)
    checks.check_dtype_shape("dt_bias", dt_bias, torch.float32, (heads, D), device)
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        if not t.is_contiguous():
            fail(f"{name} must be contiguous; call {name}.contiguous()")
        _check_base(name, t)
    _, scale = checks.check_scalars(gate.lower_bound, call.inputs.scale)
    checks.check_state_layout(call.state_layout)

    state_pool = call.state_pool
    checks.check_state("state_pool", state_pool, heads, device)
    _check_base("state_pool", state_pool)
    state_indices, num_accepted = call.state_indices, call.num_accepted
    if isinstance(state_indices, torch.Tensor) and state_indices.dim() == 2:
        checks.check_slot_indices("state_indices", state_indices, num_seqs, device, tokens)
        if call.intermediate_states is not None:
            fail(
                "intermediate_states cannot be given with [N, T] state_indices: the state after every token "
                "already goes to its slot; pass intermediate_states=None"
            )
        if num_accepted is not None:
            checks.check_contiguous("num_accepted", num_accepted, torch.int32, (num_seqs,), device)
    else:
        checks.check_slot_indices("state_indices", state_indices, num_seqs, device)
        if num_accepted is not None:
            fail(
                "num_accepted picks the slot to read among a row of [N, T] state_indices (vLLM's speculative "
                "contract); with [N] state_indices pass num_accepted=None"
            )

    intermediate_states = call.intermediate_states
    if intermediate_states is not None:
        checks.check_dtype_shape(
            "intermediate_states", intermediate_states, state_pool.dtype, (num_seqs, tokens, heads, D, D), device
        )
        if not intermediate_states.is_contiguous():
            fail("intermediate_states must be contiguous")
        _check_base("intermediate_states", intermediate_states)
        lo, hi = _overlap_bounds(_extent(intermediate_states), _extent(state_pool))
        if lo < state_pool.data_ptr() - intermediate_states.data_ptr() < hi:
            fail("intermediate_states must not overlap state_pool")
    if out is not None:
        checks.check_dtype_shape("out", out, torch.bfloat16, (num_seqs, tokens, heads, D), device)
        _check_rows("out", out)
        out_extent = _extent(out)
        for name, t in zip(_INPUT_NAMES, (q, k, v, g, beta, state_pool)):
            lo, hi = _alias_bounds(out_extent, _extent(t))
            if lo < t.data_ptr() - out.data_ptr() < hi:
                fail(f"out must not alias {name}")
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("out", out)):
        if t is not None and any(abs(s) > checks.INT32_MAX for s in t.stride()):
            fail(f"{name} strides {list(t.stride())} must fit in int32")
    checks.check_status(call.status, device)
    # Last, so every rule above is also checked (and testable) on the CPU.
    if device_check:
        checks.check_device(device)
    return q, k, v, g, beta, out, (num_seqs, tokens, heads, scale)


def run(call: DecodeCall):
    """One decode launch on ``torch.cuda.current_stream(q.device)``, from the plan of the call's
    signature (validated and built at its first call).  Returns ``out`` shaped like ``v`` as
    given (token-major 3-D input gives 3-D output)."""
    return _PLANS.get(call).run(call)


# The per-call parameters the decode kernels and the fused layer begin with: the token inputs, the
# gate parameters, the slot indices and the pool (``specs.STEP_TENSORS``).
STEP_PER_CALL = ("q", "k", "v", "g", "beta", "a_log", "dt_bias", "state_indices", "state_pool")
# The kernels' per-call parameters, in the order ``_DecodePlan.run`` supplies them.
_PER_CALL = (
    *STEP_PER_CALL,
    "intermediate",
    "out",
    "status",
    "num_accepted",
    "beta_offset",
    "index_offset",
    "scale",
    "lower_bound",
)


def geometry(num_seqs: int, tokens: int, heads: int, pool, out, inputs) -> dict:
    """The static values of ``specs.DECODE_GEOMETRY`` (the decode kernels' and the layer's): the
    sizes, the pool's slot stride, and the sequence and token strides of q, k, v, g, β
    (``inputs``) and ``out`` (those of the contiguous one each call allocates when it is None)."""
    if out is None:
        out_stride_n, out_stride_t = (tokens * heads * D if num_seqs > 1 else 0), (heads * D if tokens > 1 else 0)
    else:
        out_stride_n, out_stride_t = _stride(out, 0), _stride(out, 1)
    static = {
        "num_seqs": num_seqs,
        "num_tokens": tokens,
        "num_slots": pool.shape[0],
        "slot_stride": pool.stride(0) if pool.shape[0] > 1 else heads * D * D,
        "out_stride_n": out_stride_n,
        "out_stride_t": out_stride_t,
    }
    for name, t in zip(("q", "k", "v", "g", "beta"), inputs):
        static[f"{name}_stride_n"] = _stride(t, 0)
        static[f"{name}_stride_t"] = _stride(t, 1)
    return static


def launch_template(kernel, static: dict, smem_bytes: int, per_call: tuple, whose: str):
    """``kernel``'s launch template with ``smem_bytes`` of dynamic shared memory (what the call's
    T uses), checked to take the per-call parameters in ``per_call`` order (the order its plan's
    ``run`` supplies them)."""
    template = kernel.template(static, smem_bytes=smem_bytes)
    if template.per_call != per_call:
        raise ArtifactError(
            f"{kernel.name} takes the per-call parameters {template.per_call}, not {whose} {per_call}: "
            "a manifest built from other specs; rebuild with `python build_kernels.py`"
        )
    return template


class _DecodePlan(CheckedPlan):
    """One decode call signature's launch: validated once, the kernel variant picked and its
    template packed with the signature's static values; a call supplies its addresses, scale and
    lower_bound, and the rules that depend on them are checked again (16-byte bases, ``out`` and
    ``intermediate_states`` aliasing nothing, by the extents the signature fixes)."""

    OUT = _PER_CALL.index("out")

    def __init__(self, call: DecodeCall):
        x = call.inputs
        self.flat = isinstance(x.q, torch.Tensor) and x.q.dim() == 3
        q, k, v, g, beta, out, (num_seqs, tokens, heads, _scale) = validate(call)
        self.device = device = q.device
        state_pool, gate = call.state_pool, x.gate
        bf16_state = state_pool.dtype == torch.bfloat16
        token_slots = call.state_indices.dim() == 2
        intermediates = call.intermediate_states is not None
        variant = call.variant
        if variant is None:
            variant = pick_variant(
                num_seqs, heads, tokens, bf16_state, call.state_layout, intermediates or token_slots, gate.name
            )
        elif variant[0] == "chunk" and not chunk_applies(
            tokens, bf16_state, call.state_layout, intermediates or token_slots
        ):
            fail(
                f"variant {variant!r} (the chunk kernel) runs T = 2..{DECODE_CHUNK_MAX_TOKENS} tokens on a bf16 'vk' "
                f"pool without intermediate_states or [N, T] state_indices; got T = {tokens}, {state_pool.dtype}, "
                f"{call.state_layout!r}, intermediate_states {'given' if intermediates else 'None'}, state_indices "
                f"{list(call.state_indices.shape)}: pass variant=None"
            )
        spec = variant_spec(variant, bf16_state, call.state_layout, gate.name)
        kernel = default_loader().get(device, spec)  # a missing cubin fails here, before anything is written
        self.out_shape = (num_seqs, tokens, heads, D)
        static = geometry(num_seqs, tokens, heads, state_pool, out, (q, k, v, g, beta))
        static["flags"] = (
            (DECODE_FLAG_INTERMEDIATE if intermediates else 0)
            | (DECODE_FLAG_TOKEN_SLOTS if token_slots else 0)
            | (DECODE_FLAG_ACCEPTED if call.num_accepted is not None else 0)
            | (DECODE_FLAG_STATUS if call.status is not None else 0)
            | x.conventions
        )
        static["heads"] = heads
        self.template = launch_template(kernel, static, spec.launch_smem_bytes(tokens), _PER_CALL, "decode's")
        self.num_seqs = num_seqs
        # β and the slot indices are passed as a 16-byte aligned base and an element offset from
        # it; their element sizes are the signature's.
        self.beta_size, self.index_size = beta.element_size(), call.state_indices.element_size()
        # The address rules' bounds are the signature's; only where each tensor starts is the call's.
        self.alias_bounds = (
            None if out is None else [_alias_bounds(_extent(out), _extent(t)) for t in (q, k, v, g, beta, state_pool)]
        )
        inter = call.intermediate_states
        self.inter_bounds = None if inter is None else _overlap_bounds(_extent(inter), _extent(state_pool))

        self.checked: dict = {}  # the call's addresses and raw scalars → ``_check``'s

    def run(self, call: DecodeCall):
        return self.launch_checked(self.check(call), call.out)

    def check(self, call: DecodeCall) -> tuple:
        """The call's per-call values and parameter buffer (``launch_checked``'s), checked at the
        first call with its addresses and scalars."""
        x, state_pool, state_indices, out, _, _, inter, status, accepted, _ = call
        q, k, v, g, beta, (_, a_log, dt_bias, lower_bound), scale, _ = x
        key = (
            q.data_ptr(),
            k.data_ptr(),
            v.data_ptr(),
            g.data_ptr(),
            beta.data_ptr(),
            a_log.data_ptr(),
            dt_bias.data_ptr(),
            state_indices.data_ptr(),
            state_pool.data_ptr(),
            0 if inter is None else inter.data_ptr(),
            0 if out is None else out.data_ptr(),
            0 if status is None else status.data_ptr(),
            0 if accepted is None else accepted.data_ptr(),
            lower_bound,
            scale,
        )
        checked = self.checked.get(key)
        return self._check(call, key) if checked is None else checked

    def _check(self, call: DecodeCall, key: tuple) -> tuple:
        """The rules a call's addresses and scalars must meet; returns its per-call values and
        parameter buffer (``launch_checked``'s), kept for the next call with the same ``key``."""
        qp, kp, vp, gp, bp, ap, dp, xp, pp, ip, op, sp, np_ = key[:-2]
        lower_bound, scale = checks.check_scalars(key[-2], key[-1])
        if (qp | kp | vp | gp | ap | dp | pp | ip | op | sp) & (_ALIGN - 1):
            validate(call)  # names the misaligned argument
        if ip and self.inter_bounds[0] < pp - ip < self.inter_bounds[1]:
            fail("intermediate_states must not overlap state_pool")
        if op:
            for name, tp, (lo, hi) in zip(_INPUT_NAMES, (qp, kp, vp, gp, bp, pp), self.alias_bounds):
                if lo < tp - op < hi:
                    fail(f"out must not alias {name}")
        beta_skew, index_skew = bp & (_ALIGN - 1), xp & (_ALIGN - 1)
        values = (
            qp,
            kp,
            vp,
            gp,
            bp - beta_skew,
            ap,
            dp,
            xp - index_skew,
            pp,
            ip,
            op,
            sp,
            np_,
            beta_skew // self.beta_size,
            index_skew // self.index_size,
            scale,
            lower_bound,
        )
        return self.keep(key, values)


_PLANS = LaunchPlans(_DecodePlan)
_BF16 = torch.bfloat16


def launch(
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
    pool,
    slots,
    out,
    tokens,
    state_layout,
    inter,
    status,
    accepted,
):
    """``kda_decode`` of its arguments by position: a call whose arguments (each tensor's layout
    and address, every option) equal an earlier one's launches what that one's checks gave; any
    other is bound, planned and checked first."""
    plans = _PLANS
    try:
        if A_log is None or dt_bias is None or g.dtype is not _BF16 or beta.dtype is not _BF16:
            raise TypeError  # binding would make new tensors; past here g and β are bf16 (unkeyed dtypes)
        # Spelled out (the layout and address of each tensor, none of them read twice).
        # fmt: off
        key = (
            q.shape, q.stride(), q.dtype, q.get_device(), q.data_ptr(),
            k.shape, k.stride(), k.dtype, k.get_device(), k.data_ptr(),
            v.shape, v.stride(), v.dtype, v.get_device(), v.data_ptr(),
            g.shape, g.stride(), g.get_device(), g.data_ptr(),
            beta.shape, beta.stride(), beta.get_device(), beta.data_ptr(),
            A_log.shape, A_log.stride(), A_log.dtype, A_log.get_device(), A_log.data_ptr(),
            dt_bias.shape, dt_bias.stride(), dt_bias.dtype, dt_bias.get_device(), dt_bias.data_ptr(),
            pool.shape, pool.stride(), pool.dtype, pool.get_device(), pool.data_ptr(),
            slots.shape, slots.stride(), slots.dtype, slots.get_device(), slots.data_ptr(),
            None if out is None else (out.shape, out.stride(), out.dtype, out.get_device(), out.data_ptr()),
            None if inter is None else (inter.shape, inter.stride(), inter.dtype, inter.get_device(), inter.data_ptr()),
            None if status is None else (status.shape, status.stride(), status.dtype, status.get_device(),
                                         status.data_ptr()),
            None if accepted is None else (accepted.shape, accepted.stride(), accepted.dtype,
                                           accepted.get_device(), accepted.data_ptr()),
            # The types where binding refuses what the values equal: 1 == True, but only True passes.
            gate, lower_bound, scale, type(beta_sigmoid), beta_sigmoid, type(qk_l2norm), qk_l2norm,
            type(tokens), tokens, state_layout,
        )
        # fmt: on
        found = plans.found(key)
    except (AttributeError, TypeError, ValueError, RuntimeError):  # what the key cannot read: validation names it
        key = found = None
    if found is None:
        inputs = Inputs.bind(q, k, v, g, beta, gate, A_log, dt_bias, lower_bound, scale, beta_sigmoid, qk_l2norm)
        found = plans.check(
            DecodeCall.bind(inputs, pool, slots, out, tokens, state_layout, inter, status, accepted), key
        )
    plan, checked = found
    return plan.launch_checked(checked, out)


def decode(q, k, v, g, beta, **options):
    """``run`` of the call ``DecodeCall.build`` makes of ``kda_decode``'s arguments, and of the
    ``variant`` override: ``("chunk", warps, items)`` or (v_block, items) of a built kernel
    (default: ``specs.pick_variant``)."""
    return run(DecodeCall.build(q, k, v, g, beta, **options))
