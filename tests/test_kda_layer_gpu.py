"""The real client, one layer: flash-linear-attention's ``KimiDeltaAttention`` (fla 0.6.0,
``use_short_conv=True``, its own random weights, bf16, H = 4) decoding 64 steps two ways from the
same projections: fla's decode path (``ShortConvolution`` caches, ``fused_recurrent_kda`` on the
recurrent states, ``o_norm``) and ``cula_aot.kda_decode_layer`` on a pool with more slots than
requests, one request a padding row (-1) throughout.  Both start from the same random states;
every step's output, and the recurrent and conv states at the end, are compared (fla's kernels
are the reference here: its bf16 roundings are the ones the fused kernel reproduces).
"""

import os

import pytest
import torch

import cula_aot
from cula_aot import reference
from cula_aot.gates import fla_gate

pytestmark = [pytest.mark.gpu, pytest.mark.integration]
fla_kda = pytest.importorskip("fla.layers.kda")
fla_ops = pytest.importorskip("fla.ops.kda")

STEPS = 64
BOUND = 2e-2  # bf16 outputs of two implementations, 64 chained steps


@pytest.mark.parametrize("gate", ["softplus", "safe"])
def test_layer_decode_matches_fla(gate):
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    heads, hidden, batch, slots = 4, 512, 5, 9
    layer = (
        fla_kda.KimiDeltaAttention(
            hidden_size=hidden,
            head_dim=128,
            num_heads=heads,
            use_short_conv=True,
            conv_bias=gate == "safe",
            safe_gate=gate == "safe",
            lower_bound=-5.0 if gate == "safe" else None,
            layer_idx=0,
        )
        .to(device="cuda", dtype=torch.bfloat16)
        .eval()
    )
    channels = heads * 128
    valid = [0, 1, 3, 4]  # request 2 is padding
    slot_of = torch.tensor([6, 0, -1, 8, 3], dtype=torch.int32, device="cuda")
    rows = slot_of[valid].long()
    # fla's caches for the valid requests; the pool and conv pool hold the same values at their slots.
    fla_state = 0.1 * torch.randn(len(valid), heads, 128, 128, device="cuda")
    fla_convs = [torch.randn(len(valid), channels, 4, device="cuda").to(torch.bfloat16) for _ in range(3)]
    pool = torch.randn(slots, heads, 128, 128, device="cuda")
    pool[rows] = fla_state
    conv_pool = torch.randn(slots, 3 * channels, 3, device="cuda").to(torch.bfloat16)
    conv_pool[rows] = torch.cat([c[..., 1:] for c in fla_convs], 1)
    gate_args = fla_gate(
        True, layer.safe_gate, layer.lower_bound, layer.A_log, layer.dt_bias, heads, torch.device("cuda")
    )
    convs = (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d)
    errors = []
    with torch.inference_mode():
        for step in range(STEPS):
            h = torch.randn(batch, 1, hidden, device="cuda").to(torch.bfloat16)
            q, k, v = (proj(h) for proj in (layer.q_proj, layer.k_proj, layer.v_proj))
            g, beta, z = layer.f_proj(h), layer.b_proj(h), layer.g_proj(h)
            # fla's decode path on the valid requests
            x = [conv(t[valid], cache=c, output_final_state=True)[0] for conv, t, c in zip(convs, (q, k, v), fla_convs)]
            o_fla, fla_state = fla_ops.fused_recurrent_kda(
                *(t.unflatten(-1, (heads, 128)) for t in x),
                g[valid].unflatten(-1, (heads, 128)),
                beta[valid],
                A_log=layer.A_log,
                dt_bias=layer.dt_bias,
                initial_state=fla_state,
                output_final_state=True,
                use_qk_l2norm_in_kernel=True,
                use_gate_in_kernel=True,
                use_beta_sigmoid_in_kernel=True,
                lower_bound=layer.lower_bound,
                state_v_first=True,
            )
            y_fla = layer.o_norm(o_fla, z[valid].unflatten(-1, (heads, 128)))
            # ours on the pool, every request at once
            y = cula_aot.kda_decode_layer(
                *(t.unflatten(-1, (heads, 128)) for t in (q, k, v, g)),
                beta,
                conv_weight=tuple(c.weight for c in convs),
                conv_bias=tuple(c.bias for c in convs) if layer.conv_bias else None,
                conv_state=conv_pool,
                out_gate=z.unflatten(-1, (heads, 128)),
                norm_weight=layer.o_norm.weight,
                norm_eps=layer.o_norm.eps,
                state_pool=pool,
                state_indices=slot_of,
                **gate_args,
            )
            errors.append(reference.rel_rmse(y[valid], y_fla))
            assert bool((y[2] == 0).all()), f"step {step}: the padding row's output is not zero"
    state_err = reference.rel_rmse(pool[rows], fla_state)
    conv_ok = torch.equal(conv_pool[rows], torch.cat([c[..., 1:] for c in fla_convs], 1))
    print(f"KimiDeltaAttention {gate} (seed {seed}): max step rel-RMSE {max(errors):.2e}, state {state_err:.2e}")
    assert max(errors) <= BOUND and state_err <= BOUND, (max(errors), state_err)
    assert conv_ok, "the conv states differ from fla's caches"
