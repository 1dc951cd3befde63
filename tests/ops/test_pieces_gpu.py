"""Certified-truncation pieces (``intracard_cp="truncated"``) on both paths, the fused kernel over a
piece table and (``fused=False``) K1, tile bounds and the walking segmented K2, against float64 and
the serial path in every decay regime.  Standard decay certifies within a few tiles (pieces start
from zero); slow decay never within the fused pieces' two warm-up tiles and on the walking path on
the long sequences only; the mixed regime (and a head with one long-memory channel) never, so
those pieces take their predecessor's end state (fused) or run from their sequence's start
(walking) and must be exact."""

import pytest
import torch

from cula_aot import reference
from tests.helpers import cu_seqlens_of, float64_prefill, fresh_seed, prefill_kv, standard_inputs

pytestmark = pytest.mark.gpu

BOUND = 1e-2  # CONTRACT §8
LONG_MEMORY = -12.0


CASES = [("varlen", [4096, 1, 63, 1100, 129], 4), ("fixed", (2, 4100), 3), ("varlen", [16384], 2)]


@pytest.mark.parametrize("fused", [None, False], ids=["fused pieces", "walking K2"])
@pytest.mark.parametrize("regime", ["standard", "mixed", "slow", "one long-memory channel"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_pieces_match_float64_and_the_serial_path(case, regime, fused):
    kind, shape, heads = CASES[case]
    batch, total = (1, sum(shape)) if kind == "varlen" else shape
    x = standard_inputs(batch, total, heads, device="cuda", seed=fresh_seed(), slow_decay=regime == "slow")
    if regime == "mixed":
        x["dt_bias"][:, :4] = LONG_MEMORY
    elif regime == "one long-memory channel":
        x["dt_bias"][heads - 1, 77] = LONG_MEMORY
    cu = cu_seqlens_of(shape, "cuda") if kind == "varlen" else None
    n = len(shape) if kind == "varlen" else batch
    gen = torch.Generator(device="cpu").manual_seed(fresh_seed())
    s0 = (0.1 * torch.randn(n, heads, 128, 128, generator=gen)).cuda()
    layout = ("vk", "kv")[case % 2]
    o, s = prefill_kv(x, s0, cu, "truncated", layout, fused=fused)
    o_serial, s_serial = prefill_kv(x, s0, cu, False, layout)
    ref_o, ref_s = float64_prefill(x, s0, cu)
    assert reference.rel_rmse(o, ref_o) <= BOUND and reference.rel_rmse(s, ref_s) <= BOUND
    # Against the serial kernels: the same roundings except where a piece dropped a certified
    # state (≤ 2^-20 of it) or rounds S to bf16 at other tiles (pieces restart the state).
    assert reference.rel_rmse(o, o_serial) <= 5e-3 and reference.rel_rmse(s, s_serial) <= 5e-3
