"""fla's input conventions on the GPU: β as probabilities (``beta_sigmoid=False``) and q, k used
as given (``qk_l2norm=False``), in every path that runs them — K1 then K2 (where the fused
kernel would run the default conventions), fixed length, intracard CP and both decode kernels —
against the float64 reference under the same conventions, outputs poisoned with NaN, on
standard and slow-decay inputs.

The inputs tell the conventions apart: given q and k are unit vectors scaled by U(0.3, 1) per
row (a kernel that normalised them anyway would be off by that factor), and probabilities in
(0, 1) differ from σ of themselves (a kernel that applied σ would give 0.5–0.73)."""

import pytest
import torch

import cula_aot
from cula_aot import reference
from cula_aot.ops.prefill import prefill
from tests.decode_helpers import decode_reference, from_pool_layout, to_pool_layout
from tests.helpers import cu_seqlens_of, fresh_seed, standard_inputs

pytestmark = pytest.mark.gpu

BOUND = 5e-3
CONVENTIONS = [(False, True), (True, False), (False, False)]  # (beta_sigmoid, qk_l2norm)


def _inputs(batch, seq_len, heads, gate, slow, beta_sigmoid, qk_l2norm):
    x = standard_inputs(batch, seq_len, heads, device="cuda", gate=gate, slow_decay=slow)
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed())
    if not qk_l2norm:  # the caller normalised them (and shrank some rows)
        for name in ("q", "k"):
            shrink = 0.3 + 0.7 * torch.rand(*x[name].shape[:-1], 1, generator=gen, device="cuda")
            x[name] = (reference.l2norm_bf16(x[name]) * shrink).to(torch.bfloat16)
    if not beta_sigmoid:
        x["beta"] = torch.rand(x["beta"].shape, generator=gen, device="cuda").to(torch.bfloat16)
    return x


def _options(x, beta_sigmoid, qk_l2norm):
    return dict(
        A_log=x.get("A_log"),
        dt_bias=x.get("dt_bias"),
        lower_bound=x.get("lower_bound"),
        gate=x.get("gate", "safe"),
        beta_sigmoid=beta_sigmoid,
        qk_l2norm=qk_l2norm,
    )


def _states(n, heads):
    gen = torch.Generator(device="cpu").manual_seed(fresh_seed())
    return (0.1 * torch.randn(n, heads, 128, 128, generator=gen)).cuda()


@pytest.mark.parametrize("path", ["serial", "auto", "cp", "fixed"])
@pytest.mark.parametrize("slow", [False, True])
@pytest.mark.parametrize("beta_sigmoid, qk_l2norm", CONVENTIONS)
def test_prefill_paths(beta_sigmoid, qk_l2norm, slow, path):
    heads, gate = 3, ("softplus" if slow else "safe")
    lengths = [2048, 700, 33] if path == "cp" else [300, 300] if path == "fixed" else [33, 64, 1000, 1, 257]
    fixed = path == "fixed"
    x = _inputs(
        len(lengths) if fixed else 1, lengths[0] if fixed else sum(lengths), heads, gate, slow, beta_sigmoid, qk_l2norm
    )
    cu = None if fixed else cu_seqlens_of(lengths, "cuda")
    s0 = _states(len(lengths), heads)
    args = [x[name] for name in ("q", "k", "v", "g", "beta")]
    options = _options(x, beta_sigmoid, qk_l2norm)

    def run():
        out = torch.full_like(x["v"], float("nan"))
        final = torch.full((len(lengths), heads, 128, 128), float("nan"), device="cuda")
        o, s = prefill(
            *args,
            **options,
            initial_state=to_pool_layout(s0, "vk").contiguous(),
            cu_seqlens=cu,
            cu_seqlens_cpu=None if cu is None else cu.cpu(),
            out=out,
            final_state=final,
            intracard_cp=4 if path == "cp" else False,
            fused=None if path == "auto" else False,
        )
        torch.cuda.synchronize()
        return o, from_pool_layout(s, "vk")

    o, s = run()
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    ref_o, ref_s = reference.kda_chunked(
        *args,
        A_log=options["A_log"],
        dt_bias=options["dt_bias"],
        lower_bound=options["lower_bound"],
        initial_state=s0,
        cu_seqlens=cu,
        gate_kind=gate,
        beta_sigmoid=beta_sigmoid,
        qk_l2norm=qk_l2norm,
    )
    err_o, err_s = reference.rel_rmse(o, ref_o), reference.rel_rmse(s, ref_s)
    report = (
        f"{path} {gate} slow={slow} beta_sigmoid={beta_sigmoid} qk_l2norm={qk_l2norm}: "
        f"o rel-RMSE {err_o:.2e}, state rel-RMSE {err_s:.2e}"
    )
    print(report)
    assert err_o <= BOUND and err_s <= BOUND, report
    again, _ = run()
    assert torch.equal(o, again), f"{report}: not deterministic"


