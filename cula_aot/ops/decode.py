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
from ..specs import (
    DECODE_CHUNK_MAX_TOKENS,
    DECODE_FLAG_INTERMEDIATE,
    DECODE_FLAG_STATUS,
    DECODE_MAX_TOKENS,
    chunk_applies,
    pick_variant,
    variant_spec,
)
from .call import DecodeCall
from . import checks
from .checks import fail

_ALIGN = 16  # bytes: every base pointer and every row the kernel reads as 16-byte vectors


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


def _overlaps_at(a: int, a_extent: _Extent, b: int, b_extent: _Extent) -> bool:
    """Whether the byte ranges starting at addresses ``a`` and ``b`` intersect."""
    return a < b + b_extent.span and b < a + a_extent.span


def _aliases_at(a: int, a_extent: _Extent, b: int, b_extent: _Extent) -> bool:
    """Same first element, or intersecting extents where one of them is dense (interleaved
    views of one fused buffer, e.g. q and g columns of a projection, do not alias)."""
    if not (a_extent.nonempty and b_extent.nonempty):
        return False
    return a == b or ((a_extent.dense or b_extent.dense) and _overlaps_at(a, a_extent, b, b_extent))


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
    checks.check_slot_indices("state_indices", call.state_indices, num_seqs, device)

    intermediate_states = call.intermediate_states
    if intermediate_states is not None:
        checks.check_dtype_shape(
            "intermediate_states", intermediate_states, state_pool.dtype, (num_seqs, tokens, heads, D, D), device
        )
        if not intermediate_states.is_contiguous():
            fail("intermediate_states must be contiguous")
        _check_base("intermediate_states", intermediate_states)
        if _overlaps_at(
            intermediate_states.data_ptr(), _extent(intermediate_states), state_pool.data_ptr(), _extent(state_pool)
        ):
            fail("intermediate_states must not overlap state_pool")
    if out is not None:
        checks.check_dtype_shape("out", out, torch.bfloat16, (num_seqs, tokens, heads, D), device)
        _check_rows("out", out)
        for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("state_pool", state_pool)):
            if _aliases_at(out.data_ptr(), _extent(out), t.data_ptr(), _extent(t)):
                fail(f"out must not alias {name}")
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("out", out)):
        if t is not None and any(abs(s) > checks.INT32_MAX for s in t.stride()):
            fail(f"{name} strides {list(t.stride())} must fit in int32")
    checks.check_status(call.status, device)
    # Last, so every rule above is also checked (and testable) on the CPU.
    if device_check:
        checks.check_device(device)
    return q, k, v, g, beta, out, (num_seqs, tokens, heads, scale)


def _aligned_down(t) -> tuple[int, int]:
    """(16-byte aligned address at or below t's first element, element offset from it)."""
    ptr = t.data_ptr()
    base = ptr - ptr % _ALIGN
    return base, (ptr - base) // t.element_size()


_PLANS: dict = {}  # DecodeCall.signature() → _DecodePlan
_PLAN_LIMIT = 256  # plans kept; cleared when full (a serving loop reuses a few)


def run(call: DecodeCall):
    """One decode launch on ``torch.cuda.current_stream(q.device)``, from the plan of the call's
    signature (validated and built at its first call).  Returns ``out`` shaped like ``v`` as
    given (token-major 3-D input gives 3-D output)."""
    try:
        key = call.signature()
        plan = _PLANS.get(key)
    except (AttributeError, TypeError):  # not tensors, or unhashable options: validation names it
        key = plan = None
    if plan is None:
        plan = _DecodePlan(call)
        if key is not None:
            if len(_PLANS) >= _PLAN_LIMIT:
                _PLANS.clear()
            _PLANS[key] = plan
    return plan.run(call)


