"""A call as one typed object, built once at the boundary: ``PrefillCall`` and ``DecodeCall``.

Every entry point (``kda_prefill``, ``fwd``, ``kda_decode``, the ``torch.library`` ops, and through
them ``cula_aot.fla`` and ``cula_aot.distributed``) hands its arguments by name to ``of`` (or
positionally to ``build``; ``kda_decode`` and ``kda_decode_layer`` by position to ``Inputs.bind``,
then to ``DecodeCall.bind`` or ``DecodeLayerCall.bind``), which resolves what does not
depend on validation: the gate's arguments (``gates.resolve_gate``), g and β in the kernels'
dtype, the input-convention bits, a pool's in-place final state.  Validation takes the call and
returns the checked facts; the plan cache keys on ``PrefillCall.signature``; plans run from the
call.  Immutable (a tuple): nothing downstream rewrites an argument.
"""

from typing import NamedTuple

import torch

from ..gates import DEFAULT_GATE, GateArgs, resolve_gate
from .checks import input_flags, kernel_dtypes

_new = tuple.__new__


# The keyword arguments of ``kda_prefill`` (``fwd`` and the ops take the same names) with their
# defaults.  The public signatures spell the same defaults for their readers;
# tests/ops/test_call.py holds them equal.
PREFILL_OPTIONS = {
    "A_log": None,
    "dt_bias": None,
    "lower_bound": None,
    "gate": DEFAULT_GATE,
    "scale": None,
    "initial_state": None,
    "output_final_state": False,
    "cu_seqlens": None,
    "cu_seqlens_cpu": None,
    "state_layout": "vk",
    "intracard_cp": "auto",
    "out": None,
    "final_state": None,
    "state_indices": None,
    "check_seqlens": "auto",
    "status": None,
    "beta_sigmoid": True,
    "qk_l2norm": True,
    "checkpoint_every": 0,
    "checkpoint_pool": None,
    "checkpoint_indices": None,
    "checkpoint_offsets": None,
}
REQUIRED = object()  # an option without a default
# ``kda_decode``'s keyword arguments, likewise.
DECODE_OPTIONS = {
    "A_log": None,
    "dt_bias": None,
    "lower_bound": None,
    "gate": DEFAULT_GATE,
    "scale": None,
    "state_pool": REQUIRED,
    "state_indices": REQUIRED,
    "out": None,
    "num_tokens": None,
    "state_layout": "vk",
    "intermediate_states": None,
    "status": None,
    "beta_sigmoid": True,
    "qk_l2norm": True,
    "num_accepted": None,
}


class _Arguments:
    """One entry's arguments: the five inputs, its options with their defaults, and the overrides
    that tests and benchmarks may add (``None`` unless given)."""

    def __init__(self, entry: str, defaults: dict, overrides: tuple):
        self.entry, self.defaults = entry, defaults
        self.names = frozenset(("q", "k", "v", "g", "beta", *defaults, *overrides))
        self.required = tuple(name for name, value in defaults.items() if value is REQUIRED)

    def __call__(self, given: dict) -> dict:
        """``given`` (by name) over the defaults; an unknown or a missing name is a TypeError, as
        a signature would raise.  ``kda_prefill``'s own ``locals()`` hold every option: no copy
        then."""
        if not given.keys() <= self.names:
            unknown = ", ".join(sorted(given.keys() - self.names))
            raise TypeError(f"{self.entry}() got unexpected keyword argument(s): {unknown}")
        if not self.defaults.keys() <= given.keys():
            given = {**self.defaults, **given}
        if self.required:  # the inputs come positionally or from a signature's locals()
            missing = [name for name in self.required if given.get(name, REQUIRED) is REQUIRED]
            if missing:
                raise TypeError(f"{self.entry}() missing required argument(s): {', '.join(missing)}")
        return given


_PREFILL_ARGUMENTS = _Arguments("kda_prefill", PREFILL_OPTIONS, ("v_block", "fused"))
_DECODE_ARGUMENTS = _Arguments("kda_decode", DECODE_OPTIONS, ("variant",))


