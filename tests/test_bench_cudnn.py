"""The cuDNN comparison benchmark on the CPU: its decay regimes' inputs and its tables, so a device
call is never spent on a script that draws the wrong regime or cannot report."""

import importlib
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_cudnn.py"
pytestmark = pytest.mark.skipif(not SCRIPT.exists(), reason="benchmarks/ is not part of the installed wheel")


@pytest.fixture(scope="module")
def bench():
    module = importlib.import_module("benchmarks.bench_cudnn")
    assert Path(module.__file__).resolve() == SCRIPT.resolve(), module.__file__
    return module


def test_mixed_regime_is_standard_plus_four_long_memory_channels_per_head(bench):
    heads = 6
    std = bench.draw_inputs(heads, [40, 24], "standard", "cpu", seed=3)
    mixed = bench.draw_inputs(heads, [40, 24], "mixed", "cpu", seed=3)
    long = mixed["dt_bias"] == bench.MIXED_DT_BIAS
    assert long.sum(1).tolist() == [4] * heads
    assert not (std["dt_bias"] == bench.MIXED_DT_BIAS).any()
    assert torch.equal(mixed["dt_bias"][~long], std["dt_bias"][~long])
    for name in ("q", "k", "v", "g", "beta", "A_log", "initial_state"):
        assert torch.equal(mixed[name], std[name]), name
    assert mixed["lower_bound"] == std["lower_bound"] == -5.0
    assert mixed["initial_state"].shape == (2, heads, 128, 128)
    assert mixed["cu"].tolist() == [0, 40, 64] and mixed["lengths"] == [40, 24]
    # Seeded, and not the same channels in every head.
    assert torch.equal(long, bench.draw_inputs(heads, [40, 24], "mixed", "cpu", seed=3)["dt_bias"] == -12.0)
    assert len({tuple(row.nonzero().flatten().tolist()) for row in long}) > 1


def test_slow_regime_is_contracts_slow_decay(bench):
    x = bench.draw_inputs(3, [64], "slow", "cpu", seed=1)
    assert x["lower_bound"] == -0.05
    assert torch.equal(x["A_log"], torch.full((3,), -4.0))
    with pytest.raises(ValueError):
        bench.draw_inputs(3, [64], "fast", "cpu")


def test_tables_mark_a_peer_that_fails_the_reference(bench):
    row = {"row": "h12-1x2048", "H": 12, "lengths": [2048], "T": 2048, "N": 1, "auto_split": 1}
    res = {
        "meta": {"cudnn_reference_ok": {"standard": True, "slow": False}},
        "checks": [
            {"regime": "slow", "H": 4, "lengths": [64, 17], "ours_o": 3e-3, "ours_state": 2e-3, "ours_ok": True}
            | {"cudnn_o": 0.5, "cudnn_state": 0.7, "cudnn_state_as_kv": 4e-3, "cudnn_ok": False}
        ],
        "rows": [
            row | {"regime": "standard", "ours_graph_ms": 0.05, "cudnn_graph_ms": 0.1, "agree_o": 4e-3},
            row | {"regime": "slow", "ours_graph_ms": 0.05, "cudnn_graph_ms": 0.2, "agree_o": 0.3},
            row | {"regime": "slow", "row": "h3-1x32768", "skipped": "time budget"},
        ],
        "errors": [],
    }
    for r in res["rows"][:2]:
        r["agree_state"] = 1e-3
    text = bench.render_markdown(res)
    standard = text.split("## standard decay")[1].split("## slow decay")[0]
    slow = text.split("## slow decay")[1]
    assert "| 2.00× |" in standard and "⚠" not in standard
    assert "| 4.00× |" in slow and "failed the reference check" in slow and "o differs from ours" in slow
    assert "skipped (time budget)" in slow
    assert "cuDNN FAILS (its state is [K, V])" in text
    assert "Geometric mean cuDNN ÷ ours, graph: 2.00×" in standard
