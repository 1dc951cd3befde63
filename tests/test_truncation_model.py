"""The CPU model of cuDNN's seed truncation (benchmarks/truncation_model.py) on hand-built decays whose
schedule and warm-ups can be worked out by hand."""

import importlib
import math
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(
    not (ROOT / "benchmarks" / "truncation_model.py").exists(), reason="benchmarks/ is not part of the installed wheel"
)
LN2 = math.log(2.0)


@pytest.fixture(scope="module")
def tm():
    return importlib.import_module("benchmarks.truncation_model")


def uniform(tokens, rate, heads=1, channels=128):
    """γ [T, H, K] with every channel decaying by exactly 2^-rate per token."""
    return torch.full((tokens, heads, channels), -rate * LN2, dtype=torch.float64)


def test_pieces_fill_264_ctas_capped_by_the_mean_sequence(tm):
    assert tm.pieces_per_chain(2048, 1, 12) == 22
    assert tm.pieces_per_chain(8192, 1, 16) == 16
    assert tm.pieces_per_chain(8192, 1, 64) == 4
    assert tm.pieces_per_chain(32768, 1, 3) == 88
    assert tm.pieces_per_chain(48, 1, 1) == 3  # never more pieces than chunks
    assert tm.pieces_per_chain(8192, 8, 64) == 1  # N·H > 264: one piece each
    assert tm.pieces_per_chain(140, 2, 1) == 5  # varlen: the mean length (70 tokens, 5 chunks) caps P


def test_piece_ranges_drop_pieces_past_the_end(tm):
    assert tm.piece_ranges(10, 4) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert tm.piece_ranges(9, 4) == [(0, 3), (3, 6), (6, 9)]
    assert len(tm.piece_ranges(128, 22)) == 22 and tm.piece_ranges(128, 22)[-1] == (126, 128)
    assert tm.piece_ranges(0, 3) == []


# Per chunk the cuDNN bound is -16·rate + 3.5 and the rigorous one -16·rate (log2), so the walk
# stops after ceil(20 / (16·rate - 3.5)) and ceil(20 / (16·rate)) chunks respectively.
@pytest.mark.parametrize("rate, cudnn_w, rigorous_w", [(1.0, 2, 2), (1.3, 2, 1), (0.5, 5, 3)])
def test_uniform_decay_certifies_after_a_computable_warmup(tm, rate, cudnn_w, rigorous_w):
    gamma = uniform(64 * 16, rate, heads=2)
    for rule, expected in (("cudnn", cudnn_w), ("rigorous", rigorous_w)):
        bounds = tm.chunk_bounds(gamma, rule)
        for c0 in (16, 32, 48):
            w, ok = tm.warmup(bounds, c0)
            assert w.tolist() == [expected] * 2 and ok.all(), (rule, c0)
        stats = tm.model_chains([gamma], 4, rule)
        assert stats["certified_fraction"] == 1.0 and stats["warmup_max"] == expected
        assert stats["work_factor"] == pytest.approx((64 + 3 * expected) / 64)
        assert stats["critical_path_ratio"] == pytest.approx((16 + expected) / 64)


def test_short_chain_work_and_critical_path(tm):
    # 8 chunks in 4 pieces at 2^-1.3 per token: cuDNN walks 2 chunks (the first piece after chunk 0
    # thereby reaches the start), the rigorous bound 1.
    gamma = uniform(8 * 16, 1.3)
    cudnn, rigorous = (tm.model_chains([gamma], 4, rule) for rule in ("cudnn", "rigorous"))
    assert cudnn["work_factor"] == pytest.approx(14 / 8) and cudnn["critical_path_ratio"] == pytest.approx(4 / 8)
    assert rigorous["work_factor"] == pytest.approx(11 / 8) and rigorous["critical_path_ratio"] == pytest.approx(3 / 8)


def test_one_undecaying_channel_sends_every_piece_to_the_start(tm):
    gamma = uniform(64 * 16, 4.0)
    gamma[:, :, 5] = 0.0  # α = 1 on one channel: no attenuation bound at all
    for rule in ("rigorous", "cudnn"):  # cuDNN's allowance makes every chunk's bound +3.5
        w, ok = tm.warmup(tm.chunk_bounds(gamma, rule), 40)
        assert w.tolist() == [40] and not ok.any()
        stats = tm.model_chains([gamma], 4, rule)
        assert stats["certified_fraction"] == 0.0 and stats["warmup_max"] == 48
        assert stats["work_factor"] == pytest.approx((64 + 16 + 32 + 48) / 64)
        assert stats["critical_path_ratio"] == 1.0