class _DecodePlan:
    """One decode call signature's launch: validated once, the kernel variant picked and its
    template packed with the signature's static values; a call supplies its addresses, scale and
    lower_bound, and the rules that depend on them are checked again (16-byte bases, ``out`` and
    ``intermediate_states`` aliasing nothing, by the extents the signature fixes)."""

    def __init__(self, call: DecodeCall):
        x = call.inputs
        self.flat = isinstance(x.q, torch.Tensor) and x.q.dim() == 3
        q, k, v, g, beta, out, (num_seqs, tokens, heads, _scale) = validate(call)
        self.device = device = q.device
        state_pool, gate = call.state_pool, x.gate
        bf16_state = state_pool.dtype == torch.bfloat16
        intermediates = call.intermediate_states is not None
        variant = call.variant
        if variant is None:
            variant = pick_variant(num_seqs, heads, tokens, bf16_state, call.state_layout, intermediates, gate.name)
        elif variant[0] == "chunk" and not chunk_applies(tokens, bf16_state, call.state_layout, intermediates):
            fail(
                f"variant {variant!r} (the chunk kernel) runs T = 2..{DECODE_CHUNK_MAX_TOKENS} tokens on a bf16 'vk' "
                f"pool without intermediate_states; got T = {tokens}, {state_pool.dtype}, {call.state_layout!r}, "
                f"intermediate_states {'given' if intermediates else 'None'}: pass variant=None"
            )
        spec = variant_spec(variant, bf16_state, call.state_layout, gate.name)
        kernel = default_loader().get(device, spec)  # a missing cubin fails here, before anything is written
        self.out_shape = (num_seqs, tokens, heads, D)
        if out is None:  # each call allocates a contiguous one
            out_stride_n, out_stride_t = (tokens * heads * D if num_seqs > 1 else 0), (heads * D if tokens > 1 else 0)
        else:
            out_stride_n, out_stride_t = _stride(out, 0), _stride(out, 1)
        static = {
            "num_seqs": num_seqs,
            "num_tokens": tokens,
            "num_slots": state_pool.shape[0],
            "slot_stride": state_pool.stride(0) if state_pool.shape[0] > 1 else heads * D * D,
            "out_stride_n": out_stride_n,
            "out_stride_t": out_stride_t,
            "flags": (DECODE_FLAG_INTERMEDIATE if intermediates else 0)
            | (DECODE_FLAG_STATUS if call.status is not None else 0)
            | x.conventions,
            "heads": heads,
        }
        for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
            static[f"{name}_stride_n"] = _stride(t, 0)
            static[f"{name}_stride_t"] = _stride(t, 1)
        self.template = kernel.template(static, smem_bytes=spec.launch_smem_bytes(tokens))
        self.num_seqs = num_seqs
        # The address rules (``_aliases_at``, ``_overlaps_at``) read each tensor's extent, which
        # the signature fixes; only where it starts is the call's.
        self.out_extent = None if out is None else _extent(out)
        self.input_extents = [
            (name, _extent(t))
            for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("state_pool", state_pool))
        ]
        inter = call.intermediate_states
        self.inter_extents = None if inter is None else (_extent(inter), _extent(state_pool))

    def run(self, call: DecodeCall):
        x, state_pool, out, inter, status = (
            call.inputs,
            call.state_pool,
            call.out,
            call.intermediate_states,
            call.status,
        )
        lower_bound, scale = checks.check_scalars(x.gate.lower_bound, x.scale)
        qp, kp, vp, gp, ap, dp = (
            x.q.data_ptr(),
            x.k.data_ptr(),
            x.v.data_ptr(),
            x.g.data_ptr(),
            x.gate.A_log.data_ptr(),
            x.gate.dt_bias.data_ptr(),
        )
        pp = state_pool.data_ptr()
        ip = 0 if inter is None else inter.data_ptr()
        op = 0 if out is None else out.data_ptr()
        sp = 0 if status is None else status.data_ptr()
        if (qp | kp | vp | gp | ap | dp | pp | ip | op | sp) & (_ALIGN - 1):
            validate(call)  # names the misaligned argument
        if self.inter_extents is not None and _overlaps_at(ip, self.inter_extents[0], pp, self.inter_extents[1]):
            fail("intermediate_states must not overlap state_pool")
        if self.out_extent is not None:
            for (name, extent), tp in zip(self.input_extents, (qp, kp, vp, gp, x.beta.data_ptr(), pp)):
                if _aliases_at(op, self.out_extent, tp, extent):
                    fail(f"out must not alias {name}")
        if out is None:
            out = torch.empty(self.out_shape, dtype=torch.bfloat16, device=self.device)
            op = out.data_ptr()
        result = out.flatten(0, 1) if self.flat else out
        if self.num_seqs == 0:
            return result
        beta_base, beta_offset = _aligned_down(x.beta)
        index_base, index_offset = _aligned_down(call.state_indices)
        values = {
            "q": qp,
            "k": kp,
            "v": vp,
            "g": gp,
            "beta": beta_base,
            "a_log": ap,
            "dt_bias": dp,
            "state_indices": index_base,
            "state_pool": pp,
            "intermediate": ip,
            "out": op,
            "status": sp,
            "beta_offset": beta_offset,
            "index_offset": index_offset,
            "scale": scale,
            "lower_bound": lower_bound,
        }
        self.template.launch(values, _current_stream(self.device))
        return result


def _current_stream(device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def decode(q, k, v, g, beta, **options):
    """``run`` of the call ``DecodeCall.build`` makes of ``kda_decode``'s arguments, and of the
    ``variant`` override: ``("chunk", warps, items)`` or (v_block, items) of a built kernel
    (default: ``specs.pick_variant``)."""
    return run(DecodeCall.build(q, k, v, g, beta, **options))
