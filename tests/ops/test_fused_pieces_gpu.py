"""The fused kernel over certified pieces (``intracard_cp="truncated"``) where its table and its
hand-offs matter: CUDA-graph replays (the ready flags are zeroed by a memset node each time, so a
replay's waits never see an earlier replay's flags), state pools (fp32 and bf16, both layouts,
padding slots), the softplus gate, and a long hand-off chain (every piece of a
mixed-decay sequence waits for the one before it).  Float64 and the serial path are the
references; ``test_pieces_gpu.py`` covers the decay regimes."""

import pytest
import torch

import cula_aot
from cula_aot import reference
from tests.helpers import cu_seqlens_of, float64_prefill, fresh_seed, in_layout, prefill_kv, standard_inputs

pytestmark = pytest.mark.gpu

BOUND = 1e-2  # CONTRACT §8
LONG_MEMORY = -12.0


def _inputs(lengths, heads, regime, gate="safe"):
    x = standard_inputs(
        1, sum(lengths), heads, device="cuda", seed=fresh_seed(), slow_decay=regime == "slow", gate=gate
    )
    if regime == "mixed":
        x["dt_bias"][:, :4] = LONG_MEMORY
    return x


def _gate(x):
    """The gate's arguments (no lower bound under the softplus gate)."""
    return {"A_log": x["A_log"], "dt_bias": x["dt_bias"], "lower_bound": x.get("lower_bound")}


def _states(n, heads):
    gen = torch.Generator(device="cpu").manual_seed(fresh_seed())
    return (0.1 * torch.randn(n, heads, 128, 128, generator=gen)).cuda()


@pytest.mark.parametrize("regime", ["standard", "mixed"])
def test_graph_replays_equal_the_eager_call(regime):
    heads, lengths = 3, [5000, 1200]
    static = _inputs(lengths, heads, regime)
    cu = cu_seqlens_of(lengths, "cuda")
    cu_cpu = cu.cpu()  # a copy to the host cannot be captured
    s0 = _states(2, heads)
    out = torch.empty_like(static["v"])
    final = torch.empty(2, heads, 128, 128, device="cuda")

    def run():
        cula_aot.kda_prefill(
            *(static[name] for name in ("q", "k", "v", "g", "beta")),
            A_log=static["A_log"],
            dt_bias=static["dt_bias"],
            lower_bound=static["lower_bound"],
            initial_state=s0,
            cu_seqlens=cu,
            cu_seqlens_cpu=cu_cpu,
            out=out,
            final_state=final,
            intracard_cp="truncated",
        )

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # warm-up: loads the kernel, builds the plan's table
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    o_eager, s_eager = prefill_kv(static, s0.transpose(-1, -2), cu, "truncated")
    for _ in range(3):
        out.fill_(float("nan"))
        final.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, o_eager) and torch.equal(final.transpose(-1, -2), s_eager)
    ref_o, ref_s = float64_prefill(static, s0.transpose(-1, -2), cu)
    assert reference.rel_rmse(out, ref_o) <= BOUND and reference.rel_rmse(s_eager, ref_s) <= BOUND


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32 pool", "bf16 pool"])
@pytest.mark.parametrize("layout", ["vk", "kv"])
@pytest.mark.parametrize("regime", ["standard", "mixed"])
def test_pools_and_padding(dtype, layout, regime):
    """Pool slots in both layouts and dtypes, one padded sequence.  (An empty sequence never reaches
    this kernel: the pieces are planned from host lengths, which refuse it up front.)"""
    heads, lengths = 2, [4100, 2000, 33]
    x = _inputs(lengths, heads, regime)
    cu = cu_seqlens_of(lengths, "cuda")
    slots = torch.tensor([5, -1, 3], dtype=torch.int32, device="cuda")  # slot -1: padding
    pool = (0.1 * torch.randn(7, heads, 128, 128, device="cuda")).to(dtype)
    results = {}
    for path in ("truncated", False):
        p = in_layout(pool.float(), layout).to(dtype).contiguous()
        out = torch.full_like(x["v"], float("nan"))
        o, _ = cula_aot.kda_prefill(
            *(x[name] for name in ("q", "k", "v", "g", "beta")),
            A_log=x["A_log"],
            dt_bias=x["dt_bias"],
            lower_bound=x["lower_bound"],
            initial_state=p,
            final_state=p,
            state_indices=slots,
            cu_seqlens=cu,
            cu_seqlens_cpu=cu.cpu(),
            state_layout=layout,
            out=out,
            intracard_cp=path,
        )
        torch.cuda.synchronize()
        results[path] = (o, in_layout(p.float(), layout))
    (o, written), (o_serial, written_serial) = results["truncated"], results[False]
    # Every output written; the padded sequence starts from zero and writes no state, so the slots
    # no sequence names are untouched.
    assert torch.isfinite(o).all()
    assert torch.equal(written[[0, 1, 2, 4, 6]], pool.float()[[0, 1, 2, 4, 6]])
    s0 = pool.float()[[5, 3, 3]]
    s0[1] = 0.0
    ref_o, ref_s = float64_prefill(x, s0, cu)
    assert reference.rel_rmse(o, ref_o) <= BOUND
    assert reference.rel_rmse(written[[5, 3]], ref_s[[0, 2]]) <= BOUND
    assert reference.rel_rmse(o, o_serial) <= 5e-3 and reference.rel_rmse(written, written_serial) <= 5e-3


