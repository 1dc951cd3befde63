"""Self-checks of ``reference.kda_decode_layer`` (CPU only, seconds): against a composition of plain
torch ops and the decode reference, against fla's conv-cache update and fla's own naive KDA
recurrence, token chaining, and no mutation of the inputs."""

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cula_aot import reference
from cula_aot.reference import kda_decode_layer, rel_rmse
from tests.decode_helpers import decode_reference
from tests.helpers import fresh_seed, standard_inputs

D = 128
W = 4
GATES = ("safe", "softplus", "precomputed")


def layer_inputs(n, tokens, heads, gate, *, bias, seed):
    """Pre-conv q, k, v and g, β ~ N(0,1) bf16 (CONTRACT §8); conv weights ~ 0.5·N(0,1) bf16 (nn.Conv1d's
    init is U(±0.5) at W = 4), biases ~ 0.1·N(0,1) or None, conv states ~ N(0,1) bf16, S ~ 0.1·N(0,1)
    fp32 ("vk"), norm weight ~ 1 + 0.1·N(0,1), out gate ~ N(0,1) bf16. Gate arguments by ``gate``;
    "precomputed" gets a log-decay g = −e^N(0,1)/4."""
    x = standard_inputs(n, tokens, heads, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    channels = heads * D

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    args = {
        "q": x["q"],
        "k": x["k"],
        "v": x["v"],
        "g": x["g"],
        "beta": x["beta"],
        "conv_weights": tuple((0.5 * randn(channels, W)).to(torch.bfloat16) for _ in range(3)),
        "conv_biases": tuple(0.1 * randn(channels) for _ in range(3)) if bias else None,
        "conv_states": tuple(randn(n, channels, W - 1).to(torch.bfloat16) for _ in range(3)),
        "initial_state": 0.1 * randn(n, heads, D, D),
        "norm_weight": 1 + 0.1 * randn(D),
        "out_gate": randn(n, tokens, heads, D).to(torch.bfloat16),
        "gate_kind": gate,
    }
    if gate == "safe":
        args.update(A_log=x["A_log"], dt_bias=x["dt_bias"], lower_bound=x["lower_bound"])
    elif gate == "softplus":
        args.update(A_log=x["A_log"], dt_bias=x["dt_bias"], lower_bound=None)
    else:
        args.update(g=(-torch.exp(randn(n, tokens, heads, D)) / 4).to(torch.bfloat16))
        args.update(A_log=None, dt_bias=None, lower_bound=None)
    return args


def conv_by_conv1d(x, weight, bias, state):
    """Short conv + SiLU with ``F.conv1d`` (cross-correlation, groups = channels) over the window
    [state; new inputs] -> (y [N, T, H, D], last W−1 window columns)."""
    n, tokens, heads, _ = x.shape
    window = torch.cat([state.double(), x.double().reshape(n, tokens, -1).transpose(1, 2)], dim=-1)
    y = F.conv1d(window, weight.double()[:, None, :], None if bias is None else bias.double(), groups=heads * D)
    return F.silu(y).transpose(1, 2).reshape(n, tokens, heads, D), window[..., -(W - 1) :]


def composed(a, round_o_kda=True, eps=1e-5):
    """The layer from independent pieces: conv1d, one decode_reference call per token, F.rms_norm."""
    biases = a["conv_biases"] or (None, None, None)
    convs = [conv_by_conv1d(a[name], *p) for name, *p in zip("qkv", a["conv_weights"], biases, a["conv_states"])]
    (q, new_sq), (k, new_sk), (v, new_sv) = convs
    s = a["initial_state"].transpose(-1, -2)  # vk -> S[k, v]
    outs = []
    for t in range(q.shape[1]):
        step = slice(t, t + 1)
        o, states = decode_reference(
            q[:, step],
            k[:, step],
            v[:, step],
            a["g"][:, step],
            a["beta"][:, step],
            A_log=a["A_log"],
            dt_bias=a["dt_bias"],
            lower_bound=a["lower_bound"],
            initial_state=s,
            gate=a["gate_kind"],
        )
        outs.append(o[:, 0])
        s = states[:, -1]
    o = torch.stack(outs, 1)
    if round_o_kda:
        o = o.to(torch.bfloat16).double()
    y = F.rms_norm(o, (D,), weight=a["norm_weight"].double(), eps=eps) * torch.sigmoid(a["out_gate"].double())
    return y, s.transpose(-1, -2), (new_sq, new_sk, new_sv)


def assert_close(actual, expected, tol, seed):
    err = rel_rmse(actual, expected)
    assert err <= tol, f"rel_rmse {err:.3e} > {tol:.0e} (seed {seed})"


def assert_layer_matches(got, want, tol, seed):
    (y, s, conv), (y_ref, s_ref, conv_ref) = got, want
    assert y.shape == y_ref.shape and y.dtype == torch.float64
    assert s.shape == s_ref.shape and s.dtype == torch.float64
    assert_close(y, y_ref, tol, seed)
    assert_close(s, s_ref, tol, seed)
    for c, c_ref in zip(conv, conv_ref):
        assert c.shape == c_ref.shape and torch.equal(c, c_ref.double()), f"seed {seed}"


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tokens", [1, 3, 8])
@pytest.mark.parametrize("gate", GATES)
def test_layer_matches_composition(gate, tokens, bias):
    seed = fresh_seed()
    a = layer_inputs(2, tokens, 2, gate, bias=bias, seed=seed)
    assert_layer_matches(kda_decode_layer(**a), composed(a), 1e-12, seed)


def test_unrounded_o_kda_and_eps():
    seed = fresh_seed()
    a = layer_inputs(2, 3, 2, "safe", bias=True, seed=seed)
    exact = kda_decode_layer(**a, round_o_kda=False, eps=1e-3)
    assert_layer_matches(exact, composed(a, round_o_kda=False, eps=1e-3), 1e-12, seed)
    # The bf16 rounding of o is visible in y: the default differs from the exact norm input.
    assert 1e-5 < rel_rmse(kda_decode_layer(**a, eps=1e-3)[0], exact[0]) < 1e-2


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("gate", GATES)
def test_tokens_chain_like_single_token_calls(gate, bias):
    """T tokens in one call equal T calls of one token each, the state and conv states carried: what
    a speculative-decoding kernel that verifies T draft tokens relies on."""
    tokens, seed = 8, fresh_seed()
    a = layer_inputs(2, tokens, 2, gate, bias=bias, seed=seed)
    y, s, conv = kda_decode_layer(**a)
    per_token = ("q", "k", "v", "g", "beta", "out_gate")
    s_t, conv_t = a["initial_state"], a["conv_states"]
    for t in range(tokens):
        step = {name: a[name][:, t : t + 1] for name in per_token}
        y_t, s_t, conv_t = kda_decode_layer(**{**a, **step, "initial_state": s_t, "conv_states": conv_t})
        assert_close(y_t[:, 0], y[:, t], 1e-13, seed)
    assert_close(s_t, s, 1e-13, seed)
    assert all(torch.equal(c_t, c) for c_t, c in zip(conv_t, conv)), f"seed {seed}"


@pytest.mark.parametrize("tokens", [1, 5])
def test_conv_matches_fla_cache_update(tokens):
    """fla's ``causal_conv1d_update`` per token: its [N, C, W] cache drops column 0, appends the new
    input, and ``y = silu(Σ_w cache[:, :, w]·weight[:, w] + bias)``; column 0 is never read."""
    n, seed = 2, fresh_seed()
    a = layer_inputs(n, tokens, 2, "safe", bias=True, seed=seed)
    x, weight, bias, state = a["q"], a["conv_weights"][0], a["conv_biases"][0], a["conv_states"][0]
    y, new_state = reference._short_conv(x, weight, bias, state)
    cache = torch.cat([torch.full_like(state[..., :1], 1e4), state], dim=-1).double()
    for t in range(tokens):
        cache = torch.cat([cache[..., 1:], x[:, t].reshape(n, -1, 1).double()], dim=-1)
        y_t = F.silu((cache * weight.double()).sum(-1) + bias.double())
        assert_close(y[:, t].reshape(n, -1), y_t, 1e-14, seed)
    assert torch.equal(new_state, cache[..., 1:]), f"seed {seed}"


def _copy(value):
    if isinstance(value, tuple):
        return tuple(map(_copy, value))
    return value.clone() if isinstance(value, torch.Tensor) else value


def _same(a, b):
    if isinstance(a, tuple):
        return all(map(_same, a, b))
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_inputs_are_not_modified_nor_aliased():
    a = layer_inputs(2, 3, 2, "safe", bias=True, seed=fresh_seed())
    before = _copy(a)
    y, s, conv = kda_decode_layer(**a)
    assert all(_same(a[name], before[name]) for name in a)
    for out in (y, s, *conv):
        out.add_(1)
    assert all(_same(a[name], before[name]) for name in a)


def _fla_naive_recurrent_kda():
    """fla's pure-torch ``naive_recurrent_kda`` (fla/ops/kda/naive.py: torch and einops only), loaded
    from its file: fla's package ``__init__`` imports triton, which a CPU-only install lacks."""
    spec = importlib.util.find_spec("fla")
    if spec is None or spec.origin is None:
        pytest.skip("flash-linear-attention is not installed")
    pytest.importorskip("einops")
    path = Path(spec.origin).parent / "ops" / "kda" / "naive.py"
    if not path.is_file():
        pytest.skip(f"fla has no {path}")
    module_spec = importlib.util.spec_from_file_location("_fla_kda_naive", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.naive_recurrent_kda


@pytest.mark.parametrize("gate", GATES)
def test_kda_step_matches_fla_naive_recurrence(gate):
    """The KDA step and the "vk" state layout against fla's naive recurrence (fp32 math: it casts
    its inputs to float), fed the conv outputs, γ, q̂/k̂ and σ(β) the reference forms."""
    naive = _fla_naive_recurrent_kda()
    seed = fresh_seed()
    a = layer_inputs(2, 8, 2, gate, bias=True, seed=seed)
    convs = [
        conv_by_conv1d(a[name], *p) for name, *p in zip("qkv", a["conv_weights"], a["conv_biases"], a["conv_states"])
    ]
    (q, _), (k, _), (v, _) = convs
    qn, kn, b = reference.conventions(q, k, a["beta"])
    gamma = reference.gate(a["g"], a["A_log"], a["dt_bias"], a["lower_bound"], gate)
    s_kv = a["initial_state"].transpose(-1, -2).contiguous()
    o, s = naive(qn, kn, v, gamma, b, initial_state=s_kv, output_final_state=True)
    y_ref = F.rms_norm(o.double(), (D,), weight=a["norm_weight"].double(), eps=1e-5)
    y_ref = y_ref * torch.sigmoid(a["out_gate"].double())
    y, state, _ = kda_decode_layer(**a, round_o_kda=False)
    assert_close(y, y_ref, 1e-5, seed)
    assert_close(state, s.transpose(-1, -2), 1e-5, seed)
