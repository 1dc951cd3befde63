"""The call types (``ops.call``) on the CPU: every entry point builds the same call from the same
arguments, the option tables agree with the public signatures, and one state rule speaks with
one voice in prefill, decode and the distributed prefill."""

import inspect

import pytest
import torch

import cula_aot
from cula_aot import KDAInputError, api, torch_op
from cula_aot.ops import call as call_module
from cula_aot.ops import decode, decode_layer, plan_cache, prefill
from cula_aot.ops.call import DECODE_OPTIONS, LAYER_OPTIONS, PREFILL_OPTIONS, DecodeCall, PrefillCall
from tests.helpers import cu_seqlens_of, standard_inputs

H = 2


def _keyword_defaults(function) -> dict:
    return {
        p.name: p.default
        for p in inspect.signature(function).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }


def test_option_tables_are_the_public_signatures():
    assert _keyword_defaults(api.kda_prefill) == PREFILL_OPTIONS
    decode_defaults = {
        name: call_module.REQUIRED if default is inspect.Parameter.empty else default
        for name, default in _keyword_defaults(api.kda_decode).items()
    }
    assert decode_defaults == DECODE_OPTIONS
    layer_defaults = {
        name: call_module.REQUIRED if default is inspect.Parameter.empty else default
        for name, default in _keyword_defaults(api.kda_decode_layer).items()
    }
    assert layer_defaults == LAYER_OPTIONS
    # fwd: the same names (FlashKDA's positional ones first); serial by default.
    fwd = inspect.signature(api.fwd).parameters
    assert set(fwd) - {"q", "k", "v", "g", "beta"} <= set(PREFILL_OPTIONS)
    for name, p in fwd.items():
        if p.default is not inspect.Parameter.empty and name != "intracard_cp":
            assert p.default == PREFILL_OPTIONS[name], name
    assert fwd["intracard_cp"].default is False


def test_positional_entries_build_the_call_of_their_arguments_by_name(monkeypatch):
    """kda_decode, kda_decode_layer and a DecodeLayerStep hand their arguments on by position:
    given a distinct value for every argument, each builds the call that ``of`` builds from them
    by name."""
    monkeypatch.setattr(call_module.Inputs, "bind", classmethod(lambda cls, *arguments: arguments))
    calls = []
    monkeypatch.setattr(decode, "_PLANS", _CapturedDecodePlans(calls))
    monkeypatch.setattr(decode_layer, "_PLANS", _CapturedLayerPlans(calls))

    def step(**given):  # not tensors: the step's full path
        fixed = {name: given.pop(name) for name in inspect.signature(cula_aot.DecodeLayerStep).parameters}
        return cula_aot.DecodeLayerStep(**fixed)(**given)

    for entry, options, of in (
        (api.kda_decode, DECODE_OPTIONS, DecodeCall.of),
        (api.kda_decode_layer, LAYER_OPTIONS, call_module.DecodeLayerCall.of),
        (step, LAYER_OPTIONS, call_module.DecodeLayerCall.of),
    ):
        given = {name: object() for name in ("q", "k", "v", "g", "beta", *options)}
        calls.clear()
        entry(**given)
        assert _same(calls[0], of(given)), entry.__name__


def test_an_unknown_or_missing_option_is_a_type_error():
    x = standard_inputs(1, 16, H, seed=0)
    tensors = [x.pop(n) for n in ("q", "k", "v", "g", "beta")]
    with pytest.raises(TypeError, match="unexpected keyword argument.*: lowerbound"):
        PrefillCall.build(*tensors, lowerbound=-5.0)
    with pytest.raises(TypeError, match=r"kda_decode\(\) missing required argument.*state_pool, state_indices"):
        DecodeCall.build(*tensors, **x)


@pytest.fixture
def captured(monkeypatch):
    calls = []
    monkeypatch.setattr(prefill, "run", lambda call: calls.append(call) or (call.inputs.v, None))
    monkeypatch.setattr(decode, "_PLANS", _CapturedDecodePlans(calls))
    monkeypatch.setattr(decode_layer, "_PLANS", _CapturedLayerPlans(calls))
    return calls


class _CapturedDecodePlans(plan_cache.LaunchPlans):
    """Decode's plan cache recording each bound call a plan is asked for (``kda_decode`` at its
    arguments' first call, the op at every call) and launching nothing: each returns its v."""

    def __init__(self, calls: list):
        super().__init__(decode._DecodePlan)
        self.calls = calls

    def get(self, call):
        self.calls.append(call)
        return _NoLaunch(call.inputs[2])


class _CapturedLayerPlans(plan_cache.LaunchPlans):
    """The layer's plan cache recording each bound call a plan is asked for (every layer entry,
    the eager one at its arguments' first call) and launching nothing: each returns its v."""

    def __init__(self, calls: list):
        super().__init__(decode_layer._LayerPlan)
        self.calls = calls

    def get(self, call):
        self.calls.append(call)
        return _NoLaunch(call.step.inputs[2])


class _NoLaunch:
    def __init__(self, v):
        self.v = v

    def check(self, call):
        return None

    def launch_checked(self, checked, out):
        return self.v

    def run(self, call):
        return self.v