@pytest.mark.parametrize("regime", ["standard", "mixed"])
def test_softplus_gate(regime):
    heads, lengths = 4, [3000, 1100]
    x = _inputs(lengths, heads, regime, gate="softplus")
    cu = cu_seqlens_of(lengths, "cuda")
    s0 = _states(2, heads)
    results = []
    for path in ("truncated", False):
        final = torch.full((2, heads, 128, 128), float("nan"), device="cuda")
        o, _ = cula_aot.kda_prefill(
            *(x[name] for name in ("q", "k", "v", "g", "beta")),
            **_gate(x),
            gate="softplus",
            initial_state=s0.transpose(-1, -2).contiguous(),
            final_state=final,
            cu_seqlens=cu,
            cu_seqlens_cpu=cu.cpu(),
            out=torch.full_like(x["v"], float("nan")),
            intracard_cp=path,
        )
        torch.cuda.synchronize()
        results.append((o, final.transpose(-1, -2)))
    (o, s), (o_serial, s_serial) = results
    ref_o, ref_s = float64_prefill(x, s0, cu)
    assert reference.rel_rmse(o, ref_o) <= BOUND and reference.rel_rmse(s, ref_s) <= BOUND
    assert reference.rel_rmse(o, o_serial) <= 5e-3 and reference.rel_rmse(s, s_serial) <= 5e-3


def test_one_long_memory_channel_hands_its_head_off_exactly():
    """Inside and just outside the certified region, on the kernel: standard decay, but one key
    channel of head 1 keeps its memory.  Head 1's pieces cannot certify and take their
    predecessors' exact states: equal to the serial path to rounding (dropping head 1's state at
    every piece costs ~0.5 rel-RMSE: ``reference.kda_piece_table`` with every piece certified).
    Head 0's pieces certify: within float64's bound."""
    heads, lengths = 2, [8192]
    x = _inputs(lengths, heads, "standard")
    x["dt_bias"][1, 77] = LONG_MEMORY
    cu = cu_seqlens_of(lengths, "cuda")
    s0 = _states(1, heads)
    o, s = prefill_kv(x, s0, cu, "truncated")
    # The serial fused kernel does the same arithmetic per tile; K1 + K2, which the serial path
    # picks at two heads, differs from the pieces by bf16 rounding (6.8e-5 on an H100).
    o_serial, s_serial = prefill_kv(x, s0, cu, False, fused=True)
    ref_o, ref_s = float64_prefill(x, s0, cu)
    assert reference.rel_rmse(o[:, :, 1], o_serial[:, :, 1]) <= 1e-4
    assert reference.rel_rmse(s[:, 1], s_serial[:, 1]) <= 1e-4
    assert reference.rel_rmse(o[:, :, 0], ref_o[:, :, 0]) <= BOUND and reference.rel_rmse(s[:, 0], ref_s[:, 0]) <= BOUND
    assert reference.rel_rmse(o, ref_o) <= BOUND and reference.rel_rmse(s, ref_s) <= BOUND


def test_a_long_hand_off_chain():
    """Mixed decay at H2 over 32 768 tokens: the planner cuts each chain into many pieces, none
    certifies, so every piece waits for the one before it (a chain of hand-offs in launch order)."""
    heads, lengths = 2, [32768]
    x = _inputs(lengths, heads, "mixed")
    cu = cu_seqlens_of(lengths, "cuda")
    s0 = _states(1, heads)
    o, s = prefill_kv(x, s0, cu, "truncated")
    o_serial, s_serial = prefill_kv(x, s0, cu, False)
    assert reference.rel_rmse(o, o_serial) <= 5e-3 and reference.rel_rmse(s, s_serial) <= 5e-3


def test_a_slot_out_of_range_is_reported_and_padding_is_not():
    """The status word under the fused pieces: a pool slot past the pool (every piece of that
    sequence reads it) sets STATUS_SLOT_OUT_OF_RANGE once, writes nothing there, and its sequence
    starts from zero; -1 is padding and reports nothing."""
    heads, lengths = 2, [3000, 900]
    x = _inputs(lengths, heads, "standard")
    cu = cu_seqlens_of(lengths, "cuda")
    pool = 0.1 * torch.randn(4, heads, 128, 128, device="cuda")
    before = pool.clone()
    results = []
    for slots in ([9, 2], [-1, 2]):
        status = torch.zeros(1, dtype=torch.int32, device="cuda")
        p = before.clone()
        o, _ = cula_aot.kda_prefill(
            *(x[name] for name in ("q", "k", "v", "g", "beta")),
            **_gate(x),
            initial_state=p,
            final_state=p,
            state_indices=torch.tensor(slots, dtype=torch.int32, device="cuda"),
            cu_seqlens=cu,
            cu_seqlens_cpu=cu.cpu(),
            status=status,
            out=torch.full_like(x["v"], float("nan")),
            intracard_cp="truncated",
        )
        torch.cuda.synchronize()
        results.append((int(status.item()), o, p))
    (bad, o_bad, p_bad), (padded, o_pad, p_pad) = results
    assert bad == cula_aot.STATUS_SLOT_OUT_OF_RANGE and padded == 0
    # Both runs start sequence 0 from zero and write no state for it: the same outputs and pools.
    assert torch.equal(o_bad, o_pad) and torch.equal(p_bad, p_pad)
    assert torch.equal(p_bad[[0, 1, 3]], before[[0, 1, 3]])
    ref_o, ref_s = float64_prefill(x, torch.stack([torch.zeros_like(before[0]), before[2]]).transpose(-1, -2), cu)
    assert reference.rel_rmse(o_bad, ref_o) <= BOUND
    assert reference.rel_rmse(p_bad[2].transpose(-1, -2), ref_s[1]) <= BOUND
