"""The fused decode layer (``cula_aot.kda_decode_layer``): validation and one launch of
``kernels/decode_layer.py`` on the current stream.

The KDA step's arguments are checked by decode's own rules (``decode.validate``); this adds the
convolutions' weights, biases and states and the output norm's.  As in decode, every rule is
checked before anything is written, nothing reads a device tensor on the host, and a plan per
call signature keeps the launch template; a call re-checks only what depends on its addresses.
"""

from typing import NamedTuple

import torch

from ..layout import D
from ..runtime.loader import default_loader, raw_stream
from ..specs import (
    CONV_WIDTH,
    LAYER_FLAG_CONV_BIAS,
    LAYER_FLAG_CONV_STATE_F32,
    LAYER_FLAG_CONV_WEIGHT_F32,
    LAYER_FLAG_DRAFTS,
    LAYER_FLAG_NORM_WEIGHT_F32,
    LAYER_FLAG_STATUS,
    LAYER_FLAG_VERIFY,
    DecodeLayerSpec,
    pick_layer_variant,
)
from ..drafts import Drafts, draft_shape
from .call import DecodeLayerCall, _parts
from . import checks, decode
from .checks import fail
from .decode import _ALIGN, _alias_bounds, _as_4d, _check_base, _check_rows, _extent, _stride

CONV_LAYOUTS = ("dim", "token")
_PARAM_DTYPES = (torch.bfloat16, torch.float32)
_STREAMS = ("q", "k", "v")


class ConvViews(NamedTuple):
    """The convolutions as the kernel reads them: per stream (q, k, v) a weight ``[C, W]``, a
    bias ``[C]`` or None, and a conv state viewed as ``[slots, C, W − 1]`` (any strides)."""

    weights: tuple
    biases: tuple | None
    states: tuple


def _split(name: str, x, channels: int, axis: int) -> tuple:
    """A (q, k, v) tuple as given, or one packed tensor cut into its three channel ranges along
    ``axis`` (``3·channels`` long there)."""
    parts = _parts(x)
    if len(parts) == 3:
        return parts
    if len(parts) != 1:
        fail(f"{name} must be one packed tensor (q, k, v channels) or a (q, k, v) tuple, got {len(parts)} tensors")
    t = parts[0]
    if not isinstance(t, torch.Tensor):
        fail(f"{name} must be a torch.Tensor or a (q, k, v) tuple, got {type(t).__name__}")
    if t.dim() <= axis or t.shape[axis] != 3 * channels:
        fail(
            f"{name} packed must have 3·H·{D} = {3 * channels} channels along dim {axis} (q, k, v), "
            f"got shape {list(t.shape)}; or pass a (q, k, v) tuple"
        )
    return tuple(t.narrow(axis, i * channels, channels) for i in range(3))


