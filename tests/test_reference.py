"""Self-checks of the float64 reference (cula_aot.reference): CPU only, seconds."""

import math

import pytest
import torch

from cula_aot.reference import (
    CHUNK,
    gate,
    kda_chunked,
    kda_recurrent,
    l2norm_bf16,
    prepare_tiles,
    rel_rmse,
)
from cula_aot import reference
from cula_aot.testing import fresh_seed, standard_inputs

D = 128
VARLEN = [0, 1, 17, 40, 72]  # lengths 1, 16, 23, 32: one token, one exact tile, partial tiles


def make_inputs(seed, B, T, H, *, decay="standard", n_states=None):
    """CONTRACT §8 inputs (``cula_aot.testing.standard_inputs``, CPU). decay='standard':
    lower_bound=-5, A_log=log U(1,16); 'slow': -0.05, -4.

    Returns (q, k, v, g, beta, kwargs, initial_state); initial_state ~ 0.1·N(0,1) has
    n_states sequences (None: no initial state).
    """
    x = standard_inputs(B, T, H, seed=seed, slow_decay=decay != "standard", n_states=n_states)
    kwargs = dict(A_log=x["A_log"], dt_bias=x["dt_bias"], lower_bound=x["lower_bound"])
    return x["q"], x["k"], x["v"], x["g"], x["beta"], kwargs, x.get("initial_state")


def assert_close(actual, expected, tol):
    err = rel_rmse(actual, expected)
    assert err <= tol, f"rel_rmse {err:.3e} > {tol:.0e}"


@pytest.mark.parametrize("decay", ["standard", "slow"])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("H", [1, 3])
@pytest.mark.parametrize("T", [1, 15, 16, 17, 50])
def test_chunked_matches_recurrent_fixed(T, H, with_state, decay):
    B = 2
    q, k, v, g, beta, kw, s0 = make_inputs(T * 10 + H, B, T, H, decay=decay, n_states=B if with_state else None)
    o_c, s_c = kda_chunked(q, k, v, g, beta, **kw, initial_state=s0)
    o_r, s_r = kda_recurrent(q, k, v, g, beta, **kw, initial_state=s0)
    assert o_c.shape == (B, T, H, D) and o_c.dtype == torch.float64
    assert s_c.shape == (B, H, D, D) and s_c.dtype == torch.float64
    assert_close(o_c, o_r, 1e-10)
    assert_close(s_c, s_r, 1e-10)


@pytest.mark.parametrize("decay", ["standard", "slow"])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("H", [1, 3])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_chunked_matches_recurrent_varlen(index_dtype, H, with_state, decay):
    cu = torch.tensor(VARLEN, dtype=index_dtype)
    q, k, v, g, beta, kw, s0 = make_inputs(
        7 + H, 1, VARLEN[-1], H, decay=decay, n_states=len(VARLEN) - 1 if with_state else None
    )
    o_c, s_c = kda_chunked(q, k, v, g, beta, **kw, initial_state=s0, cu_seqlens=cu)
    o_r, s_r = kda_recurrent(q, k, v, g, beta, **kw, initial_state=s0, cu_seqlens=cu)
    assert s_c.shape == (len(VARLEN) - 1, H, D, D)
    assert_close(o_c, o_r, 1e-10)
    assert_close(s_c, s_r, 1e-10)


def test_long_slow_decay_carries_state():
    # Slow decay over ten tiles: the initial state must still matter in the last tile, and the
    # chunked form must still agree with the token recurrence.
    q, k, v, g, beta, kw, s0 = make_inputs(3, 1, 160, 2, decay="slow", n_states=1)
    o_c, s_c = kda_chunked(q, k, v, g, beta, **kw, initial_state=s0)
    o_r, s_r = kda_recurrent(q, k, v, g, beta, **kw, initial_state=s0)
    assert_close(o_c, o_r, 1e-10)
    assert_close(s_c, s_r, 1e-10)
    o_0, _ = kda_chunked(q, k, v, g, beta, **kw)
    assert rel_rmse(o_0[:, -CHUNK:], o_c[:, -CHUNK:]) > 1e-3