@pytest.mark.parametrize("tokens, pool", [(1, torch.float32), (3, torch.bfloat16), (6, torch.float32)])
@pytest.mark.parametrize("beta_sigmoid, qk_l2norm", CONVENTIONS)
def test_decode(beta_sigmoid, qk_l2norm, tokens, pool):
    """T = 3 on a bf16 "vk" pool runs the tensor-core chunk kernel, the others the token kernel."""
    n, heads, slots = 4, 5, 7
    x = _inputs(n, tokens, heads, "safe", False, beta_sigmoid, qk_l2norm)
    s0 = _states(n, heads).to(pool)
    indices = torch.tensor([3, 0, -1, 6], dtype=torch.int32, device="cuda")
    state_pool = torch.full((slots, heads, 128, 128), float("nan"), device="cuda", dtype=pool)
    live = indices >= 0
    state_pool[indices[live].long()] = to_pool_layout(s0[live], "vk")
    args = [x[name] for name in ("q", "k", "v", "g", "beta")]
    o = cula_aot.kda_decode(*args, **_options(x, beta_sigmoid, qk_l2norm), state_pool=state_pool, state_indices=indices)
    torch.cuda.synchronize()
    ref_o, ref_states = decode_reference(
        *args,
        A_log=x["A_log"],
        dt_bias=x["dt_bias"],
        lower_bound=x["lower_bound"],
        initial_state=s0.double(),
        beta_sigmoid=beta_sigmoid,
        qk_l2norm=qk_l2norm,
    )
    err_o = reference.rel_rmse(o[live], ref_o[live])
    err_s = reference.rel_rmse(from_pool_layout(state_pool[indices[live].long()], "vk"), ref_states[live][:, -1])
    report = (
        f"decode T={tokens} {pool} beta_sigmoid={beta_sigmoid} qk_l2norm={qk_l2norm}: "
        f"o rel-RMSE {err_o:.2e}, state rel-RMSE {err_s:.2e}"
    )
    print(report)
    assert (o[~live] == 0).all(), report
    bound = 1e-2 if pool == torch.bfloat16 else BOUND  # a bf16 pool rounds the state once per call
    assert err_o <= bound and err_s <= bound, report


def test_torch_ops_take_the_conventions():
    x = _inputs(1, 64, 2, "safe", False, False, False)
    args = [x[name] for name in ("q", "k", "v", "g", "beta")]
    o_op, _ = torch.ops.cula_aot.kda_prefill(
        *args, x["A_log"], x["dt_bias"], x["lower_bound"], beta_sigmoid=False, qk_l2norm=False
    )
    o, _ = cula_aot.kda_prefill(
        *args, A_log=x["A_log"], dt_bias=x["dt_bias"], lower_bound=x["lower_bound"], beta_sigmoid=False, qk_l2norm=False
    )
    torch.cuda.synchronize()
    assert torch.equal(o_op, o)
