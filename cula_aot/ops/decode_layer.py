"""The fused decode layer (``cula_aot.kda_decode_layer``): validation and one launch of
``kernels/decode_layer.py`` on the current stream.

The KDA step's arguments are checked by decode's own rules (``decode.validate``); this adds the
convolutions' weights, biases and states and the output norm's.  As in decode, every rule is
checked before anything is written, nothing reads a device tensor on the host, and a plan per
call signature keeps the launch template; a call re-checks only what depends on its addresses.
``kda_decode_layer`` (``launch``) keeps what was checked of each call by its arguments, so a
call that repeats one reads each tensor once and launches its packed parameters.
"""

import operator
from typing import NamedTuple

import torch

from ..gates import DEFAULT_GATE
from ..layout import D
from ..runtime.loader import default_loader
from .. import specs  # the layer's ``specs.LAYER_FLAG_*`` bits
from ..specs import CONV_WIDTH, DecodeLayerSpec, pick_layer_variant
from ..drafts import Drafts, draft_shape
from .plan_cache import PLAN_LIMIT, CheckedPlan, LaunchPlans
from .call import DecodeLayerCall, Inputs, _parts
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
    if call.step.state_indices.dim() != 1:
        fail(
            "kda_decode_layer takes state_indices [N] (one pool slot per request); for speculative decoding "
            "pass drafts= and num_accepted= (the layer keeps per-token records, not per-token slots)"
        )
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
    checks.check_contiguous("drafts.records", drafts.records, torch.bfloat16, draft_shape(slots, heads), device)
    _check_base("drafts.records", drafts.records)
    checks.check_contiguous("drafts.marks", drafts.marks, torch.int32, (slots, heads), device)
    if s.num_accepted is None:
        fail("drafts needs num_accepted: int32 [N], how many tokens of each request's pending draft to keep")
    checks.check_contiguous("num_accepted", s.num_accepted, torch.int32, (num_seqs,), device)
    return drafts


def run(call: DecodeLayerCall):
    """One layer launch on the current stream from the plan of the call's signature."""
    plan = _PLANS.get(call)
    return plan.launch_checked(plan.check(call), call.step.out)


# The kernel's per-call parameters, in the order ``_LayerPlan.check`` keys them.
_PER_CALL = (
    *decode.STEP_PER_CALL,
    "out",
    "status",
    "out_gate",
    *(f"conv_{part}_{s}" for part in ("state", "weight", "bias") for s in _STREAMS),
    "norm_weight",
    "draft_records",
    "draft_marks",
    "num_accepted",
    "beta_offset",
    "index_offset",
    "scale",
    "lower_bound",
    "norm_eps",
)
# Addresses the kernel reads element by element (any alignment of their dtype).
_UNALIGNED = frozenset(("beta", "state_indices", "draft_marks", "num_accepted", *(f"conv_state_{s}" for s in _STREAMS)))


def _three(argument, views) -> tuple:
    """How a call's (q, k, v) views are found from its argument: (packed, byte offset of each view
    from the packed tensor's or its own tuple part's first element)."""
    parts = _parts(argument)
    if len(parts) == 3:
        return False, tuple(t.data_ptr() - p.data_ptr() for t, p in zip(views, parts))
    return True, tuple(t.data_ptr() - parts[0].data_ptr() for t in views)


def _three_addresses(argument, recipe) -> tuple:
    packed, (a, b, c) = recipe
    if packed:
        base = argument.data_ptr()
        return base + a, base + b, base + c
    return argument[0].data_ptr() + a, argument[1].data_ptr() + b, argument[2].data_ptr() + c