def conv_views(call: DecodeLayerCall, heads: int, slots: int, device) -> ConvViews:
    """Check the convolutions' arguments and return the views the kernel reads."""
    conv = call.conv
    channels = heads * D
    if conv.layout not in CONV_LAYOUTS:
        fail(f"conv_layout must be one of {CONV_LAYOUTS}, got {conv.layout!r}")
    weights = []
    for stream, w in zip(_STREAMS, _split("conv_weight", conv.weight, channels, 0)):
        name = f"conv_weight ({stream})"
        if not isinstance(w, torch.Tensor):
            fail(f"{name} must be a torch.Tensor, got {type(w).__name__}")
        if w.dim() == 3 and w.shape[1] == 1:  # nn.Conv1d's [C, 1, W]
            w = w.squeeze(1)
        if w.dtype not in _PARAM_DTYPES:
            fail(f"{name} must be bf16 or fp32, got {w.dtype}")
        if tuple(w.shape) != (channels, CONV_WIDTH):
            fail(
                f"{name} must have shape [{channels}, {CONV_WIDTH}] (H·{D} channels, width {CONV_WIDTH}), got {list(w.shape)}"
            )
        if w.stride() != (CONV_WIDTH, 1):
            fail(f"{name} must be contiguous ([C, {CONV_WIDTH}] rows); call .contiguous()")
        if w.device != device:
            fail(f"{name} is on {w.device} but q is on {device}; move all inputs to one CUDA device")
        _check_base(name, w)
        weights.append(w)
    if len({w.dtype for w in weights}) != 1:
        fail("conv_weight's q, k and v weights must share one dtype")
    biases = None
    if conv.bias is not None:
        biases = _split("conv_bias", conv.bias, channels, 0)
        for stream, b in zip(_STREAMS, biases):
            checks.check_contiguous(f"conv_bias ({stream})", b, weights[0].dtype, (channels,), device)
            _check_base(f"conv_bias ({stream})", b)
    taps = CONV_WIDTH - 1
    states = []
    for stream, s in zip(_STREAMS, _split("conv_state", conv.state, channels, 1 if conv.layout == "dim" else 2)):
        name = f"conv_state ({stream})"
        if not isinstance(s, torch.Tensor):
            fail(f"{name} must be a torch.Tensor, got {type(s).__name__}")
        if s.dtype not in _PARAM_DTYPES:
            fail(f"{name} must be bf16 or fp32, got {s.dtype}")
        want = (slots, channels, taps) if conv.layout == "dim" else (slots, taps, channels)
        if tuple(s.shape) != want:
            fail(
                f"{name} must have shape {list(want)} (conv_layout={conv.layout!r}, the state pool's {slots} slots), "
                f"got {list(s.shape)}"
            )
        if s.device != device:
            fail(f"{name} is on {s.device} but q is on {device}; move all inputs to one CUDA device")
        if conv.layout == "token":
            s = s.transpose(1, 2)
        if any(abs(x) > checks.INT32_MAX for x in s.stride()):
            fail(f"{name} strides {list(s.stride())} must fit in int32")
        states.append(s)
    if len({(s.dtype, s.stride()) for s in states}) != 1:
        fail(
            "conv_state's q, k and v states must share one dtype and strides (three pools of one shape, "
            "or channel slices of one packed pool)"
        )
    return ConvViews(tuple(weights), biases, tuple(states))


def validate(call: DecodeLayerCall):
    """Check every argument; returns the step's checked facts (``decode.validate``), the conv
    views, the output gate (unflattened like q) and the norm's eps."""
    checked = decode.validate(call.step, device_check=False)
    q, k, v, g, beta, out, (num_seqs, tokens, heads, _scale) = checked
    device = q.device
    norm = call.norm
    z = norm.gate
    checks.check_dtype_shape("out_gate", z, torch.bfloat16, z.shape if isinstance(z, torch.Tensor) else (), device)
    if z.dim() == 3:
        z = _as_4d("out_gate", z, tokens)
    checks.check_dtype_shape("out_gate", z, torch.bfloat16, (num_seqs, tokens, heads, D), device)
    _check_rows("out_gate", z)
    w = norm.weight
    if not isinstance(w, torch.Tensor) or w.dtype not in _PARAM_DTYPES:
        fail(f"norm_weight must be a bf16 or fp32 tensor, got {getattr(w, 'dtype', type(w).__name__)}")
    checks.check_contiguous("norm_weight", w, w.dtype, (D,), device)
    _check_base("norm_weight", w)
    eps = float(norm.eps)
    if not 0.0 < eps < 1.0:
        fail(f"norm_eps must be in (0, 1), got {eps}")
    views = conv_views(call, heads, call.step.state_pool.shape[0], device)
    drafts = check_speculation(call, num_seqs, heads, device)
    written = [("out", out)] if out is not None else []
    written += [(f"conv_state ({s})", t) for s, t in zip(_STREAMS, views.states)]
    if drafts is not None:
        written += [("drafts.records", drafts.records), ("drafts.marks", drafts.marks)]
    read = [
        ("q", q),
        ("k", k),
        ("v", v),
        ("g", g),
        ("beta", beta),
        ("out_gate", z),
        ("state_pool", call.step.state_pool),
    ]
    for a, (name, t) in enumerate(written):
        for other, u in read + written[a + 1 :]:
            lo, hi = _alias_bounds(_extent(t), _extent(u))
            if lo < u.data_ptr() - t.data_ptr() < hi:
                fail(f"{name} must not alias {other}")
    checks.check_device(device)
    return checked, views, z, eps


