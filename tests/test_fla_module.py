"""``cula_aot.fla``: fla's calling convention mapped onto ``kda_prefill`` (CPU: the call a given
set of fla arguments becomes, and the reasons for what the kernels do not run)."""

import re

import pytest
import torch

import cula_aot.fla as fla_route
from cula_aot import KDAInputError
from tests.helpers import standard_inputs


@pytest.fixture
def x():
    return standard_inputs(1, 40, 2, seed=0)


@pytest.fixture
def calls(monkeypatch):
    seen = []
    monkeypatch.setattr(fla_route, "kda_prefill", lambda *args, **kwargs: seen.append((args, kwargs)) or ("o", None))
    return seen


def _qkvgb(x):
    return x["q"], x["k"], x["v"], x["g"], x["beta"]


def _flags(**changes):
    """The flags fla's KimiDeltaAttention layer passes, with ``changes``."""
    return {**dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True), **changes}


def test_chunk_kda_softplus_maps_fla_defaults_and_layouts(x, calls):
    dt = x["dt_bias"].reshape(-1)  # fla's flat [H·K] dt_bias
    fla_route.chunk_kda(
        *_qkvgb(x),
        A_log=x["A_log"],
        dt_bias=dt,
        initial_state=None,
        output_final_state=True,
        state_v_first=True,
        **_flags(),
    )
    ((_, kwargs),) = calls
    assert kwargs["gate"] == "softplus" and "lower_bound" not in kwargs and kwargs["state_layout"] == "vk"
    assert kwargs["dt_bias"].shape == (2, 128) and torch.equal(kwargs["dt_bias"].reshape(-1), dt)
    assert kwargs["output_final_state"] is True
    calls.clear()
    fla_route.chunk_kda(*_qkvgb(x), A_log=None, dt_bias=None, **_flags())
    ((_, kwargs),) = calls
    assert kwargs["state_layout"] == "kv"  # fla's default [N, H, K, V]
    assert torch.equal(kwargs["A_log"], torch.zeros(2)) and torch.equal(kwargs["dt_bias"], torch.zeros(2, 128))


def test_chunk_kda_safe_and_precomputed_gates(x, calls):
    fla_route.chunk_kda(
        *_qkvgb(x), A_log=x["A_log"], dt_bias=x["dt_bias"], safe_gate=True, lower_bound=-5.0, **_flags()
    )
    fla_route.chunk_kda(*_qkvgb(x), **_flags(use_gate_in_kernel=False))
    (_, safe), (_, pre) = calls
    assert safe["gate"] == "safe" and safe["lower_bound"] == -5.0
    assert pre == {**pre, "gate": "precomputed"} and "A_log" not in pre
    with pytest.raises(KDAInputError, match="safe_gate=True needs a lower_bound"):
        fla_route.chunk_kda(*_qkvgb(x), safe_gate=True, **_flags())


def test_recurrent_entry_updates_states_in_place_as_a_pool(x, calls):
    state = torch.zeros(1, 2, 128, 128)
    o, final = fla_route._recurrent(*_qkvgb(x), A_log=x["A_log"], dt_bias=x["dt_bias"], initial_state=state, **_flags())
    ((_, kwargs),) = calls
    assert final is state and kwargs["final_state"] is state and kwargs["initial_state"] is state
    assert kwargs["state_indices"].tolist() == [0] and kwargs["state_indices"].dtype == torch.int32
    calls.clear()
    fla_route.fused_recurrent_kda(
        *_qkvgb(x), x["A_log"], x["dt_bias"], initial_state=state, output_final_state=True, lower_bound=-3.0, **_flags()
    )
    ((_, kwargs),) = calls
    assert kwargs["gate"] == "safe" and kwargs["lower_bound"] == -3.0 and "state_indices" not in kwargs