@pytest.mark.parametrize("decay", ["standard", "slow"])
def test_recipe_close_to_exact(decay):
    H = 2
    cu = torch.tensor(VARLEN)
    q, k, v, g, beta, kw, s0 = make_inputs(11, 1, VARLEN[-1], H, decay=decay, n_states=len(VARLEN) - 1)
    o_x, s_x = kda_chunked(q, k, v, g, beta, **kw, initial_state=s0, cu_seqlens=cu)
    o_p, s_p = kda_chunked(q, k, v, g, beta, **kw, initial_state=s0, cu_seqlens=cu, recipe=True)
    assert_close(o_p, o_x, 1e-2)
    assert_close(s_p, s_x, 1e-2)
    # It models rounding: results differ from exact math and o is bf16-representable.
    assert not torch.equal(o_p, o_x) and not torch.equal(s_p, s_x)
    assert torch.equal(o_p, o_p.bfloat16().double())
    assert torch.equal(s_p, s_p.float().double())


def test_recipe_tiles_rounded():
    q, k, v, g, beta, kw, _ = make_inputs(5, 1, 40, 2)
    t = prepare_tiles(q, k, g, beta, **kw, recipe=True)
    for name in ("qd", "kd", "kinv", "kr", "mqk", "inv"):
        assert torch.equal(t[name], t[name].bfloat16().double()), name
    assert torch.equal(t["gt"], t["gt"].float().double())
    # The fp16 Neumann inverse is still an inverse up to half-precision error.
    eye = torch.eye(CHUNK, dtype=torch.float64)
    assert (t["inv"] @ (eye + t["L"]) - eye).abs().max() < 2e-2


def test_prepare_tiles_layout_and_invariants():
    H = 3
    cu = torch.tensor(VARLEN)
    q, k, v, g, beta, kw, _ = make_inputs(13, 1, VARLEN[-1], H)
    t = prepare_tiles(q, k, g, beta, **kw, cu_seqlens=cu)

    # lengths 1, 16, 23, 32 -> 1, 1, 2, 2 tiles
    assert t["tile_seq"].tolist() == [0, 1, 2, 2, 3, 3]
    assert t["tile_index"].tolist() == [0, 0, 0, 1, 0, 1]
    assert t["tile_rows"].tolist() == [1, 16, 16, 7, 16, 16]
    n = 6
    assert t["qd"].shape == (n, H, CHUNK, D) and t["gt"].shape == (n, H, D)
    assert t["L"].shape == t["inv"].shape == t["mqk"].shape == (n, H, CHUNK, CHUNK)
    assert t["b"].shape == t["beta"].shape == (n, H, CHUNK)

    eye = torch.eye(CHUNK, dtype=torch.float64)
    assert (t["inv"] @ (eye + t["L"]) - eye).abs().max() < 1e-12
    assert torch.equal(t["L"], torch.tril(t["L"], -1))
    assert torch.equal(t["mqk"], torch.tril(t["mqk"]))

    for tile, rows in enumerate(t["tile_rows"].tolist()):
        for name in ("qd", "kd", "kinv", "kr"):
            assert torch.all(t[name][tile, :, rows:] == 0), (name, tile)
        assert torch.all(t["b"][tile, :, rows:] == 0)
        assert torch.all(t["beta"][tile, :, rows:] == -math.inf)
        assert torch.all(t["b"][tile, :, :rows] > 0)
    # gt is the decay of the whole tile: padded rows (γ = 0) do not change it.
    gam = gate(g, **kw)[0]
    assert torch.allclose(t["gt"][3], torch.exp(gam[33:40].sum(0)), rtol=1e-13, atol=0)


def test_prepare_tiles_matches_spec_formulas():
    # One full tile checked against the CONTRACT §2 formulas written out directly.
    scale = 0.3
    q, k, v, g, beta, kw, _ = make_inputs(17, 1, CHUNK, 1)
    t = prepare_tiles(q, k, g, beta, **kw, scale=scale)
    G = torch.cumsum(gate(g, **kw)[0, :, 0], 0)
    qh, kh = l2norm_bf16(q)[0, :, 0], l2norm_bf16(k)[0, :, 0]
    b = torch.sigmoid(beta[0, :, 0].double())
    gtot = torch.exp(G[-1])
    kinv = kh * torch.exp(-G)
    assert torch.allclose(t["qd"][0, 0], qh * torch.exp(G) * scale, rtol=1e-13, atol=0)
    assert torch.allclose(t["kr"][0, 0], kh * gtot * torch.exp(-G), rtol=1e-13, atol=0)
    L = torch.tril(b[:, None] * (kh * torch.exp(G)) @ kinv.T, -1)
    assert torch.allclose(t["L"][0, 0], L, rtol=1e-12, atol=1e-15)
    assert torch.allclose(t["b"][0, 0], b)


