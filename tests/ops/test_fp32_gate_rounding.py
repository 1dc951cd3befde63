"""An fp32 precomputed log-decay (vLLM's ``fused_kda_gate`` output) reaches the kernels rounded to
bf16 (``ops.checks.kernel_dtypes``).  That rounding must cost a small part of the kernels' own
error budget (o rel-RMSE ≤ 5e-3 against float64): the exact float64 recurrence on the rounded
g against the same recurrence on the fp32 g, for fast, fla-initialised and slow decay (where
per-channel decays stay nearly constant over the sequence, so rounding errors add up
instead of cancelling)."""

import pytest
import torch

from cula_aot import reference
from cula_aot.ops.checks import kernel_dtypes

ROUNDING_SHARE = 1e-3  # a fifth of the 5e-3 accuracy bar


def _log_decay(regime: str, shape, gen) -> torch.Tensor:
    heads = shape[2]
    scale = torch.rand(heads, generator=gen) * 15 + 1  # e^A_log ~ U(1, 16)
    raw = torch.randn(*shape, generator=gen)
    if regime == "fast":
        bias = 0.1 * torch.randn(heads, shape[3], generator=gen)
    else:  # softplus(dt_bias) ~ U(1e-3, 1e-1) (fla's init) or U(1e-3, 1e-2), small raw gates
        top, spread = (0.1, 0.3) if regime == "fla_init" else (0.01, 0.05)
        bias = torch.log(torch.expm1(torch.rand(heads, shape[3], generator=gen) * (top - 1e-3) + 1e-3))
        raw = spread * raw
    return (-scale[:, None] * torch.nn.functional.softplus(raw + bias)).float()


@pytest.mark.parametrize("regime", ["fast", "fla_init", "slow"])
def test_rounding_an_fp32_log_decay_to_bf16_costs_little_of_the_accuracy_budget(regime):
    gen = torch.Generator().manual_seed(20261204)
    shape = (1, 512, 2, 128)
    q, k, v = (torch.randn(*shape, generator=gen).to(torch.bfloat16) for _ in range(3))
    beta = torch.randn(*shape[:3], generator=gen).to(torch.bfloat16)
    g32 = _log_decay(regime, shape, gen)
    g16, _ = kernel_dtypes(g32, beta)
    assert g16.dtype == torch.bfloat16
    runs = [
        reference.kda_recurrent(q, k, v, g, beta, A_log=None, dt_bias=None, lower_bound=None, gate_kind="precomputed")
        for g in (g32, g16)
    ]
    (o32, s32), (o16, s16) = runs
    o_err, s_err = reference.rel_rmse(o16, o32), reference.rel_rmse(s16, s32)
    print(f"{regime}: mean log-decay {float(g32.mean()):.3g}, o {o_err:.2e}, state {s_err:.2e}")
    assert 0 < o_err <= ROUNDING_SHARE and 0 < s_err <= ROUNDING_SHARE