@pytest.mark.parametrize("l2norm, sigmoid", [(True, True), (False, True), (True, False), (False, False)])
def test_fla_input_conventions_become_the_kernels(x, calls, l2norm, sigmoid):
    fla_route.chunk_kda(*_qkvgb(x), **_flags(use_qk_l2norm_in_kernel=l2norm, use_beta_sigmoid_in_kernel=sigmoid))
    state = torch.zeros(1, 2, 128, 128)
    fla_route._recurrent(
        *_qkvgb(x), initial_state=state, **_flags(use_qk_l2norm_in_kernel=l2norm, use_beta_sigmoid_in_kernel=sigmoid)
    )
    for _, kwargs in calls:
        assert kwargs["qk_l2norm"] is l2norm and kwargs["beta_sigmoid"] is sigmoid


def test_fp32_precomputed_gate_and_beta_are_accepted(x, calls):
    g = -torch.rand(x["g"].shape)  # fp32 log-decay, as fla's callers pass a precomputed gate
    beta = torch.rand(x["beta"].shape)  # fp32 probabilities
    assert fla_route.unsupported(x["q"], x["k"], x["v"], g, beta, **_flags()) is None
    fla_route.chunk_kda(
        x["q"], x["k"], x["v"], g, beta, **_flags(use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False)
    )
    ((args, kwargs),) = calls
    assert kwargs["gate"] == "precomputed" and kwargs["beta_sigmoid"] is False
    assert args[3] is g and args[4] is beta  # kda_prefill rounds them (tests/ops/test_serial_plan.py)


@pytest.mark.parametrize(
    "change, reason",
    [
        (dict(allow_neg_eigval=True), "allow_neg_eigval"),
        (dict(return_intermediate_states=True), "intermediate"),
        (dict(cp_context=object()), "context parallelism"),
    ],
)
def test_unsupported_flags_are_named(x, change, reason):
    assert reason in fla_route.unsupported(*_qkvgb(x), **_flags(**change))
    with pytest.raises(KDAInputError, match=reason.split("=")[0]):
        fla_route.chunk_kda(*_qkvgb(x), **_flags(**change))


def test_unsupported_shapes_and_dtypes(x):
    q, k, v, g, beta = _qkvgb(x)
    assert "GVA" in fla_route.unsupported(q, k, torch.cat([v, v], 2), g, beta, **_flags())
    assert "bf16" in fla_route.unsupported(q.float(), k, v, g, beta, **_flags())
    assert "bf16" in fla_route.unsupported(q, k, v, g.half(), beta, **_flags())
    assert "head-wise" in fla_route.unsupported(q, k, v, g, beta[..., None].expand(-1, -1, -1, 128), **_flags())
    assert fla_route.unsupported(q, k, v, g, beta, **_flags()) is None


def test_backend_refuses_gradients_and_cpu(x):
    with torch.enable_grad():
        ok, reason = fla_route._verdict({"q": x["q"]})
    assert not ok and "inference_mode" in reason
    with torch.no_grad():
        ok, reason = fla_route._verdict({"q": x["q"]})
    assert not ok and "sm_90" in reason


def _speculative(n=3, tokens=4, heads=2):
    """vLLM's speculative call on fla's recurrent entry: N sequences of T tokens as one varlen
    batch, a state slot per token, the accepted tokens of each sequence's last draft."""
    x = standard_inputs(1, n * tokens, heads, seed=1)
    slots = torch.arange(n * tokens, dtype=torch.int64).view(n, tokens)
    extra = dict(
        initial_state=torch.zeros(n * tokens + 1, heads, 128, 128),
        inplace_final_state=True,
        cu_seqlens=torch.arange(n + 1) * tokens,
        ssm_state_indices=slots,
        num_accepted_tokens=torch.tensor([1, tokens, 2][:n]),
        A_log=x["A_log"],
        dt_bias=x["dt_bias"],
        lower_bound=-5.0,
    )
    return x, extra