@pytest.mark.parametrize("recipe", [False, True])
def test_sequences_independent(recipe):
    H = 2
    cu = torch.tensor(VARLEN)
    q, k, v, g, beta, kw, s0 = make_inputs(19, 1, VARLEN[-1], H, n_states=len(VARLEN) - 1)
    o, s = kda_chunked(q, k, v, g, beta, **kw, initial_state=s0, cu_seqlens=cu, recipe=recipe)
    for n, (a, e) in enumerate(zip(VARLEN, VARLEN[1:])):
        sl = slice(a, e)
        o_n, s_n = kda_chunked(
            q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], **kw, initial_state=s0[n : n + 1], recipe=recipe
        )
        assert_close(o[:, sl], o_n, 1e-13)
        assert_close(s[n : n + 1], s_n, 1e-13)


def test_empty_sequence_keeps_initial_state():
    cu = torch.tensor([0, 5, 5, 20])
    q, k, v, g, beta, kw, s0 = make_inputs(23, 1, 20, 1, n_states=3)
    for fn in (kda_chunked, kda_recurrent):
        _, s = fn(q, k, v, g, beta, **kw, initial_state=s0, cu_seqlens=cu)
        assert torch.equal(s[1], s0[1].double())


def test_bad_cu_seqlens_rejected():
    q, k, v, g, beta, kw, _ = make_inputs(29, 1, 20, 1)
    for cu in ([0, 5, 19], [1, 5, 20], [0, 12, 5, 20]):
        with pytest.raises(ValueError):
            kda_chunked(q, k, v, g, beta, **kw, cu_seqlens=torch.tensor(cu))
    with pytest.raises(ValueError):
        kda_chunked(q.expand(2, -1, -1, -1), k, v, g, beta, **kw, cu_seqlens=torch.tensor([0, 20]))


@pytest.mark.parametrize("decay", ["standard", "slow"])
def test_gate_range(decay):
    q, k, v, g, beta, kw, _ = make_inputs(31, 2, 64, 4, decay=decay)
    gam = gate(g, **kw)
    assert gam.dtype == torch.float64 and gam.shape == g.shape
    assert torch.all(gam >= kw["lower_bound"]) and torch.all(gam < 0)
    # σ(x) = ½(tanh(x/2) + 1) as CONTRACT §2 writes it
    x = torch.exp(kw["A_log"].double())[:, None] * (g.double() + kw["dt_bias"].double())
    assert torch.allclose(gam, kw["lower_bound"] * 0.5 * (torch.tanh(x / 2) + 1), rtol=1e-14)


def test_l2norm_bf16():
    x = torch.randn(4, 3, D, generator=torch.Generator().manual_seed(37)).bfloat16()
    y = l2norm_bf16(x)
    assert y.dtype == torch.float64
    assert torch.equal(y, y.bfloat16().double())
    assert torch.allclose(y.norm(dim=-1), torch.ones(4, 3, dtype=torch.float64), atol=1e-2)
    assert torch.all(l2norm_bf16(torch.zeros(2, D, dtype=torch.bfloat16)) == 0)


def test_rel_rmse():
    b = torch.tensor([3.0, 4.0])
    assert rel_rmse(b, b) == 0.0
    assert rel_rmse(torch.tensor([3.0, 3.0]), b) == pytest.approx(0.2)
    assert rel_rmse(torch.tensor([math.nan, 4.0]), b) == math.inf
    assert rel_rmse(torch.tensor([math.inf, 4.0]), b) == math.inf