class Inputs(NamedTuple):
    """What every KDA call starts from: q, k, v, g and β (g and β in the kernels' dtype), the
    resolved gate, the scale (None: 128^-0.5) and the input-convention bits
    (``checks.input_flags``)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    gate: GateArgs
    scale: object
    conventions: int

    def tensors(self) -> tuple:
        """The tensors a cached plan fixes the layout of: q, k, v, g, β, A_log, dt_bias."""
        return (*self[:5], self.gate.A_log, self.gate.dt_bias)

    @classmethod
    def of(cls, o: dict) -> "Inputs":
        """From a call's arguments by name."""
        return cls.bind(
            o["q"],
            o["k"],
            o["v"],
            o["g"],
            o["beta"],
            o["gate"],
            o["A_log"],
            o["dt_bias"],
            o["lower_bound"],
            o["scale"],
            o["beta_sigmoid"],
            o["qk_l2norm"],
        )

    @classmethod
    def bind(cls, q, k, v, g, beta, gate, A_log, dt_bias, lower_bound, scale, beta_sigmoid, qk_l2norm) -> "Inputs":
        """From a call's arguments by position."""
        g, beta = kernel_dtypes(g, beta)
        gate = resolve_gate(gate, A_log, dt_bias, lower_bound, q)
        # tuple.__new__: the generated NamedTuple constructor costs a Python frame per call.
        return _new(cls, (q, k, v, g, beta, gate, scale, input_flags(beta_sigmoid, qk_l2norm)))


def _layouts(tensors: tuple) -> tuple:
    """What a cached plan fixes of its tensor arguments: each one's shape, strides, dtype and
    device index (None for an absent one; -1 for a host tensor, and only CUDA calls make plans).
    Raises AttributeError for a non-tensor."""
    return tuple([None if t is None else (t.shape, t.stride(), t.dtype, t.get_device()) for t in tensors])


class CheckpointSink(NamedTuple):
    """Where a prefill writes its prefix-cache checkpoints (``kda_prefill``'s ``checkpoint_*``):
    the period in tokens (0: none), the pool, the slot map ``[N, M]`` and the optional per-sequence
    token offsets."""

    every: object
    pool: torch.Tensor | None
    indices: torch.Tensor | None
    offsets: torch.Tensor | None


class PrefillCall(NamedTuple):
    """One prefill call's arguments as the path choice, validation and plans read them (see
    ``cula_aot.kda_prefill`` for each).  ``v_block`` / ``fused``: path overrides for tests and
    benchmarks (``paths.choose_path``)."""

    inputs: Inputs
    initial_state: torch.Tensor | None
    final_state: torch.Tensor | None
    output_final_state: bool
    state_indices: torch.Tensor | None
    state_layout: str
    out: torch.Tensor | None
    cu_seqlens: torch.Tensor | None
    cu_seqlens_cpu: torch.Tensor | None
    check_seqlens: str
    intracard_cp: object
    status: torch.Tensor | None
    checkpoints: CheckpointSink
    v_block: int | None = None
    fused: bool | None = None

    @classmethod
    def build(cls, q, k, v, g, beta, **options) -> "PrefillCall":
        """The call of ``kda_prefill``'s arguments (``PREFILL_OPTIONS``; and the path overrides
        ``v_block`` and ``fused``)."""
        return cls.of({"q": q, "k": k, "v": v, "g": g, "beta": beta, **options})

    @classmethod
    def of(cls, arguments: dict) -> "PrefillCall":
        """``build`` from the arguments by name (an entry point's ``locals()``)."""
        o = _PREFILL_ARGUMENTS(arguments)
        final_state = o["final_state"]
        if o["state_indices"] is not None and o["output_final_state"] and final_state is None:
            final_state = o["initial_state"]  # a pool's final states go back where they came from
        return cls(
            Inputs.of(o),
            o["initial_state"],
            final_state,
            o["output_final_state"],
            o["state_indices"],
            o["state_layout"],
            o["out"],
            o["cu_seqlens"],
            o["cu_seqlens_cpu"],
            o["check_seqlens"],
            o["intracard_cp"],
            o["status"],
            CheckpointSink(
                o["checkpoint_every"], o["checkpoint_pool"], o["checkpoint_indices"], o["checkpoint_offsets"]
            ),
            o.get("v_block"),
            o.get("fused"),
        )

    def signature(self) -> tuple:
        """The plan cache's key: every tensor's layout and every option a plan fixes (not the
        addresses, scale or lower_bound, which each call supplies).  Raises AttributeError for a
        non-tensor; an unhashable option raises TypeError where it is looked up (validation then
        names either)."""
        c, x = self.checkpoints, self.inputs
        layouts = _layouts(
            (
                *x.tensors(),
                self.initial_state,
                self.final_state,
                self.out,
                self.cu_seqlens,
                self.cu_seqlens_cpu,
                self.state_indices,
                self.status,
                c.pool,
                c.indices,
                c.offsets,
            )
        )
        return (
            layouts,
            self.state_layout,
            type(self.intracard_cp),
            self.intracard_cp,
            bool(self.output_final_state),
            self.check_seqlens,
            self.v_block,
            self.fused,
            x.gate.name,
            x.conventions,
            type(c.every),
            c.every,
        )


