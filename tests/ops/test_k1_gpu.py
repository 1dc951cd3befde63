"""AOT K1 on the GPU against the float64 reference, workspace by workspace (CONTRACT §3, §8)."""

import pytest
import torch

from cula_aot import reference
from cula_aot.layout import decode_k_inter
from cula_aot.ops.prepare import DEFAULT_SCALE, prepare
from cula_aot.ops.workspace import ARENA
from tests.helpers import cu_seqlens_of, fresh_seed, standard_inputs, tile_slots

pytestmark = pytest.mark.gpu

LENGTHS = [1, 15, 16, 17, 100, 4097]
BF16_ULP = 2.0**-7  # one bf16 ulp, relative


def _run_k1(inputs, cu_seqlens):
    # Poison the whole arena: every byte 0xFF is NaN in bf16 and fp32.
    device = inputs["q"].device
    ARENA.buffer(device, 1, torch.cuda.current_stream(device).cuda_stream).fill_(0xFF)
    ws = prepare(
        inputs["q"],
        inputs["k"],
        inputs["g"],
        inputs["beta"],
        A_log=inputs["A_log"],
        dt_bias=inputs["dt_bias"],
        lower_bound=inputs["lower_bound"],
        scale=DEFAULT_SCALE,
        cu_seqlens=cu_seqlens,
    )
    torch.cuda.synchronize()
    return ws


def _gather(ws, slots, heads):
    """Kernel workspaces reordered like the reference tiles: [n_tiles, H, ...] float64."""
    idx = torch.tensor([[h * ws.total_slots + s for h in range(heads)] for s in slots], device=ws.qd.device)
    out = {name: ws.views[name][idx].double() for name in ws.views}
    for name in ("qd", "kd", "kr"):
        out[name] = decode_k_inter(out[name])
    out["inv"] = out["inv"].view(*idx.shape, 16, 16)
    out["mqk"] = out["mqk"].view(*idx.shape, 16, 16)
    return out


def _check_close_ulps(name, got, want, floor):
    """|got − want| ≤ 2 bf16 ulps of want + floor, elementwise; returns the max error in ulps."""
    assert torch.isfinite(got).all(), f"{name}: unwritten (poison) or non-finite elements"
    err = (got - want).abs()
    bound = 2 * BF16_ULP * want.abs() + floor
    worst = float((err / (BF16_ULP * want.abs() + floor)).max())
    assert bool((err <= bound).all()), f"{name}: max error {worst:.2f} ulps"
    return worst


def _references(inputs, cu_seqlens, scale=DEFAULT_SCALE, lower_bound=None):
    kwargs = dict(
        A_log=inputs["A_log"],
        dt_bias=inputs["dt_bias"],
        scale=scale,
        cu_seqlens=cu_seqlens,
        lower_bound=inputs["lower_bound"] if lower_bound is None else lower_bound,
    )
    return reference.prepare_tiles(inputs["q"], inputs["k"], inputs["g"], inputs["beta"], **kwargs)


# L and Mqk come from fp32 operands, so fp32 work (G = cumsum of up to 16 γ with |G| ≤ 80, exp,
# 128-term dots) costs ≲ 3e-4 of the sum of |terms|.  But q̂, k̂ are bf16 roundings of a norm the
# kernel takes with rsqrt.approx: an element within ~2⁻²³ of a rounding boundary lands one ulp
# from the float64 reference's (seen: ~1 in 3·10⁴ elements), moving its term by ≤ 2⁻⁷ relative.
# That bounds the error by 2⁻⁷ of the sum of |terms| (measured worst: 4·10⁻³ of it).
TERM_BOUND = BF16_ULP