@pytest.mark.parametrize(
    "gate, slow, extreme",
    [
        ("softplus", False, False),
        ("softplus", True, False),
        ("softplus", False, True),
        ("precomputed", False, False),
        ("precomputed", False, True),
    ],
)
def test_tile_form_matches_the_recurrence_under_unbounded_gates(gate, slow, extreme):
    """Under the unbounded gates the tile form forms L and mqk pair by pair; it must still be the
    token recurrence, also where a token's decay is e^-480 next to keys that do not decay."""
    x = standard_inputs(1, 75, 2, seed=fresh_seed(), gate=gate, slow_decay=slow, extreme=extreme)
    cu = torch.tensor([0, 40, 75])
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    kw = dict(A_log=x.get("A_log"), dt_bias=x.get("dt_bias"), lower_bound=None, cu_seqlens=cu, gate_kind=gate)
    s0 = 0.1 * torch.randn(2, 2, 128, 128, dtype=torch.float64)
    o_tile, s_tile = reference.kda_chunked(*args, initial_state=s0, **kw)
    o_tok, s_tok = reference.kda_recurrent(*args, initial_state=s0, **kw)
    assert torch.isfinite(o_tile).all() and torch.isfinite(s_tile).all()
    assert reference.rel_rmse(o_tile, o_tok) < 1e-12 and reference.rel_rmse(s_tile, s_tok) < 1e-12


def test_pairwise_products_equal_the_factored_ones_on_the_safe_gate():
    x = standard_inputs(1, 48, 2, seed=fresh_seed())
    t = reference.prepare_tiles(
        x["q"], x["k"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"], lower_bound=x["lower_bound"]
    )
    G = torch.log(t["kd"] / t["kinv"]) / 2  # kd / kinv = e^(2G) wherever k̂ ≠ 0
    kn = t["kd"] * torch.exp(-G)
    pairwise = reference._pairwise_products(t["qd"] * torch.exp(-G), kn, G)
    assert torch.allclose(pairwise, t["mqk"], rtol=1e-9, atol=1e-12)


def test_the_gates_of_fla():
    g = torch.tensor([[[[30.0, -20.0, 0.0]]]])
    a_log = torch.tensor([0.5])
    dt = torch.tensor([[0.1, 0.2, -0.3]])
    want = -torch.exp(torch.tensor(0.5, dtype=torch.float64)) * torch.nn.functional.softplus(g.double() + dt.double())
    assert torch.allclose(reference.gate(g, a_log, dt, None, "softplus"), want)
    assert torch.allclose(reference.gate(g, None, None, None, "softplus"), -torch.nn.functional.softplus(g.double()))
    assert torch.equal(reference.gate(-g, None, None, None, "precomputed"), (-g.double()).clamp(max=0))


@pytest.mark.parametrize("beta_sigmoid, qk_l2norm", [(False, True), (True, False), (False, False)])
def test_input_conventions(beta_sigmoid, qk_l2norm):
    """β as probabilities and q, k as given: the tile form is still the recurrence, and taking
    σ(β) and normalised q, k that way is the default convention exactly."""
    x = standard_inputs(1, 40, 2, seed=fresh_seed())
    q, k, beta = x["q"], x["k"], x["beta"]
    given = dict(
        q=reference.l2norm_bf16(q).to(torch.bfloat16) if not qk_l2norm else q,
        k=reference.l2norm_bf16(k).to(torch.bfloat16) if not qk_l2norm else k,
        beta=torch.sigmoid(beta.double()) if not beta_sigmoid else beta,
    )
    kw = dict(
        A_log=x["A_log"], dt_bias=x["dt_bias"], lower_bound=x["lower_bound"], cu_seqlens=torch.tensor([0, 17, 40])
    )
    o_tile, s_tile = kda_chunked(
        given["q"], given["k"], x["v"], x["g"], given["beta"], **kw, beta_sigmoid=beta_sigmoid, qk_l2norm=qk_l2norm
    )
    o_tok, s_tok = kda_recurrent(
        given["q"], given["k"], x["v"], x["g"], given["beta"], **kw, beta_sigmoid=beta_sigmoid, qk_l2norm=qk_l2norm
    )
    o_default, s_default = kda_recurrent(q, k, x["v"], x["g"], beta, **kw)
    assert rel_rmse(o_tile, o_tok) < 1e-12 and rel_rmse(s_tile, s_tok) < 1e-12
    assert rel_rmse(o_tok, o_default) < 1e-12 and rel_rmse(s_tok, s_default) < 1e-12
    tiles = prepare_tiles(
        given["q"], given["k"], x["g"], given["beta"], **kw, beta_sigmoid=beta_sigmoid, qk_l2norm=qk_l2norm
    )
    assert (tiles["b"][1, :, 7:] == 0).all()  # the second sequence's padded rows: b = 0 in either convention