class DecodeCall(NamedTuple):
    """One decode call's arguments (see ``cula_aot.kda_decode``).  ``variant``: a built kernel
    variant to run instead of ``specs.pick_variant``'s (tests and benchmarks)."""

    inputs: Inputs
    state_pool: torch.Tensor
    state_indices: torch.Tensor
    out: torch.Tensor | None
    num_tokens: int | None
    state_layout: str
    intermediate_states: torch.Tensor | None
    status: torch.Tensor | None
    num_accepted: torch.Tensor | None = None
    variant: tuple | None = None

    @classmethod
    def build(cls, q, k, v, g, beta, **options) -> "DecodeCall":
        """The call of ``kda_decode``'s arguments (``DECODE_OPTIONS``; and the ``variant``
        override)."""
        return cls.of({"q": q, "k": k, "v": v, "g": g, "beta": beta, **options})

    @classmethod
    def of(cls, arguments: dict) -> "DecodeCall":
        """``build`` from the arguments by name (an entry point's arguments)."""
        o = _DECODE_ARGUMENTS(arguments)
        return cls.bind(*_step_of(o), o["intermediate_states"], o["status"], o["num_accepted"], o.get("variant"))

    @classmethod
    def bind(cls, inputs, pool, slots, out, tokens, layout, inter, status, accepted, variant=None) -> "DecodeCall":
        """The call of its fields by position (``ops.decode.launch`` binds ``kda_decode``'s
        arguments itself, after ``Inputs.bind``, at their first call: a dict of its ``locals()``
        costs a microsecond a call, and the generated constructor a ``type.__call__``)."""
        return _new(cls, (inputs, pool, slots, out, tokens, layout, inter, status, accepted, variant))

    def signature(self) -> tuple:
        """The decode plan cache's key (``ops.decode``): every tensor's layout and every option a
        plan fixes, as ``PrefillCall.signature`` (flat: q's shape, strides, dtype and device, then
        k's, ...; None or such a 4-tuple for each optional tensor)."""
        x, pool, slots, out, tokens, state_layout, inter, status, accepted, variant = self
        q, k, v, g, beta, gate, _, conventions = x
        a, d = gate.A_log, gate.dt_bias
        # Spelled out rather than a loop over the tensors: built on every decode call, where a
        # loop and a tuple per tensor cost ~0.6 µs more.
        # fmt: off
        return (
            q.shape, q.stride(), q.dtype, q.get_device(),
            k.shape, k.stride(), k.dtype, k.get_device(),
            v.shape, v.stride(), v.dtype, v.get_device(),
            g.shape, g.stride(), g.dtype, g.get_device(),
            beta.shape, beta.stride(), beta.dtype, beta.get_device(),
            a.shape, a.stride(), a.dtype, a.get_device(),
            d.shape, d.stride(), d.dtype, d.get_device(),
            pool.shape, pool.stride(), pool.dtype, pool.get_device(),
            slots.shape, slots.stride(), slots.dtype, slots.get_device(),
            None if out is None else (out.shape, out.stride(), out.dtype, out.get_device()),
            None if inter is None else (inter.shape, inter.stride(), inter.dtype, inter.get_device()),
            None if status is None else (status.shape, status.stride(), status.dtype, status.get_device()),
            None if accepted is None else (accepted.shape, accepted.stride(), accepted.dtype, accepted.get_device()),
            type(tokens), tokens, state_layout, gate.name, conventions, variant,
        )
        # fmt: on


def _step_of(o: dict) -> tuple:
    """The first fields of the KDA step of a decode or layer call's arguments by name (``o``, the
    defaults filled in): its ``Inputs``, then the pool, the slots, out, T and the state layout."""
    return Inputs.of(o), o["state_pool"], o["state_indices"], o["out"], o["num_tokens"], o["state_layout"]


