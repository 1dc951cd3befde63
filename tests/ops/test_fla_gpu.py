"""``cula_aot.fla`` on the GPU beside flash-linear-attention itself (skipped without fla).

fla's ``fused_recurrent_kda`` (Triton, token by token, no autotuning) is the peer: our
``chunk_kda`` and ``fused_recurrent_kda`` must agree with it for the softplus and the safe gate,
varlen, with states in both of fla's layouts; with ``register_backend()`` fla's own entry points
run on our kernels under inference mode (bitwise what the module returns) and fall back to fla,
with the reason logged, when gradients are on."""

import importlib
import inspect
import logging

import pytest
import torch

import cula_aot
import cula_aot.fla as fla_route
from cula_aot import reference
from tests.decode_helpers import decode_reference, from_pool_layout
from tests.helpers import bits, cu_seqlens_of, fresh_seed, standard_inputs

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


SPEC_CASES = [  # (gate, state_v_first, pool dtype)
    ("safe", True, torch.float32),
    ("safe", False, torch.bfloat16),
    ("softplus", True, torch.bfloat16),
    ("softplus", False, torch.float32),
]


@pytest.mark.parametrize("gate, state_v_first, dtype", SPEC_CASES)
def test_spec_decode_slots_match_fla(gate, state_v_first, dtype):
    """vLLM's speculative-decoding call of fla's ``fused_recurrent_kda_fwd`` (q, k, v, g
    ``[1, N·T, H, 128]``, ``cu_seqlens`` of T each, ``ssm_state_indices`` ``[N, T]``,
    ``num_accepted_tokens`` ``[N]``, states updated in place in the pool) through
    ``cula_aot.fla._recurrent`` (fla's backend entry) against fla's own Triton kernel on a copy of
    the same pool: outputs and every slot within 1e-2 of fla's and of the float64 recurrence, spare
    slots untouched.  It must run on cula_aot's kernel: bitwise a direct ``kda_decode`` call, and
    what fla's dispatcher returns once our backend is registered."""
    n, tokens, heads = 6, 4, 4
    slots = n * tokens + 5
    seed = fresh_seed()
    # Slow decay, so the state read from slot [n, num_accepted − 1] shows in every output.
    x = standard_inputs(1, n * tokens, heads, device="cuda", seed=seed, gate=gate, slow_decay=gate == "safe")
    if gate == "softplus":
        x["A_log"] = torch.full((heads,), -4.0, device="cuda")
    gen = torch.Generator().manual_seed(seed)
    table = torch.randperm(slots, generator=gen)[: n * tokens].view(n, tokens).to(torch.int32)
    counts = torch.randint(1, tokens + 1, (n,), generator=gen, dtype=torch.int32)
    layout = "vk" if state_v_first else "kv"
    cuda_gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    before = (0.1 * torch.randn(slots, heads, 128, 128, generator=cuda_gen, device="cuda")).to(dtype)
    pools = {name: before.clone() for name in ("fla", "ours", "direct", "dispatched")}
    args = [x[name] for name in ("q", "k", "v", "g", "beta")]
    lower_bound = x.get("lower_bound")  # None: fla's softplus gate
    kwargs = dict(
        A_log=x["A_log"],
        dt_bias=x["dt_bias"].reshape(-1),
        inplace_final_state=True,
        state_v_first=state_v_first,
        cu_seqlens=torch.arange(n + 1, device="cuda") * tokens,
        ssm_state_indices=table.cuda(),
        num_accepted_tokens=counts.cuda(),
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True,
        lower_bound=lower_bound,
    )
    fla_fwd = importlib.import_module("fla.ops.kda.fused_recurrent").fused_recurrent_kda_fwd
    # fla's own Triton kernel: past its backend dispatch, and with gradients on, which our backend
    # declines, should the unwrapping stop short of it.
    with torch.enable_grad():
        o_fla, _ = inspect.unwrap(fla_fwd)(*args, initial_state=pools["fla"], **kwargs)
    with torch.inference_mode():
        o_ours, s_ours = fla_route._recurrent(*args, initial_state=pools["ours"], **kwargs)
        per_seq = [t.view(n, tokens, *t.shape[2:]) for t in args]
        gate_args = dict(gate=gate, A_log=x["A_log"], dt_bias=x["dt_bias"], lower_bound=lower_bound)
        o_direct = cula_aot.kda_decode(
            *per_seq,
            **gate_args,
            state_pool=pools["direct"],
            state_indices=table.cuda(),
            num_accepted=counts.cuda(),
            state_layout=layout,
        )
        fla_route.register_backend()
        o_disp, _ = fla_fwd(*args, initial_state=pools["dispatched"], **kwargs)
    torch.cuda.synchronize()
    report = f"spec decode via fla {gate} state_v_first={state_v_first} {str(dtype)[6:]} seed={seed}"
    assert s_ours is pools["ours"] and o_ours.shape == o_fla.shape
    assert torch.equal(bits(o_ours), bits(o_direct.flatten(0, 1)[None])), f"{report}: not kda_decode's outputs"
    assert torch.equal(bits(pools["ours"]), bits(pools["direct"])), f"{report}: not kda_decode's states"
    assert torch.equal(bits(o_disp), bits(o_ours)), f"{report}: fla's dispatcher did not run cula_aot"
    assert torch.equal(bits(pools["dispatched"]), bits(pools["ours"])), f"{report}: dispatched states differ"

    read = table[torch.arange(n), (counts - 1).long()].long()
    s0 = from_pool_layout(before[read].to(torch.float64), layout)
    ref_o, ref_s = decode_reference(*per_seq, **gate_args, initial_state=s0)
    written = table.flatten().long()
    ours, theirs = (from_pool_layout(pools[name][written], layout) for name in ("ours", "fla"))
    want = ref_s.flatten(0, 1)
    errs = {
        "o vs fla": reference.rel_rmse(o_ours, o_fla),
        "o vs float64": reference.rel_rmse(o_ours.view(n, tokens, heads, 128), ref_o),
        "fla o vs float64": reference.rel_rmse(o_fla.view(n, tokens, heads, 128), ref_o),
        "slots vs fla": max(reference.rel_rmse(ours[i], theirs[i]) for i in range(n * tokens)),
        "slots vs float64": max(reference.rel_rmse(ours[i], want[i]) for i in range(n * tokens)),
        "fla slots vs float64": max(reference.rel_rmse(theirs[i], want[i]) for i in range(n * tokens)),
    }
    report += ": " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items())
    print(report)
    assert max(errs.values()) < 1e-2, report
    spare = [s for s in range(slots) if s not in set(written.tolist())]
    for name in ("ours", "fla"):
        assert torch.equal(bits(pools[name][spare]), bits(before[spare])), f"{report}: {name} wrote a spare slot"
