"""``cula_aot.fla`` on the GPU beside flash-linear-attention itself (skipped without fla).

fla's ``fused_recurrent_kda`` (Triton, token by token, no autotuning) is the peer: our
``chunk_kda`` and ``fused_recurrent_kda`` must agree with it for the softplus and the safe gate,
varlen, with states in both of fla's layouts; with ``register_backend()`` fla's own entry points
run on our kernels under inference mode (bitwise what the module returns) and fall back to fla,
with the reason logged, when gradients are on."""

import logging

import pytest
import torch

import cula_aot.fla as fla_route
from cula_aot import reference
from tests.helpers import cu_seqlens_of, fresh_seed, standard_inputs

pytestmark = pytest.mark.gpu
fla_kda = pytest.importorskip("fla.ops.kda")
fla_backends = pytest.importorskip("fla.backends")

LENGTHS = [100, 1, 37, 300]


def _inputs(gate):
    x = standard_inputs(1, sum(LENGTHS), 4, device="cuda", gate="softplus" if gate == "softplus" else "safe")
    gen = torch.Generator(device="cpu").manual_seed(fresh_seed())
    x["initial_state"] = (0.1 * torch.randn(len(LENGTHS), 4, 128, 128, generator=gen)).cuda()
    x["cu"] = cu_seqlens_of(LENGTHS, "cuda").long()
    return x


def _fla_kwargs(x, gate, state_v_first):
    kwargs = dict(
        A_log=x["A_log"],
        dt_bias=x["dt_bias"].reshape(-1),
        initial_state=x["initial_state"],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True,
        state_v_first=state_v_first,
        cu_seqlens=x["cu"],
    )
    if gate == "safe":
        kwargs["lower_bound"] = -5.0
    return kwargs


@pytest.mark.parametrize("state_v_first", [True, False])
@pytest.mark.parametrize("gate", ["softplus", "safe"])
def test_module_matches_fla(gate, state_v_first):
    x = _inputs(gate)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    kwargs = _fla_kwargs(x, gate, state_v_first)
    with torch.enable_grad():  # fla's own kernel even once our backend is registered (it takes no gradients)
        o_ref, s_ref = fla_kda.fused_recurrent_kda(*args, **kwargs)
    with torch.inference_mode():
        o_chunk, s_chunk = fla_route.chunk_kda(*args, safe_gate=gate == "safe", **kwargs)
        o_rec, s_rec = fla_route.fused_recurrent_kda(*args, **kwargs)
    torch.cuda.synchronize()
    report = (
        f"fla module {gate} state_v_first={state_v_first}: chunk o {reference.rel_rmse(o_chunk, o_ref):.2e} "
        f"state {reference.rel_rmse(s_chunk, s_ref):.2e}; recurrent o {reference.rel_rmse(o_rec, o_ref):.2e}"
    )
    print(report)
    assert s_chunk.shape == s_ref.shape and o_chunk.shape == o_ref.shape
    for got in (o_chunk, o_rec):
        assert reference.rel_rmse(got, o_ref) < 1e-2, report
    for got in (s_chunk, s_rec):
        assert reference.rel_rmse(got, s_ref) < 1e-2, report


def test_fla_entry_points_dispatch_to_cula_aot(caplog, monkeypatch):
    fla_route.register_backend()
    # fla logs a backend's rejection once per process; an earlier test may have had it logged.
    monkeypatch.setattr(fla_backends._get_operation_registry(operation="kda"), "_logged", set())
    x = _inputs("softplus")
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    kwargs = _fla_kwargs(x, "softplus", True)
    with torch.inference_mode():
        o_ours, s_ours = fla_route.chunk_kda(*args, **kwargs)
        o_fla, s_fla = fla_kda.chunk_kda(*args, **kwargs)
        o_rec, s_rec = fla_route.fused_recurrent_kda(*args, **kwargs)
        o_fla_rec, s_fla_rec = fla_kda.fused_recurrent_kda(*args, **kwargs)
    torch.cuda.synchronize()
    assert torch.equal(o_ours, o_fla) and torch.equal(s_ours, s_fla)
    assert torch.equal(o_rec, o_fla_rec) and torch.equal(s_rec, s_fla_rec)
    with caplog.at_level(logging.INFO, logger="fla.backends"), torch.enable_grad():
        o_grad, _ = fla_kda.fused_recurrent_kda(*args, **kwargs)  # fla's own Triton kernel
    torch.cuda.synchronize()
    assert any("cula_aot rejected" in r.getMessage() and "inference_mode" in r.getMessage() for r in caplog.records)
    assert reference.rel_rmse(o_grad, o_rec) < 1e-2