# ``kda_decode_layer``'s keyword arguments beyond ``kda_decode``'s (less ``intermediate_states``:
# the layer's speculative form keeps records, not states; its ``num_accepted`` commits a draft),
# likewise.
LAYER_OPTIONS = {
    "conv_weight": REQUIRED,
    "conv_state": REQUIRED,
    "out_gate": REQUIRED,
    "norm_weight": REQUIRED,
    "conv_bias": None,
    "conv_layout": "dim",
    "norm_eps": 1e-5,
    **{name: value for name, value in DECODE_OPTIONS.items() if name not in ("intermediate_states", "num_accepted")},
    "drafts": None,
    "num_accepted": None,
    "verify": False,
}
_LAYER_ARGUMENTS = _Arguments("kda_decode_layer", LAYER_OPTIONS, ("variant",))


class ShortConv(NamedTuple):
    """The short convolutions of q, k and v (width ``specs.CONV_WIDTH``): their weights, optional
    biases and conv states as given (one packed tensor or a (q, k, v) tuple each), and the conv
    states' layout: "dim" (``[slots, C, W − 1]``) or "token" (``[slots, W − 1, C]``)."""

    weight: object
    bias: object
    state: object
    layout: str


class OutputNorm(NamedTuple):
    """The sigmoid-gated RMSNorm after the KDA step: its output-gate input, weight and eps."""

    gate: torch.Tensor
    weight: torch.Tensor
    eps: object


class Speculation(NamedTuple):
    """A layer call's speculative part: the draft buffers (``cula_aot.drafts.Drafts``), the
    accepted tokens of each request's pending draft, and whether this call is a draft itself."""

    drafts: object
    num_accepted: torch.Tensor | None
    verify: object


class DecodeLayerCall(NamedTuple):
    """One fused decode-layer call (see ``cula_aot.kda_decode_layer``): the KDA step's arguments
    as a ``DecodeCall`` (no intermediate states), the convolutions, the output norm and the
    speculative part."""

    step: DecodeCall
    conv: ShortConv
    norm: OutputNorm
    speculation: Speculation

    @classmethod
    def of(cls, arguments: dict) -> "DecodeLayerCall":
        """From ``kda_decode_layer``'s arguments by name."""
        o = _LAYER_ARGUMENTS(arguments)
        conv = (o["conv_weight"], o["conv_bias"], o["conv_state"], o["conv_layout"])
        norm = (o["out_gate"], o["norm_weight"], o["norm_eps"])
        speculation = (o["drafts"], o["num_accepted"], o["verify"])
        return cls.bind(*_step_of(o), o["status"], conv, norm, speculation, o.get("variant"))

    @classmethod
    def bind(cls, inputs, pool, slots, out, tokens, layout, status, conv, norm, speculation, variant=None):
        """The call by position: the step's fields (``DecodeCall``, without intermediate states or
        accepted tokens), then the fields of ``ShortConv``, ``OutputNorm`` and ``Speculation`` as
        tuples (``kda_decode_layer`` binds its arguments itself: see ``DecodeCall.bind``)."""
        step = _new(DecodeCall, (inputs, pool, slots, out, tokens, layout, None, status, None, variant))
        return _new(cls, (step, _new(ShortConv, conv), _new(OutputNorm, norm), _new(Speculation, speculation)))

    def signature(self) -> tuple:
        """The layer plan cache's key: the step's (``DecodeCall.signature``), and the layouts of the
        convolutions' and the norm's tensors and of the speculative ones (a packed argument as one
        tensor, a (q, k, v) tuple as three), and the options a plan fixes."""
        step, (weight, bias, state, layout), (z, w, _), (drafts, accepted, verify) = self
        return (
            step.signature(),
            _layout_of(weight),
            _layout_of(bias),
            _layout_of(state),
            _layout_of(drafts),
            z.shape,
            z.stride(),
            z.dtype,
            z.get_device(),
            w.shape,
            w.stride(),
            w.dtype,
            w.get_device(),
            _layout_of(accepted),
            layout,
            verify,
        )


def _layout_of(x):
    """A tensor's layout (shape, strides, dtype, device index), a tuple of tensors' (one each), or
    None."""
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return x.shape, x.stride(), x.dtype, x.get_device()
    return tuple([None if t is None else (t.shape, t.stride(), t.dtype, t.get_device()) for t in x])


def _parts(x) -> tuple:
    """A packed argument as one part, a (q, k, v) tuple as its parts, None as none."""
    if x is None:
        return ()
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)