class _LayerPlan(CheckedPlan):
    """One layer call signature's launch, validated once (as ``decode._DecodePlan``).  A call of
    the signature supplies its addresses (a packed argument's channel slices at the byte offsets
    the plan recorded) and scalars; the rules that depend on them (16-byte bases, nothing written
    aliasing anything else addressed, the scalars' ranges) are checked for each new combination
    and the combinations that passed are kept, so a serving loop that reuses its buffers pays a
    dictionary lookup."""

    OUT = _PER_CALL.index("out")

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
        state = views.states[0]
        speculation = call.speculation
        self.has_drafts = speculation.drafts is not None
        flags = (
            (specs.LAYER_FLAG_CONV_STATE_F32 if state.dtype == torch.float32 else 0)
            | (specs.LAYER_FLAG_CONV_WEIGHT_F32 if views.weights[0].dtype == torch.float32 else 0)
            | (specs.LAYER_FLAG_CONV_BIAS if views.biases is not None else 0)
            | (specs.LAYER_FLAG_NORM_WEIGHT_F32 if call.norm.weight.dtype == torch.float32 else 0)
            | (specs.LAYER_FLAG_STATUS if step.status is not None else 0)
            | (specs.LAYER_FLAG_DRAFTS if self.has_drafts else 0)
            | (specs.LAYER_FLAG_VERIFY if speculation.verify else 0)
            | x.conventions
        )
        static = {
            **decode.geometry(num_seqs, tokens, heads, pool, out, (q, k, v, g, beta)),
            "conv_slot_stride": state.stride(0),
            "conv_channel_stride": state.stride(1),
            "conv_tap_stride": state.stride(2),
            "out_gate_stride_n": _stride(z, 0),
            "out_gate_stride_t": _stride(z, 1),
            "flags": flags,
            "heads": heads,
        }
        self.template = decode.launch_template(
            kernel, static, spec.launch_smem_bytes(tokens, drafts=self.has_drafts), _PER_CALL, "the layer's"
        )
        self.num_seqs = num_seqs
        conv = call.conv
        self.state_recipe = _three(conv.state, views.states)
        self.weight_recipe = _three(conv.weight, views.weights)
        self.bias_recipe = None if views.biases is None else _three(conv.bias, views.biases)
        self.beta_size = beta.element_size()
        # The address rules as bounds (``decode._alias_bounds``), fixed by the signature: each
        # tensor the call writes against every other one it addresses.
        extents = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "state_pool": pool, "out_gate": z}
        extents["norm_weight"] = call.norm.weight
        for part, tensors in (("state", views.states), ("weight", views.weights), ("bias", views.biases)):
            for s, t in zip(_STREAMS, tensors or ()):
                extents[f"conv_{part}_{s}"] = t
        written = [f"conv_state_{s}" for s in _STREAMS]
        if out is not None:
            extents["out"] = out
            written.insert(0, "out")
        if self.has_drafts:
            records, marks = _parts(speculation.drafts)
            extents.update(draft_records=records, draft_marks=marks, num_accepted=speculation.num_accepted)
            written += ["draft_records", "draft_marks"]
        extents = {name: _extent(t) for name, t in extents.items()}
        others = [name for name in extents if name not in written]
        self.alias_rules = [
            (w, o, *_alias_bounds(extents[w], extents[o]))
            for i, w in enumerate(written)
            for o in others + written[i + 1 :]
        ]
        self.checked: dict = {}  # the call's addresses and raw scalars → ``_check``'s

    def check(self, call: DecodeLayerCall) -> tuple:
        """The call's per-call values and parameter buffer (``launch_checked``'s), checked at the
        first call with its addresses and scalars."""
        step, (weight, bias, state, _), (z, norm_weight, eps), (drafts, accepted, _) = call
        x, pool, indices, out, _, _, _, status, _, _ = step
        q, k, v, g, beta, (_, a_log, dt_bias, lower_bound), scale, _ = x
        pp, xp = pool.data_ptr(), indices.data_ptr()
        cw = _three_addresses(weight, self.weight_recipe)
        if self.has_drafts:
            dr, dm, na = drafts[0].data_ptr(), drafts[1].data_ptr(), accepted.data_ptr()
        else:  # never read without LAYER_FLAG_DRAFTS
            dr, dm, na = pp, xp, xp
        key = (
            q.data_ptr(),
            k.data_ptr(),
            v.data_ptr(),
            g.data_ptr(),
            beta.data_ptr(),
            a_log.data_ptr(),
            dt_bias.data_ptr(),
            xp,
            pp,
            0 if out is None else out.data_ptr(),
            0 if status is None else status.data_ptr(),
            z.data_ptr(),
            *_three_addresses(state, self.state_recipe),
            *cw,
            *(cw if self.bias_recipe is None else _three_addresses(bias, self.bias_recipe)),
            norm_weight.data_ptr(),
            dr,
            dm,
            na,
            lower_bound,
            scale,
            eps,
        )
        checked = self.checked.get(key)
        return self._check(call, key) if checked is None else checked

    def fixed_addresses(self, call: DecodeLayerCall) -> tuple:
        """The addresses ``DecodeLayerStep`` keeps of a call's fixed tensors, in ``check``'s key
        order: a_log, dt_bias, state_pool, then conv states, weights and biases, norm_weight,
        draft records and marks (None for the last two without drafts: the call's index address)."""
        step, (weight, bias, state, _), (_, norm_weight, _), (drafts, _, _) = call
        gate = step.inputs.gate
        cw = _three_addresses(weight, self.weight_recipe)
        return (
            gate.A_log.data_ptr(),
            gate.dt_bias.data_ptr(),
            step.state_pool.data_ptr(),
            *_three_addresses(state, self.state_recipe),
            *cw,
            *(cw if self.bias_recipe is None else _three_addresses(bias, self.bias_recipe)),
            norm_weight.data_ptr(),
            *((drafts[0].data_ptr(), drafts[1].data_ptr()) if self.has_drafts else (None, None)),
        )

    def launch(self, key: tuple, out, make_call):
        """Launch with the call's ``key`` (``check``'s: addresses in ``_PER_CALL`` order, then the raw
        lower_bound, scale and eps), checked once per key (``make_call()`` gives the call for the
        checks' messages); ``out`` allocated when None.  Returns ``out`` as the caller shaped q."""
        checked = self.checked.get(key)
        if checked is None:
            checked = self._check(make_call(), key)
        return self.launch_checked(checked, out)

    def _check(self, call: DecodeLayerCall, key: tuple) -> tuple:
        """The rules a call's addresses and scalars must meet; returns its per-call values and
        parameter buffer (``launch_checked``'s), kept for the next call with the same ``key``."""
        addresses = dict(zip(_PER_CALL[:-5], key[:-3]))
        lower_bound, scale = checks.check_scalars(key[-3], key[-2])
        eps = float(key[-1])
        if not 0.0 < eps < 1.0:
            fail(f"norm_eps must be in (0, 1), got {eps}")
        if any(a & (_ALIGN - 1) for name, a in addresses.items() if name not in _UNALIGNED):
            validate(call)  # names the misaligned argument
        for name, other, lo, hi in self.alias_rules:
            if lo < addresses[other] - addresses[name] < hi:
                fail(f"{name} must not alias {other}")
        beta, index = addresses["beta"], addresses["state_indices"]
        beta_skew, index_skew = beta & (_ALIGN - 1), index & (_ALIGN - 1)
        addresses.update(beta=beta - beta_skew, state_indices=index - index_skew)
        values = (
            *(addresses[name] for name in _PER_CALL[:-5]),
            beta_skew // self.beta_size,
            index_skew // 4,
            scale,
            lower_bound,
            eps,
        )
        return self.keep(key, values)