def check_speculation(call: DecodeLayerCall, num_seqs: int, heads: int, device):
    """The draft buffers (``cula_aot.drafts``), ``num_accepted`` and ``verify``; returns the
    buffers as a ``Drafts`` or None."""
    s = call.speculation
    if type(s.verify) is not bool:
        fail(f"verify must be True or False, got {s.verify!r}")
    if s.drafts is None:
        if s.verify:
            fail(
                "verify=True writes a draft: pass drafts=cula_aot.draft_buffers(slots, heads, device) and num_accepted"
            )
        if s.num_accepted is not None:
            fail("num_accepted commits a pending draft: pass the drafts it was written to (drafts=)")
        return None
    parts = _parts(s.drafts)
    if len(parts) != 2:
        fail("drafts must be cula_aot.draft_buffers(slots, heads, device) (records, marks)")
    drafts = Drafts(*parts)
    slots = call.step.state_pool.shape[0]
    checks.check_contiguous("drafts.records", drafts.records, torch.float32, draft_shape(slots, heads), device)
    checks.check_contiguous("drafts.marks", drafts.marks, torch.int32, (slots,), device)
    if s.num_accepted is None:
        fail("drafts needs num_accepted: int32 [N], how many tokens of each request's pending draft to keep")
    checks.check_contiguous("num_accepted", s.num_accepted, torch.int32, (num_seqs,), device)
    return drafts


_PLANS: dict = {}  # DecodeLayerCall.signature() → _LayerPlan
_PLAN_LIMIT = 256


def run(call: DecodeLayerCall):
    """One layer launch on the current stream from the plan of the call's signature."""
    try:
        key = call.signature()
        plan = _PLANS.get(key)
    except (AttributeError, TypeError):  # not tensors, or unhashable options: validation names it
        key = plan = None
    if plan is None:
        plan = _LayerPlan(call)
        if key is not None:
            if len(_PLANS) >= _PLAN_LIMIT:
                _PLANS.clear()
            _PLANS[key] = plan
    return plan.run(call)


def _addressed(call: DecodeLayerCall, views: ConvViews) -> list:
    """(name, tensor) of every tensor the kernel addresses but decode's own (``_LayerPlan`` keeps
    how to find each from the call: its argument, part and offset)."""
    named = [("out_gate", call.norm.gate), ("norm_weight", call.norm.weight)]
    named += [(f"conv_state_{s}", t) for s, t in zip(_STREAMS, views.states)]
    named += [(f"conv_weight_{s}", t) for s, t in zip(_STREAMS, views.weights)]
    if views.biases is not None:
        named += [(f"conv_bias_{s}", t) for s, t in zip(_STREAMS, views.biases)]
    drafts = _parts(call.speculation.drafts)
    if drafts:
        named += [("draft_records", drafts[0]), ("draft_marks", drafts[1])]
        named += [("num_accepted", call.speculation.num_accepted)]
    return named


def _sources(call: DecodeLayerCall) -> dict:
    """The argument each addressed tensor is cut from, as its parts (``_parts``)."""
    c = call.conv
    return {
        "out_gate": (call.norm.gate,),
        "norm_weight": (call.norm.weight,),
        "conv_state": _parts(c.state),
        "conv_weight": _parts(c.weight),
        "conv_bias": _parts(c.bias),
        "draft_records": _parts(call.speculation.drafts)[:1],
        "draft_marks": _parts(call.speculation.drafts)[1:],
        "num_accepted": (call.speculation.num_accepted,),
    }