def _same(a, b) -> bool:
    """Two calls equal field by field (tensors by identity)."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a is b if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) else a == b


def test_every_prefill_entry_builds_the_same_call(captured):
    x = standard_inputs(1, 48, H, seed=1)
    tensors = [x.pop(n) for n in ("q", "k", "v", "g", "beta")]
    cu = cu_seqlens_of([16, 32])
    pool = torch.zeros(4, H, 128, 128)
    slots = torch.tensor([2, 0], dtype=torch.int32)
    common = dict(cu_seqlens=cu, state_layout="kv", gate="safe", beta_sigmoid=False, qk_l2norm=True, **x)
    cula_aot.kda_prefill(
        *tensors, **common, initial_state=pool, final_state=pool, state_indices=slots, intracard_cp=False
    )
    torch_op.kda_prefill_pool_op(*tensors, state_pool=pool, state_indices=slots, **common)
    out = torch.empty_like(tensors[2])
    cula_aot.fwd(*tensors, None, out, x["A_log"], x["dt_bias"], x["lower_bound"], pool, pool, cu, state_indices=slots)
    first, pool_op, fwd = captured
    assert _same(first, pool_op)
    assert _same(
        first._replace(out=out, state_layout="vk", inputs=first.inputs._replace(conventions=fwd.inputs.conventions)),
        fwd,
    )
    # The functional op: intracard_cp -1 is "auto", 0 off; the final state is always returned.
    captured.clear()
    cula_aot.kda_prefill(*tensors, **common, output_final_state=True)
    o, final = torch_op.kda_prefill_op(*tensors, **common, output_final_state=True, intracard_cp=-1)
    assert _same(captured[0], captured[1]) and final.shape == (0,)


def test_decode_entries_build_the_same_call(captured):
    x = standard_inputs(3, 2, H, seed=2)
    tensors = [x.pop(n) for n in ("q", "k", "v", "g", "beta")]
    pool, slots = torch.zeros(5, H, 128, 128), torch.tensor([4, -1, 0], dtype=torch.int32)
    cula_aot.kda_decode(*tensors, **x, gate="safe", state_pool=pool, state_indices=slots, num_tokens=2)
    torch_op.kda_decode_op(*tensors, x["A_log"], x["dt_bias"], x["lower_bound"], pool, slots, None, num_tokens=2)
    assert _same(*captured)


def test_layer_entries_build_the_same_call(captured):
    x = standard_inputs(3, 2, H, seed=3)
    tensors = [x.pop(n) for n in ("q", "k", "v", "g", "beta")]
    c = H * 128
    pool, slots = torch.zeros(5, H, 128, 128), torch.tensor([4, -1, 0], dtype=torch.int32)
    fixed = dict(
        conv_weight=torch.zeros(3 * c, 4, dtype=torch.bfloat16),
        conv_state=torch.zeros(5, 3 * c, 3, dtype=torch.bfloat16),
        norm_weight=torch.ones(128, dtype=torch.bfloat16),
        state_pool=pool,
    )
    z = torch.zeros_like(tensors[0])
    drafts = cula_aot.draft_buffers(5, H)
    accepted = torch.zeros(3, dtype=torch.int32)
    options = dict(drafts=drafts, num_accepted=accepted, verify=True, num_tokens=2)
    cula_aot.kda_decode_layer(*tensors, **x, **fixed, out_gate=z, state_indices=slots, **options)
    torch_op.kda_decode_layer_op(
        *tensors, x["A_log"], x["dt_bias"], x["lower_bound"], fixed["conv_weight"], fixed["conv_state"], z,
        fixed["norm_weight"], pool, slots, num_tokens=2, draft_records=drafts.records, draft_marks=drafts.marks,
        num_accepted=accepted, verify=True,
    )  # fmt: skip
    layer_call, op_call = captured
    assert _same(layer_call._replace(speculation=layer_call.speculation._replace(drafts=tuple(drafts))), op_call)


@pytest.mark.parametrize(
    "pool, message",
    [
        (
            torch.zeros(3, H, 128, 128, dtype=torch.float16),
            r"must be torch\.float32 or torch\.bfloat16, got torch\.float16",
        ),
        (torch.zeros(3, H + 1, 128, 128), r"must have shape \[slots >= 1, 2, 128, 128\] \(a pool\)"),
        (torch.zeros(3, H, 128, 128).transpose(2, 3), r"must be contiguous within a slot"),
        (torch.zeros(0, H, 128, 128), r"must have shape \[slots >= 1"),
    ],
)
def test_one_state_rule_in_prefill_and_decode(pool, message):
    x = standard_inputs(2, 1, H, seed=3)
    tensors = [x.pop(n) for n in ("q", "k", "v", "g", "beta")]
    slots = torch.tensor([0, 1], dtype=torch.int32)
    messages = []
    for entry, name in ((cula_aot.kda_prefill, "initial_state"), (cula_aot.kda_decode, "state_pool")):
        with pytest.raises(KDAInputError, match=message) as error:
            entry(*tensors, **x, **{name: pool, "state_indices": slots})
        messages.append(str(error.value).replace(name, "<pool>"))  # the argument's name, in the rule and its fix
    assert messages[0] == messages[1]
