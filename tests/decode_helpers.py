"""Float64 token recurrence and input builders for the decode tests (CONTRACT §2, §10)."""

import torch

from cula_aot import reference


def decode_reference(
    q,
    k,
    v,
    g,
    beta,
    *,
    A_log,
    dt_bias,
    lower_bound,
    scale=None,
    initial_state,
    gate="safe",
    beta_sigmoid=True,
    qk_l2norm=True,
):
    """Float64 decode of T tokens per sequence -> (o [N, T, H, V], states [N, T, H, K, V]).

    ``initial_state``: S itself per head, ``[N, H, K, V]``.  Per token: S ← diag(e^γ)·S;
    S ← S + b·k̂(v − Sᵀk̂)ᵀ; o = scale·Sᵀq̂ (q̂, k̂ and b by the input conventions,
    ``reference.conventions``).
    """
    n, tokens, heads, dim = q.shape
    scale = dim**-0.5 if scale is None else scale
    alpha = torch.exp(reference.gate(g, A_log, dt_bias, lower_bound, gate))
    qn, kn, b = reference.conventions(q, k, beta, beta_sigmoid, qk_l2norm)
    vv = v.to(torch.float64)
    s = initial_state.to(torch.float64).clone()
    outs, states = [], []
    for t in range(tokens):
        s = alpha[:, t, :, :, None] * s
        err = vv[:, t] - torch.einsum("nhkv,nhk->nhv", s, kn[:, t])
        s = s + b[:, t, :, None, None] * kn[:, t, :, :, None] * err[:, :, None, :]
        outs.append(scale * torch.einsum("nhkv,nhk->nhv", s, qn[:, t]))
        states.append(s.clone())
    return torch.stack(outs, 1), torch.stack(states, 1)


def to_pool_layout(s_kv, layout):
    """S ([..., K, V]) as stored: "vk" keeps Sᵀ per head."""
    return s_kv.transpose(-1, -2) if layout == "vk" else s_kv


def from_pool_layout(stored, layout):
    return stored.transpose(-1, -2) if layout == "vk" else stored


def fused_inputs(n, tokens, heads, *, device, seed, pad_cols=24):
    """q, k, v, g as token-strided views cut from one fused [N, T, 4·H·128 + pad] projection and
    β from a fused [N, T, H + 3] tensor (offset 1: not 16-byte aligned), standard CONTRACT §8 draws."""
    gen = torch.Generator(device=device).manual_seed(seed)
    width = 4 * heads * 128 + pad_cols
    fused = torch.randn(n, tokens, width, generator=gen, device=device).to(torch.bfloat16)
    views = [fused[..., i * heads * 128 : (i + 1) * heads * 128].unflatten(-1, (heads, 128)) for i in range(4)]
    beta_fused = torch.randn(n, tokens, heads + 3, generator=gen, device=device).to(torch.bfloat16)
    beta = beta_fused[..., 1 : heads + 1]
    a_log = torch.log(torch.rand(heads, generator=gen, device=device) * 15 + 1).float()
    dt_bias = 0.1 * torch.randn(heads, 128, generator=gen, device=device)
    return dict(
        q=views[0], k=views[1], v=views[2], g=views[3], beta=beta, A_log=a_log, dt_bias=dt_bias, lower_bound=-5.0
    )
