"""The fused layer's cached plans and ``DecodeLayerStep`` on the CPU: a fake loader over the real
manifest records captures the packed parameters, so the per-call values, the per-call re-checks
and the step's guard over its fixed tensors are checked without a GPU."""

import pytest
import torch

import cula_aot
from cula_aot import KDAInputError
from cula_aot.ops import checks, decode_layer, plan_cache
from cula_aot.runtime.loader import LoadedKernel
from cula_aot.runtime.manifest import Manifest
from tests.decode_helpers import fused_inputs

N, T, H, D = 3, 2, 4, 128
C = H * D


@pytest.fixture
def launches(monkeypatch):
    manifest, recorded = Manifest.discover(), []

    class FakeLoader:
        def get(self, device, spec):
            name, record = manifest.record(spec)
            kernel = LoadedKernel(name, record, function=None)

            def launch_packed(packed, grid, stream, smem_bytes=None, dependent=False):
                recorded.append(dict(zip(kernel.packer.names, kernel.packer.struct.unpack(packed))))

            kernel.launch_packed = launch_packed
            return kernel

    loader = FakeLoader()
    monkeypatch.setattr(decode_layer, "default_loader", lambda: loader)
    monkeypatch.setattr(checks, "check_device", lambda device: None)
    monkeypatch.setattr(plan_cache, "raw_stream", lambda device: 0)
    monkeypatch.setattr(decode_layer, "_PLANS", plan_cache.LaunchPlans(decode_layer._LayerPlan))
    return recorded


def _fixed():
    return dict(
        conv_weight=torch.zeros(3 * C, 4, dtype=torch.bfloat16),
        conv_state=torch.zeros(N + 2, 3 * C, 3, dtype=torch.bfloat16),
        norm_weight=torch.ones(D, dtype=torch.bfloat16),
        state_pool=torch.zeros(N + 2, H, D, D),
        A_log=torch.zeros(H),
        dt_bias=torch.zeros(H, D),
        lower_bound=-5.0,
        drafts=cula_aot.draft_buffers(N + 2, H),
    )


def _per_call(seed):
    x = fused_inputs(N, T, H, device="cpu", seed=seed)
    return dict(
        q=x["q"],
        k=x["k"],
        v=x["v"],
        g=x["g"],
        beta=x["beta"],
        out_gate=x["g"].clone(),
        state_indices=torch.tensor([0, 3, -1], dtype=torch.int32),
        num_accepted=torch.zeros(N, dtype=torch.int32),
    )


def _step_call(step, per_call, **options):
    p = dict(per_call)
    accepted = p.pop("num_accepted")
    return step(*p.values(), num_accepted=accepted, **options)


def _layer_call(fixed, per_call, **options):
    p = dict(per_call)
    inputs = [p.pop(name) for name in ("q", "k", "v", "g", "beta")]
    return cula_aot.kda_decode_layer(*inputs, **fixed, **p, **options)


def test_the_step_launches_what_the_layer_call_launches(launches):
    fixed, per_call = _fixed(), _per_call(1)
    out = torch.empty(N, T, H, D, dtype=torch.bfloat16)
    step = cula_aot.DecodeLayerStep(**fixed)
    _step_call(step, per_call, verify=True, out=out)
    _step_call(step, _per_call(2), verify=True, out=out)
    _layer_call(fixed, per_call, verify=True, out=out)
    assert len(launches) == 3
    assert launches[0] == launches[2], "the step and kda_decode_layer packed different parameters"
    assert launches[0]["q"] != launches[1]["q"], "a second call reused the first call's addresses"


def test_a_changed_fixed_tensor_is_validated_again(launches):
    fixed = _fixed()
    step = cula_aot.DecodeLayerStep(**fixed)
    _step_call(step, _per_call(1))
    fixed["drafts"].marks.zero_()  # a torch write bumps the version: looked up in full, still valid
    _step_call(step, _per_call(2))
    assert len(launches) == 2
    fixed["norm_weight"].resize_(D + 1)  # an in-place layout change: refused before any launch
    with pytest.raises(KDAInputError, match=r"norm_weight must have shape \[128\]"):
        _step_call(step, _per_call(3))
    fixed["conv_state"].data = torch.zeros(N + 2, 2 * C, 3, dtype=torch.bfloat16)  # `.data =`: a new address
    fixed["norm_weight"].resize_(D)
    with pytest.raises(KDAInputError, match="conv_state packed must have"):
        _step_call(step, _per_call(4))
    assert len(launches) == 2


def test_a_cached_plan_still_checks_each_calls_addresses(launches):
    fixed, per_call = _fixed(), _per_call(1)
    step = cula_aot.DecodeLayerStep(**fixed)
    out = torch.empty(N, T, H, D, dtype=torch.bfloat16)
    _step_call(step, per_call, out=out)
    aliased = fixed["conv_state"].view(torch.bfloat16).view(-1)[: out.numel()].view(out.shape)
    with pytest.raises(KDAInputError, match=r"out must not alias conv_state_q"):
        _step_call(step, per_call, out=aliased)
    assert len(launches) == 1


def test_a_repeated_layer_call_launches_its_checked_parameters(launches):
    """``kda_decode_layer`` keeps what a call's check gave by its arguments: the repeat launches the
    same parameters; a changed address or option is checked again before any launch; a call whose
    binding makes tensors (g converted to bf16) launches without being kept."""
    fixed, per_call = _fixed(), _per_call(1)
    out = torch.empty(N, T, H, D, dtype=torch.bfloat16)
    _layer_call(fixed, per_call, verify=True, out=out)
    _layer_call(fixed, per_call, verify=True, out=out)
    assert len(launches) == 2 and launches[0] == launches[1]
    assert len(decode_layer._PLANS.launches) == 1
    aliased = fixed["conv_state"].view(-1)[: out.numel()].view(out.shape)
    with pytest.raises(KDAInputError, match=r"out must not alias conv_state_q"):
        _layer_call(fixed, per_call, verify=True, out=aliased)
    with pytest.raises(KDAInputError, match=r"beta_sigmoid must be True or False, got 1"):
        _layer_call(fixed, per_call, verify=True, out=out, beta_sigmoid=1)
    assert len(launches) == 2
    _layer_call(fixed, {**per_call, "g": per_call["g"].float()}, verify=True, out=out)
    assert len(launches) == 3 and len(decode_layer._PLANS.launches) == 1
    _layer_call(fixed, per_call, verify=True)  # out allocated: the kept values with its address
    assert len(launches) == 4 and launches[3]["out"] != launches[0]["out"]
    assert {**launches[3], "out": 0} == {**launches[0], "out": 0}