_PLANS = LaunchPlans(_LayerPlan)
_BF16 = torch.bfloat16


def _placed(x):
    """A convolution argument's layout and address: one packed tensor's, each part's of a (q, k, v)
    tuple, or None."""
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return x.shape, x.stride(), x.dtype, x.get_device(), x.data_ptr()
    return tuple([None if t is None else (t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr()) for t in x])


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
    status,
    conv,
    norm,
    speculation,
):
    """``kda_decode_layer``'s launch, its arguments by position (``Inputs.bind``'s, then
    ``DecodeLayerCall.bind``'s after the inputs).  What the plan checked of a call is kept by its
    arguments as given (every tensor's layout and address, every option and scalar): a call that
    repeats them (a serving loop reusing its buffers) reads each tensor once, binds nothing and
    launches after one comparison, where ``run`` reads the layouts and the addresses apart and
    looks up each.  Only arguments that binding passes on are keys: a call with g or β to convert
    or A_log or dt_bias to default (new tensors each call) is bound and planned every time."""
    plans = _PLANS
    try:
        if A_log is None or dt_bias is None or g.dtype is not _BF16 or beta.dtype is not _BF16:
            raise TypeError  # binding would make new tensors; past here g and β are bf16 (unkeyed dtypes)
        weight, bias, state, conv_layout = conv
        z, w, eps = norm
        drafts, accepted, verify = speculation
        if drafts is not None:
            records, marks = drafts
        # Spelled out (the layout and address of each tensor, none of them read twice): a helper
        # call per optional tensor costs ~0.1 µs, a pair's loop ~0.4.
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
            z.shape, z.stride(), z.dtype, z.get_device(), z.data_ptr(),
            w.shape, w.stride(), w.dtype, w.get_device(), w.data_ptr(),
            None if out is None else (out.shape, out.stride(), out.dtype, out.get_device(), out.data_ptr()),
            None if status is None else (status.shape, status.stride(), status.dtype, status.get_device(),
                                         status.data_ptr()),
            _placed(weight), _placed(bias), _placed(state),
            None if drafts is None else (
                records.shape, records.stride(), records.dtype, records.get_device(), records.data_ptr(),
                marks.shape, marks.stride(), marks.dtype, marks.get_device(), marks.data_ptr(),
            ),
            None if accepted is None else (accepted.shape, accepted.stride(), accepted.dtype,
                                           accepted.get_device(), accepted.data_ptr()),
            # The types where binding refuses what the values equal: 1 == True, but only True passes.
            gate, lower_bound, scale, type(beta_sigmoid), beta_sigmoid, type(qk_l2norm), qk_l2norm,
            type(tokens), tokens, state_layout, conv_layout, eps, verify,
        )
        # fmt: on
        found = plans.found(key)
    except (AttributeError, TypeError, ValueError, RuntimeError):  # what the key cannot read: validation names it
        key = found = None
    if found is None:
        inputs = Inputs.bind(q, k, v, g, beta, gate, A_log, dt_bias, lower_bound, scale, beta_sigmoid, qk_l2norm)
        call = DecodeLayerCall.bind(inputs, pool, slots, out, tokens, state_layout, status, conv, norm, speculation)
        found = plans.check(call, key)
    plan, checked = found
    return plan.launch_checked(checked, out)