def _source_of(name: str) -> str:
    return name.rsplit("_", 1)[0] if name.startswith("conv_") else name


class _LayerPlan:
    """One layer call signature's launch, validated once (as ``decode._DecodePlan``).  A call of
    the signature supplies its addresses: each addressed tensor is found from its argument by the
    part and byte offset the plan recorded (a packed argument's channel slices), and the call
    re-checks the 16-byte bases and that nothing it writes aliases what it reads."""

    def __init__(self, call: DecodeLayerCall):
        step, x = call.step, call.step.inputs
        self.flat = isinstance(x.q, torch.Tensor) and x.q.dim() == 3
        (q, k, v, g, beta, out, (num_seqs, tokens, heads, _)), views, z, _eps = validate(call)
        self.device = device = q.device
        pool = step.state_pool
        bf16_state = pool.dtype == torch.bfloat16
        v_block, items = step.variant or pick_layer_variant(num_seqs, heads, tokens, bf16_state)
        spec = DecodeLayerSpec(
            kv_layout=step.state_layout == "kv", bf16_state=bf16_state, v_block=v_block, items=items, gate=x.gate.name
        )
        kernel = default_loader().get(device, spec)
        self.out_shape = (num_seqs, tokens, heads, D)
        if out is None:
            out_stride_n, out_stride_t = (tokens * heads * D if num_seqs > 1 else 0), (heads * D if tokens > 1 else 0)
        else:
            out_stride_n, out_stride_t = _stride(out, 0), _stride(out, 1)
        state = views.states[0]
        flags = (
            (LAYER_FLAG_CONV_STATE_F32 if state.dtype == torch.float32 else 0)
            | (LAYER_FLAG_CONV_WEIGHT_F32 if views.weights[0].dtype == torch.float32 else 0)
            | (LAYER_FLAG_CONV_BIAS if views.biases is not None else 0)
            | (LAYER_FLAG_NORM_WEIGHT_F32 if call.norm.weight.dtype == torch.float32 else 0)
            | (LAYER_FLAG_STATUS if step.status is not None else 0)
            | (LAYER_FLAG_DRAFTS if call.speculation.drafts is not None else 0)
            | (LAYER_FLAG_VERIFY if call.speculation.verify else 0)
            | x.conventions
        )
        static = {
            "num_seqs": num_seqs,
            "num_tokens": tokens,
            "num_slots": pool.shape[0],
            "slot_stride": pool.stride(0) if pool.shape[0] > 1 else heads * D * D,
            "out_stride_n": out_stride_n,
            "out_stride_t": out_stride_t,
            "conv_slot_stride": state.stride(0),
            "conv_channel_stride": state.stride(1),
            "conv_tap_stride": state.stride(2),
            "out_gate_stride_n": _stride(z, 0),
            "out_gate_stride_t": _stride(z, 1),
            "flags": flags,
            "heads": heads,
        }
        for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
            static[f"{name}_stride_n"] = _stride(t, 0)
            static[f"{name}_stride_t"] = _stride(t, 1)
        self.template = kernel.template(static, smem_bytes=spec.launch_smem_bytes(tokens))
        self.num_seqs = num_seqs
        sources = _sources(call)
        self.recipe = []  # (name, argument, part, byte offset)
        for name, t in _addressed(call, views):
            parts = sources[_source_of(name)]
            part = _STREAMS.index(name[-1]) if len(parts) == 3 else 0  # a (q, k, v) tuple, else packed
            self.recipe.append((name, _source_of(name), part, t.data_ptr() - parts[part].data_ptr()))
        self.has_bias = views.biases is not None
        self.has_drafts = call.speculation.drafts is not None
        self.written = ("conv_state_q", "conv_state_k", "conv_state_v")
        if self.has_drafts:
            self.written += ("draft_records", "draft_marks")
        # The address rules read extents the signature fixes: decode's tensors, and these.
        extents = {name: _extent(t) for name, t in _addressed(call, views)}
        for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("state_pool", pool)):
            extents[name] = _extent(t)
        if out is not None:
            extents["out"] = _extent(out)
        # The address rules as bounds (``decode._alias_bounds``), fixed by the signature: each
        # tensor the call writes against every other one it addresses.
        written = [name for name in ("out", *self.written) if name in extents]
        others = [name for name in extents if name not in written]
        self.alias_rules = [
            (w, o, *_alias_bounds(extents[w], extents[o]))
            for i, w in enumerate(written)
            for o in others + written[i + 1 :]
        ]

    def run(self, call: DecodeLayerCall):
        step, x = call.step, call.step.inputs
        lower_bound, scale = checks.check_scalars(x.gate.lower_bound, x.scale)
        eps = float(call.norm.eps)
        if not 0.0 < eps < 1.0:
            fail(f"norm_eps must be in (0, 1), got {eps}")
        sources = _sources(call)
        addresses = {name: sources[source][part].data_ptr() + offset for name, source, part, offset in self.recipe}
        out, status = step.out, step.status
        addresses.update(
            q=x.q.data_ptr(),
            k=x.k.data_ptr(),
            v=x.v.data_ptr(),
            g=x.g.data_ptr(),
            beta=x.beta.data_ptr(),
            state_pool=step.state_pool.data_ptr(),
        )
        op = 0 if out is None else out.data_ptr()
        sp = 0 if status is None else status.data_ptr()
        unaligned = ("beta", "draft_marks", "num_accepted", "conv_state_q", "conv_state_k", "conv_state_v")
        aligned = (a for name, a in addresses.items() if name not in unaligned)
        if any(a & (_ALIGN - 1) for a in aligned) or (op | sp | x.gate.A_log.data_ptr() | x.gate.dt_bias.data_ptr()) & (
            _ALIGN - 1
        ):
            validate(call)  # names the misaligned argument
        addresses["out"] = op
        for name, other, lo, hi in self.alias_rules:
            if lo < addresses[other] - addresses[name] < hi:
                fail(f"{name} must not alias {other}")
        if out is None:
            out = torch.empty(self.out_shape, dtype=torch.bfloat16, device=self.device)
            op = out.data_ptr()
        result = out.flatten(0, 1) if self.flat else out
        if self.num_seqs == 0:
            return result
        beta_base, beta_offset = _aligned_down(addresses["beta"], x.beta)
        index_base, index_offset = _aligned_down(step.state_indices.data_ptr(), step.state_indices)
        values = dict(addresses)
        if not self.has_bias:  # never read without LAYER_FLAG_CONV_BIAS
            values.update({f"conv_bias_{s}": addresses[f"conv_weight_{s}"] for s in _STREAMS})
        if not self.has_drafts:  # never read without LAYER_FLAG_DRAFTS
            values.update(draft_records=addresses["state_pool"], draft_marks=index_base, num_accepted=index_base)
        values.update(
            beta=beta_base,
            a_log=x.gate.A_log.data_ptr(),
            dt_bias=x.gate.dt_bias.data_ptr(),
            state_indices=index_base,
            out=op,
            status=sp,
            beta_offset=beta_offset,
            index_offset=index_offset,
            scale=scale,
            lower_bound=lower_bound,
            norm_eps=eps,
        )
        self.template.launch(values, raw_stream(self.device))
        return result


def _aligned_down(address: int, t) -> tuple[int, int]:
    """(the 16-byte aligned address at or below ``address``, ``t``'s element offset from it)."""
    skew = address & (_ALIGN - 1)
    return address - skew, skew // t.element_size()


def decode_layer(q, k, v, g, beta, **options):
    """``run`` of ``kda_decode_layer``'s arguments given by name (and the ``variant`` override:
    (v_block, items) of a built layer kernel, default ``specs.pick_layer_variant``)."""
    return run(DecodeLayerCall.of({"q": q, "k": k, "v": v, "g": g, "beta": beta, **options}))