def _compare(ws, inputs, cu_seqlens, slots, heads, label):
    """Every workspace against the exact float64 reference: qd/kd/kr/gt/b elementwise, mqk
    and inv within two bf16 ulps (their storage) plus the operand bound above."""
    exact = _references(inputs, cu_seqlens)
    got = _gather(ws, slots, heads)
    # b = σ(β) in fp32 (approximate ex2 and rcp: ~1e-7 relative), exactly 0 on padded rows.
    assert torch.equal(got["b"] == 0, exact["b"] == 0), f"{label}: b is not 0 exactly on the padded rows"
    assert float(((got["b"] - exact["b"]).abs() / exact["b"].clamp_min(1e-30)).max()) < 1e-6, label
    report = {}
    for name in ("qd", "kd", "kr"):
        scale = exact[name].abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
        report[name] = _check_close_ulps(name, got[name], exact[name], 1e-6 * scale)
        report[name + "_rmse"] = reference.rel_rmse(got[name], exact[name])
    report["gt_rmse"] = reference.rel_rmse(got["gt"], exact["gt"])
    assert float(((got["gt"] - exact["gt"]).abs() / exact["gt"]).max()) < 1e-4, label
    absprod = exact["qd"].abs() @ exact["kinv"].abs().transpose(-1, -2)
    report["mqk"] = _check_close_ulps("mqk", got["mqk"], exact["mqk"], TERM_BOUND * absprod.tril() + 1e-30)
    report["mqk_rmse"] = reference.rel_rmse(got["mqk"], exact["mqk"])
    # First-order perturbation of the inverse: Δ(A⁻¹) = −A⁻¹·ΔA·A⁻¹, |ΔL| ≤ TERM_BOUND·b·|kd|·|kinv|ᵀ.
    l_abs = exact["b"].unsqueeze(-1) * (exact["kd"].abs() @ exact["kinv"].abs().transpose(-1, -2))
    propagated = exact["inv"].abs() @ (TERM_BOUND * l_abs.tril(-1)) @ exact["inv"].abs()
    report["inv"] = _check_close_ulps("inv", got["inv"], exact["inv"], 2 * propagated + 1e-6)
    report["inv_rmse"] = reference.rel_rmse(got["inv"], exact["inv"])
    print(f"K1 {label}: " + ", ".join(f"{k}={v:.3g}" for k, v in report.items()))
    return report


@pytest.mark.parametrize("heads", [1, 8, 64])
@pytest.mark.parametrize("slow_decay", [False, True])
def test_k1_varlen_matches_reference(heads, slow_decay):
    seed = fresh_seed()
    inputs = standard_inputs(1, sum(LENGTHS), heads, device="cuda", seed=seed, slow_decay=slow_decay)
    cu = cu_seqlens_of(LENGTHS, device="cuda")
    ws = _run_k1(inputs, cu)
    _compare(ws, inputs, cu, tile_slots(LENGTHS), heads, f"varlen H={heads} slow={slow_decay} seed={seed}")


@pytest.mark.parametrize("heads", [1, 8, 64])
@pytest.mark.parametrize("batch,seq_len", [(1, 1), (1, 15), (1, 16), (2, 17), (1, 100), (1, 4097)])
def test_k1_fixed_matches_reference(heads, batch, seq_len):
    seed = fresh_seed()
    inputs = standard_inputs(batch, seq_len, heads, device="cuda", seed=seed)
    ws = _run_k1(inputs, None)
    _compare(ws, inputs, None, tile_slots(batch, seq_len), heads, f"fixed B={batch} T={seq_len} H={heads} seed={seed}")


def test_k1_int64_cu_seqlens_and_runtime_scalars():
    # scale and lower_bound are runtime values: new values need no build and change the result.
    inputs = standard_inputs(1, 300, 8, device="cuda")
    cu = cu_seqlens_of([100, 7, 193], device="cuda").long()
    for lower_bound, scale in ((-5.0, DEFAULT_SCALE), (-0.3, 0.25)):
        inputs["lower_bound"] = lower_bound
        ARENA.buffer(inputs["q"].device, 1, torch.cuda.current_stream(inputs["q"].device).cuda_stream).fill_(0xFF)
        ws = prepare(
            inputs["q"],
            inputs["k"],
            inputs["g"],
            inputs["beta"],
            A_log=inputs["A_log"],
            dt_bias=inputs["dt_bias"],
            lower_bound=lower_bound,
            scale=scale,
            cu_seqlens=cu,
        )
        exact = _references(inputs, cu, scale=scale, lower_bound=lower_bound)
        got = _gather(ws, tile_slots([100, 7, 193]), 8)
        assert reference.rel_rmse(got["qd"], exact["qd"]) < 5e-3
        assert reference.rel_rmse(got["gt"], exact["gt"]) < 1e-5


def test_k1_is_deterministic():
    inputs = standard_inputs(1, sum(LENGTHS), 8, device="cuda")
    cu = cu_seqlens_of(LENGTHS, device="cuda")
    first = {k: v.clone() for k, v in _run_k1(inputs, cu).views.items()}
    second = _run_k1(inputs, cu).views
    slots = torch.tensor(
        [h * (first["qd"].shape[0] // 8) + s for h in range(8) for s in tile_slots(LENGTHS)], device="cuda"
    )
    for name in first:
        assert torch.equal(first[name][slots].view(torch.uint8), second[name][slots].view(torch.uint8)), name