def decode_layer(q, k, v, g, beta, **options):
    """``run`` of ``kda_decode_layer``'s arguments given by name (and the ``variant`` override:
    (v_block, items) of a built layer kernel, default ``specs.pick_layer_variant``)."""
    return run(DecodeLayerCall.of({"q": q, "k": k, "v": v, "g": g, "beta": beta, **options}))


_VERSION = operator.attrgetter("_version")


class DecodeLayerStep:
    """A KDA layer's decode step with its fixed tensors bound once (``cula_aot.DecodeLayerStep``):
    the weights, gate parameters, pools and draft buffers a serving layer keeps, checked with the
    first call; a call passes only what changes per step, and the step reads only those tensors'
    layouts and addresses (``kda_decode_layer`` reads all of them every call).  Each call reads
    the fixed tensors' version counters and addresses, which every in-place change of their
    layout or storage moves (``resize_``, ``set_``, ``as_strided_``, ``.data =``, any torch
    write); on a change the next call is validated in full again."""

    def __init__(
        self,
        *,
        conv_weight,
        conv_state,
        norm_weight,
        state_pool,
        A_log=None,
        dt_bias=None,
        lower_bound=None,
        gate=DEFAULT_GATE,
        scale=None,
        conv_bias=None,
        conv_layout="dim",
        norm_eps=1e-5,
        state_layout="vk",
        drafts=None,
        beta_sigmoid=True,
        qk_l2norm=True,
    ):
        conv = (conv_weight, conv_bias, conv_state, conv_layout)
        self._fixed_args = (conv, norm_weight, norm_eps, A_log, dt_bias)
        self._gate = (lower_bound, gate, scale)
        self._pool, self._state_layout, self._drafts = state_pool, state_layout, drafts
        self._conventions = (beta_sigmoid, qk_l2norm)
        self._fixed = [
            t
            for t in (
                *_parts(conv_weight),
                *_parts(conv_state),
                *_parts(conv_bias),
                norm_weight,
                A_log,
                dt_bias,
                state_pool,
                *_parts(drafts),
            )
            if isinstance(t, torch.Tensor)
        ]
        self._guard = None  # the fixed tensors' (versions, addresses) the cached plans hold for
        self._plans: dict = {}  # the per-call tensors' layouts and options → plan

    def _state(self) -> tuple:
        fixed = self._fixed
        return tuple(map(_VERSION, fixed)), tuple(map(torch.Tensor.data_ptr, fixed))

    def __call__(
        self,
        q,
        k,
        v,
        g,
        beta,
        out_gate,
        state_indices,
        *,
        out=None,
        num_tokens=None,
        num_accepted=None,
        verify=False,
        status=None,
    ):
        """``kda_decode_layer`` with this step's fixed arguments; returns ``out``."""

        def call():
            conv, norm_weight, eps, a_log, dt_bias = self._fixed_args
            lower_bound, gate, scale = self._gate
            inputs = Inputs.bind(q, k, v, g, beta, gate, a_log, dt_bias, lower_bound, scale, *self._conventions)
            norm, speculation = (out_gate, norm_weight, eps), (self._drafts, num_accepted, verify)
            return DecodeLayerCall.bind(
                inputs, self._pool, state_indices, out, num_tokens, self._state_layout, status, conv, norm, speculation
            )

        guard = self._state()
        if guard != self._guard:  # a fixed tensor changed: every plan is looked up in full again
            self._plans.clear()
            self._guard = guard
        try:
            if g.dtype != torch.bfloat16 or beta.dtype != torch.bfloat16:
                raise TypeError  # converted by the full path: its plan saw other tensors
            key = (
                q.shape, q.stride(), q.dtype, q.get_device(),
                k.shape, k.stride(), k.dtype, k.get_device(),
                v.shape, v.stride(), v.dtype, v.get_device(),
                g.shape, g.stride(), g.get_device(),
                beta.shape, beta.stride(), beta.get_device(),
                out_gate.shape, out_gate.stride(), out_gate.dtype, out_gate.get_device(),
                state_indices.shape, state_indices.stride(), state_indices.dtype, state_indices.get_device(),
                None if out is None else (out.shape, out.stride(), out.dtype, out.get_device()),
                None if status is None else (status.shape, status.stride(), status.dtype, status.get_device()),
                None if num_accepted is None
                else (num_accepted.shape, num_accepted.stride(), num_accepted.dtype, num_accepted.get_device()),
                type(num_tokens), num_tokens, verify,
            )  # fmt: skip
            entry = self._plans.get(key)
        except (AttributeError, TypeError):  # not tensors, other dtypes, unhashable: the full path
            return run(call())
        if entry is None:
            full = call()
            plan = _PLANS.get(full)
            entry = self._plans[key] = plan, plan.fixed_addresses(full)
            if len(self._plans) > PLAN_LIMIT:
                self._plans.clear()
        plan, (a_log, dt_bias, pool, sq, sk, sv, wq, wk, wv, bq, bk, bv, norm, records, marks) = entry
        xp = state_indices.data_ptr()
        lower_bound, _, scale = self._gate
        key = (
            q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(), a_log, dt_bias, xp, pool,
            0 if out is None else out.data_ptr(), 0 if status is None else status.data_ptr(), out_gate.data_ptr(),
            sq, sk, sv, wq, wk, wv, bq, bk, bv, norm,
            xp if records is None else records, xp if marks is None else marks,
            xp if num_accepted is None else num_accepted.data_ptr(),
            lower_bound, scale, self._fixed_args[2],
        )  # fmt: skip
        return plan.launch(key, out, call)