def test_per_token_state_indices_run_kda_decodes_token_slots(monkeypatch):
    seen = []

    def fake_decode(*args, **kwargs):
        seen.append((args, kwargs))
        return torch.zeros(*args[0].shape, dtype=torch.bfloat16)

    monkeypatch.setattr(fla_route, "kda_decode", fake_decode)
    x, extra = _speculative()
    assert fla_route.unsupported(*_qkvgb(x), **_flags(), **extra) is None
    o, final = fla_route._recurrent(*_qkvgb(x), **_flags(), **extra)
    ((args, kwargs),) = seen
    assert [list(t.shape) for t in args[:4]] == [[3, 4, 2, 128]] * 4 and list(args[4].shape) == [3, 4, 2]
    assert args[0].data_ptr() == x["q"].data_ptr() and args[0][1, 2].equal(x["q"][0, 6])  # views, token order kept
    assert kwargs["state_pool"] is extra["initial_state"] and final is extra["initial_state"]
    assert kwargs["state_indices"].dtype == torch.int32 and kwargs["state_indices"].equal(
        extra["ssm_state_indices"].int()
    )
    assert kwargs["num_accepted"].tolist() == [1, 4, 2] and kwargs["num_accepted"].dtype == torch.int32
    assert kwargs["gate"] == "safe" and kwargs["qk_l2norm"] and kwargs["beta_sigmoid"] and "cu_seqlens" not in kwargs
    assert list(o.shape) == [1, 12, 2, 128]


def test_block_table_slices_reach_the_kernels_as_contiguous_int32(x, calls, monkeypatch):
    """vLLM outside full CUDA graphs passes column slices of its int32 block table (rows the
    table's width apart), which ``check_slot_indices`` refuses as they are: the mapping copies."""
    table = torch.arange(40, dtype=torch.int32).view(5, 8)
    state = torch.zeros(8, 2, 128, 128)
    fla_route._recurrent(
        *_qkvgb(x),
        A_log=x["A_log"],
        dt_bias=x["dt_bias"],
        initial_state=state,
        ssm_state_indices=table[:1, 3],
        **_flags(),
    )
    ((_, kwargs),) = calls
    assert kwargs["state_indices"].is_contiguous() and kwargs["state_indices"].tolist() == [3]
    seen = []
    monkeypatch.setattr(
        fla_route, "kda_decode", lambda *a, **kw: seen.append(kw) or torch.zeros(*a[0].shape, dtype=torch.bfloat16)
    )
    s, extra = _speculative()
    extra["ssm_state_indices"] = table[:3, 2:6]
    fla_route._recurrent(*_qkvgb(s), **_flags(), **extra)
    (kwargs,) = seen
    assert kwargs["state_indices"].is_contiguous() and kwargs["state_indices"].equal(table[:3, 2:6])


@pytest.mark.parametrize(
    "change, reason",
    [
        (dict(inplace_final_state=False), "inplace_final_state=True"),
        (dict(cu_seqlens=torch.tensor([0, 3, 12])), r"need 3 sequences of 4 tokens"),
        (dict(ssm_state_indices=torch.zeros(3, 9, dtype=torch.int32)), "T = 1..8"),
        (dict(ssm_state_indices=torch.zeros(4, 3, dtype=torch.int32)), r"need 4 sequences of 3 tokens"),
        (
            dict(ssm_state_indices=torch.zeros(3, dtype=torch.int32)),
            r"num_accepted_tokens needs ssm_state_indices \[N, T\]",
        ),
    ],
)
def test_per_token_state_indices_outside_kda_decode_are_named(change, reason):
    x, extra = _speculative()
    assert re.search(reason, fla_route.unsupported(*_qkvgb(x), **_flags(), **{**extra, **change}))


def test_per_token_state_indices_need_bf16_gate_inputs():
    x, extra = _speculative()
    q, k, v, g, beta = _qkvgb(x)
    assert "bf16 g and β" in fla_route.unsupported(q, k, v, g.float(), beta, **_flags(), **extra)
