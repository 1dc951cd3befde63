"""Intracard CP on the GPU: pre_scan + merge + segmented K2 against the serial path and float64.

Slow-decay inputs (lower_bound = -0.05, A_log = -4) keep the state alive over thousands of
tokens, so a wrong carry between segments shows up in every later output.
"""

import pytest
import torch

import cula_aot
from cula_aot import reference
from tests.helpers import cu_seqlens_of, float64_prefill, fresh_seed, prefill_kv, standard_inputs

pytestmark = pytest.mark.gpu

BOUND = 1e-2


def _states(n, heads):
    gen = torch.Generator(device="cpu").manual_seed(fresh_seed())
    return (0.1 * torch.randn(n, heads, 128, 128, generator=gen)).cuda()


CASES = [  # the merge runs 16-column blocks on the first (5 sequences × 4 heads), 8 on the others
    ("varlen", [1024, 1, 63, 65, 129], 4),
    ("varlen", [8192, 2048], 4),
    ("varlen", [16384], 8),
    ("fixed", (2, 4100), 1),
]


@pytest.mark.parametrize("split", [2, 3, 8])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_cp_matches_serial_and_float64(case, split):
    kind, shape, heads = CASES[case]
    if kind == "varlen":
        inputs = standard_inputs(1, sum(shape), heads, device="cuda", slow_decay=True)
        cu = cu_seqlens_of(shape, "cuda")
        n = len(shape)
    else:
        inputs = standard_inputs(shape[0], shape[1], heads, device="cuda", slow_decay=True)
        cu, n = None, shape[0]
    s0 = _states(n, heads)
    layout = ("vk", "kv")[(case + split) % 2]
    o_cp, s_cp = prefill_kv(inputs, s0, cu, split, layout)
    o_serial, s_serial = prefill_kv(inputs, s0, cu, False, layout)
    ref_o, ref_s = float64_prefill(inputs, s0, cu)
    errs = {
        "o_vs_f64": reference.rel_rmse(o_cp, ref_o),
        "state_vs_f64": reference.rel_rmse(s_cp, ref_s),
        "o_vs_serial": reference.rel_rmse(o_cp, o_serial.double()),
        "state_vs_serial": reference.rel_rmse(s_cp, s_serial.double()),
        "serial_o_vs_f64": reference.rel_rmse(o_serial, ref_o),
    }
    label = f"CP {kind} {shape} H={heads} s_split={split} {layout}"
    print(label + ": " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))
    assert errs["o_vs_f64"] <= BOUND and errs["state_vs_f64"] <= BOUND, label
    # CP reassociates the recurrence (segment products, fp32 carries): close to, not equal to, serial.
    assert errs["o_vs_serial"] <= 5e-3 and errs["state_vs_serial"] <= 5e-3, label


def test_cp_is_deterministic_and_handles_no_initial_state():
    lengths = [5000, 3000]
    inputs = standard_inputs(1, sum(lengths), 4, device="cuda", slow_decay=True)
    cu = cu_seqlens_of(lengths, "cuda")
    a = prefill_kv(inputs, None, cu, 8)
    b = prefill_kv(inputs, None, cu, 8)
    assert torch.equal(a[0].view(torch.int16), b[0].view(torch.int16))
    assert torch.equal(a[1].view(torch.int32), b[1].view(torch.int32))
    ref_o, _ = float64_prefill(inputs, None, cu)
    assert reference.rel_rmse(a[0], ref_o) <= BOUND


def test_auto_mode_runs_cp_for_few_heads():
    inputs = standard_inputs(1, 8192, 4, device="cuda", slow_decay=True)
    cu = cu_seqlens_of([8192], "cuda")
    o_auto, _ = prefill_kv(inputs, _states(1, 4), cu, "auto")
    o_true, _ = prefill_kv(inputs, _states(1, 4), cu, True)
    assert torch.isfinite(o_auto).all() and torch.isfinite(o_true).all()


@pytest.mark.parametrize("plan_seen_before_capture", [True, False])
def test_cp_graph_replay_with_new_values(plan_seen_before_capture):
    """CP captures into a CUDA graph (its per-plan segment table lives on the device) and replays
    correctly with new values; a plan first met inside a capture is refused with the remedy."""
    heads = 4
    # A plan no other test uses when it must be new to the capture (plans are cached per process).
    lengths = [3000, 700] if plan_seen_before_capture else [2900, 800]
    warm_lengths = lengths if plan_seen_before_capture else [2000, 1700]
    static = standard_inputs(1, sum(lengths), heads, device="cuda", slow_decay=True)
    cu = cu_seqlens_of(warm_lengths, "cuda")
    s0 = _states(2, heads)
    out = torch.empty_like(static["v"])
    final = torch.empty(2, heads, 128, 128, device="cuda")

    def run(cu_cpu):
        cula_aot.kda_prefill(
            static["q"],
            static["k"],
            static["v"],
            static["g"],
            static["beta"],
            A_log=static["A_log"],
            dt_bias=static["dt_bias"],
            lower_bound=static["lower_bound"],
            initial_state=s0,
            cu_seqlens=cu,
            cu_seqlens_cpu=cu_cpu,
            out=out,
            final_state=final,
            intracard_cp=4,
        )

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run(cu.cpu())  # warm-up: loads kernels, sizes the arena
    torch.cuda.current_stream().wait_stream(side)
    cu.copy_(cu_seqlens_of(lengths, "cuda"))
    graph = torch.cuda.CUDAGraph()
    if not plan_seen_before_capture:
        # Refused before any CUDA call, so the capture itself stays valid.
        with pytest.raises(cula_aot.KDAInputError, match="run the same call .* once before capturing"):
            with torch.cuda.graph(graph):
                run(cu_seqlens_of(lengths))
        return
    with torch.cuda.graph(graph):
        run(cu_seqlens_of(lengths))

    fresh = standard_inputs(1, sum(lengths), heads, device="cuda", slow_decay=True)
    for name in ("q", "k", "v", "g", "beta", "A_log", "dt_bias"):
        static[name].copy_(fresh[name])
    s0.copy_(_states(2, heads))
    out.fill_(float("nan"))
    final.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    o_eager, s_eager = prefill_kv(fresh, s0.transpose(-1, -2), cu, 4)
    assert torch.equal(out, o_eager) and torch.equal(final.transpose(-1, -2), s_eager)
    ref_o, _ = float64_prefill(fresh, s0.transpose(-1, -2), cu)
    assert reference.rel_rmse(out, ref_o) <= BOUND