def test_cudnn_chunk_max_is_not_a_per_token_bound(tm):
    # Two channels that take turns holding on within each chunk: every channel's chunk sum is -40,
    # so cuDNN certifies in one chunk, yet some channel keeps α = 1 at every token.
    gamma = torch.full((16 * 16, 1, 128), -5.0, dtype=torch.float64)
    first = (torch.arange(16 * 16) % 16) < 8
    gamma[first, 0, 0] = 0.0
    gamma[~first, 0, 1] = 0.0
    assert tm.model_chains([gamma], 4, "cudnn")["warmup_max"] == 1
    assert tm.model_chains([gamma], 4, "rigorous")["certified_fraction"] == 0.0


def test_varlen_takes_the_mean_lengths_p_and_skips_the_partial_tail(tm):
    # 100 + 40 tokens: 7 and 3 chunks (the first one's last chunk partial), P = 5 from the mean, so
    # pieces of 2 chunks (4 pieces) and of 1 chunk (3 pieces), each warming up 1 chunk at 2^-2.
    gammas = [uniform(100, 2.0), uniform(40, 2.0)]
    p = tm.pieces_per_chain(140, 2, 1)
    stats = tm.model_chains(gammas, p, "cudnn")
    assert stats["certified_fraction"] == 1.0 and stats["warmup_mean"] == 1.0
    assert stats["work_factor"] == pytest.approx((7 + 3 + 3 + 2) / 10)
    assert stats["critical_path_ratio"] == pytest.approx(3 / 7)


def test_bench_regimes_on_the_smallest_row(tm):
    # The mixed regime's four long-memory channels defeat every per-chunk certificate outright; the
    # standard regime's gates pass cuDNN's and ours within a few chunks; only ours (its
    # token-by-token part) certifies slow decay, after 36 chunks (the row's first pieces walk to
    # the start before that).
    standard, mixed, slow = (tm.model_row("h4-1x1024", regime) for regime in ("standard", "mixed", "slow"))
    assert standard["pieces_per_chain"] == 64 and standard["cudnn"]["certified_fraction"] > 0.9
    assert standard["tile"]["certified_fraction"] > 0.9 and standard["tile"]["warmup_max"] <= 4
    assert mixed["cudnn"]["certified_fraction"] == 0.0 and mixed["tile"]["certified_fraction"] == 0.0
    assert slow["cudnn"]["certified_fraction"] == 0.0 and 0.3 < slow["tile"]["certified_fraction"] < 0.6
    assert mixed["cudnn"]["work_factor"] == pytest.approx((64 + sum(range(64))) / 64)


def test_exact_certificate_of_a_pure_decay_is_its_frobenius_norm(tm):
    """b = 0 leaves M = diag(α^n): ‖M‖_F = √128 · 2^(-rate·n), ‖M‖₂ = 2^(-rate·n)."""
    gamma = uniform(160, 0.25, heads=2)  # -4 per chunk: 3.5 - 4j <= -20 first at j = 6
    kn = torch.nn.functional.normalize(torch.randn(160, 2, 128, dtype=torch.float64), dim=-1)
    w, ok, spectral = tm.exact_warmups(
        gamma, kn, torch.zeros(160, 2, dtype=torch.float64), [8, 10], torch.full((2, 2), 2)
    )
    assert ok.all() and w.tolist() == [[6, 6], [6, 6]]
    assert torch.allclose(spectral, torch.full((2, 2), -8.0, dtype=torch.float64))


def test_exact_certificate_walks_the_reference_transition_product(tm):
    """The walk's M is A_last ⋯ A_first with A = (I − b k̂k̂ᵀ)·diag(α), built explicitly here."""
    gen = torch.Generator().manual_seed(0)
    tokens = 48
    gamma = -0.05 * torch.rand(tokens, 1, 128, generator=gen, dtype=torch.float64)
    kn = torch.nn.functional.normalize(torch.randn(tokens, 1, 128, generator=gen, dtype=torch.float64), dim=-1)
    b = torch.rand(tokens, 1, generator=gen, dtype=torch.float64)
    m = torch.eye(128, dtype=torch.float64)
    for t in range(tokens):  # the state at the window's start carried to its end
        k = kn[t, 0][:, None]
        m = (torch.eye(128, dtype=torch.float64) - b[t, 0] * k @ k.T) @ torch.diag(gamma[t, 0].exp()) @ m
    w, ok, spectral = tm.exact_warmups(gamma, kn, b, [3], torch.tensor([[3]]))
    assert not ok.any() and w.tolist() == [[3]]  # slow decay: never certified within 3 chunks
    assert abs(float(spectral) - float(torch.linalg.matrix_norm(m, ord=2).log2())) < 1e-9
