"""Serial kda_prefill on the GPU against the float64 reference (CONTRACT §8).

Every case poisons ``out`` and ``final_state`` with NaN, draws fresh inputs, and prints its
rel-RMSE; the bound is CONTRACT §8's 1e-2 (target 5e-3).  An output that cancels is measured
against the size of the terms it sums (``_output_error``).
"""

import pytest
import torch

import cula_aot
from cula_aot import reference
from cula_aot.ops import plan_cache, prefill_plans
from cula_aot.ops.prefill import prefill
from cula_aot.specs import K2_V_BLOCKS
from tests.helpers import cu_seqlens_of, fresh_seed, standard_inputs

pytestmark = pytest.mark.gpu

BOUND = 1e-2
# The kernels' products take tf32 operands (2^-11 of each term), so where the reference output
# is a sum that cancels to below 1/CANCELLATION of its terms' size (one token of one head whose
# q̂·k̂ is near 0: ~1.4% of such draws cancel to a relative error above 1e-2 by rounding alone),
# its norm is floored at that size / CANCELLATION (a float64 model of that rounding: ≤ 5e-3 on
# 200 000 one-token draws).
CANCELLATION = 16


def _to_layout(state_kv, layout):
    """Reference states are S itself ([N, H, K, V]); "vk" stores Sᵀ per head."""
    return state_kv.transpose(-1, -2).contiguous() if layout == "vk" else state_kv.contiguous()


def _output_error(o, ref_o, inputs, s0, cu_seqlens) -> float:
    """‖o − ref‖ over ‖ref‖, the latter floored at the size of the terms it sums (the reference on
    |q|, |k|, |v| and |S0|) / CANCELLATION."""
    terms, _ = reference.kda_chunked(
        inputs["q"].abs(),
        inputs["k"].abs(),
        inputs["v"].abs(),
        inputs["g"],
        inputs["beta"],
        A_log=inputs["A_log"],
        dt_bias=inputs["dt_bias"],
        lower_bound=inputs["lower_bound"],
        initial_state=None if s0 is None else s0.abs(),
        cu_seqlens=cu_seqlens,
    )
    norm = max(float(torch.linalg.vector_norm(ref_o.double())), float(torch.linalg.vector_norm(terms)) / CANCELLATION)
    return float(torch.linalg.vector_norm(o.double() - ref_o.double())) / norm


def _run(inputs, *, cu_seqlens=None, init=True, final=True, layout="vk", v_block=None, fused=None, label=""):
    batch, seq_len, heads, _ = inputs["q"].shape
    n = batch if cu_seqlens is None else cu_seqlens.numel() - 1
    gen = torch.Generator(device="cpu").manual_seed(fresh_seed())
    s0 = (0.1 * torch.randn(n, heads, 128, 128, generator=gen)).cuda() if init else None
    out = torch.full_like(inputs["v"], float("nan"))
    final_buf = torch.full((n, heads, 128, 128), float("nan"), device="cuda") if final else None
    kwargs = dict(
        A_log=inputs["A_log"],
        dt_bias=inputs["dt_bias"],
        lower_bound=inputs["lower_bound"],
        initial_state=None if s0 is None else _to_layout(s0, layout),
        cu_seqlens=cu_seqlens,
        state_layout=layout,
        out=out,
        final_state=final_buf,
    )
    args = (inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"])
    if v_block is None and fused is None:
        o, fs = cula_aot.kda_prefill(*args, **kwargs)
    else:
        o, fs = prefill(*args, v_block=v_block, fused=fused, **kwargs)
    torch.cuda.synchronize()
    assert o.data_ptr() == out.data_ptr() and (fs is None) == (not final)
    ref_o, ref_s = reference.kda_chunked(
        *args,
        A_log=inputs["A_log"],
        dt_bias=inputs["dt_bias"],
        lower_bound=inputs["lower_bound"],
        initial_state=s0,
        cu_seqlens=cu_seqlens,
    )
    assert torch.isfinite(o).all(), f"{label}: unwritten or non-finite output"
    err_o = reference.rel_rmse(o, ref_o)
    report = f"prefill {label}: o rel-RMSE {err_o:.2e}"
    if err_o > BOUND:  # the floor only lowers the error: computed where it can matter
        err_o = _output_error(o, ref_o, inputs, s0, cu_seqlens)
        report += f" (against the terms' size / {CANCELLATION}: {err_o:.2e})"
    if final:
        assert torch.isfinite(fs).all(), f"{label}: unwritten or non-finite final state"
        got_s = fs.transpose(-1, -2) if layout == "vk" else fs
        err_s = reference.rel_rmse(got_s, ref_s)
        report += f", state rel-RMSE {err_s:.2e}"
        assert err_s <= BOUND, report
    print(report)
    assert err_o <= BOUND, report
    return o, fs


FIXED = [(1, 1), (2, 15), (3, 16), (1, 17), (2, 1000), (1, 4096)]


@pytest.mark.parametrize("heads", [1, 8, 64])
@pytest.mark.parametrize("case", range(len(FIXED)))
def test_fixed(heads, case):
    batch, seq_len = FIXED[case]
    init, final = [(True, True), (False, True), (True, False), (False, False)][(case + heads) % 4]
    layout = ("vk", "kv")[case % 2]
    inputs = standard_inputs(batch, seq_len, heads, device="cuda")
    _run(
        inputs,
        init=init,
        final=final,
        layout=layout,
        label=f"fixed B={batch} T={seq_len} H={heads} init={init} final={final} {layout}",
    )


VARLEN_LONG = [1, 16383, 17, 100, 1, 15, 16, 33, 16385, 7, 4096]


@pytest.mark.parametrize("heads", [1, 8])
@pytest.mark.parametrize("layout", ["vk", "kv"])
def test_varlen_long(heads, layout):
    inputs = standard_inputs(1, sum(VARLEN_LONG), heads, device="cuda")
    _run(
        inputs,
        cu_seqlens=cu_seqlens_of(VARLEN_LONG, "cuda"),
        layout=layout,
        label=f"varlen {len(VARLEN_LONG)} seqs H={heads} {layout}",
    )


def test_varlen_h64_int64_no_initial_state():
    lengths = [1, 300, 17, 16, 2047, 5, 64, 1000, 33, 2]
    inputs = standard_inputs(1, sum(lengths), 64, device="cuda")
    _run(
        inputs, cu_seqlens=cu_seqlens_of(lengths, "cuda").long(), init=False, label="varlen 10 seqs H=64 int64 no-init"
    )


@pytest.mark.parametrize("heads", [1, 8, 64])
def test_slow_decay_carries_state(heads):
    lengths = [4100, 3, 1500] if heads < 64 else [2000, 3, 700]
    inputs = standard_inputs(1, sum(lengths), heads, device="cuda", slow_decay=True)
    _run(inputs, cu_seqlens=cu_seqlens_of(lengths, "cuda"), label=f"slow-decay varlen H={heads}")
    fixed = standard_inputs(2, 3000, heads, device="cuda", slow_decay=True)
    _run(fixed, layout="kv", label=f"slow-decay fixed B=2 T=3000 H={heads}")


@pytest.mark.parametrize("v_block", K2_V_BLOCKS)
def test_every_built_v_block(v_block):
    lengths = [700, 33, 1]
    inputs = standard_inputs(1, sum(lengths), 8, device="cuda")
    _run(inputs, cu_seqlens=cu_seqlens_of(lengths, "cuda"), v_block=v_block, label=f"v_block={v_block}")


def _bits(inputs, cu, v_block, fused=None):
    """(out, final state) of a varlen (or, ``cu`` None, fixed-length) call as raw bits, from a fresh plan."""
    args = (inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"])
    n = inputs["q"].shape[0] if cu is None else cu.numel() - 1
    s0 = 0.1 * torch.ones(n, inputs["q"].shape[2], 128, 128, device="cuda")
    o, fs = prefill(
        *args,
        A_log=inputs["A_log"],
        dt_bias=inputs["dt_bias"],
        lower_bound=inputs["lower_bound"],
        cu_seqlens=cu,
        initial_state=s0,
        output_final_state=True,
        v_block=v_block,
        fused=fused,
    )
    return o.view(torch.int16).clone(), fs.view(torch.int32).clone()


@pytest.mark.parametrize("v_block", K2_V_BLOCKS)
def test_multicast_and_grid_order_change_no_bit(v_block, monkeypatch):
    # The cluster multicast moves the same record bytes, and the longest-first grid order only
    # changes which CTA runs a sequence: every combination is bitwise the plain kernels' result.
    from cula_aot.layout import FLAG_LONGEST_FIRST
    from cula_aot.specs import K2_MULTICAST_V_BLOCKS, K2Spec

    lengths = [5, 300, 17, 300, 64, 1, 1000, 64]  # ties, a long one in the middle
    inputs = standard_inputs(1, sum(lengths), 8, device="cuda")
    cu = cu_seqlens_of(lengths, "cuda")
    results = {}
    for multicast in {False, v_block in K2_MULTICAST_V_BLOCKS}:
        for order in (0, FLAG_LONGEST_FIRST):
            monkeypatch.setattr(
                prefill_plans,
                "serial_k2_spec",
                lambda vl, vb, checkpointing=False, *, m=multicast: K2Spec(varlen=vl, v_block=vb, multicast=m),
            )
            monkeypatch.setattr(prefill_plans, "SERIAL_K2_ORDER", order)
            monkeypatch.setattr(plan_cache, "PLANS", plan_cache.PlanCache())
            results[multicast, order] = _bits(inputs, cu, v_block)
    first = results[False, 0]
    for key, (o, fs) in results.items():
        assert torch.equal(o, first[0]) and torch.equal(fs, first[1]), f"v_block={v_block} (multicast, order)={key}"


def test_wgmma_k2_meets_the_bound_and_matches_the_warp_mma_k2(monkeypatch):
    # The one-warpgroup V block runs Sᵀ·kdᵀ, Sᵀ·qdᵀ and the state update as warpgroup MMAs
    # (shared-memory descriptors over the record's images): against float64 on standard and
    # slow-decay input, with and without multicast (bitwise the same), and against the warp-MMA
    # kernel of the same V block, which differs only in fp32 accumulation order.
    from cula_aot.specs import K2_WGMMA_V_BLOCK, K2Spec, serial_k2_spec

    assert serial_k2_spec(True, K2_WGMMA_V_BLOCK).wgmma
    lengths = [700, 33, 1, 2100]
    cu = cu_seqlens_of(lengths, "cuda")
    for slow_decay in (False, True):
        inputs = standard_inputs(1, sum(lengths), 8, device="cuda", slow_decay=slow_decay)
        bits = {}
        for wgmma in (True, False):
            for multicast in (False, True):
                monkeypatch.setattr(
                    prefill_plans,
                    "serial_k2_spec",
                    lambda vl, vb, checkpointing=False, *, w=wgmma, m=multicast: K2Spec(
                        varlen=vl, v_block=vb, multicast=m, wgmma=w
                    ),
                )
                monkeypatch.setattr(plan_cache, "PLANS", plan_cache.PlanCache())
                if wgmma:
                    _run(
                        inputs,
                        cu_seqlens=cu,
                        v_block=K2_WGMMA_V_BLOCK,
                        label=f"wgmma multicast={multicast} slow_decay={slow_decay}",
                    )
                bits[wgmma, multicast] = _bits(inputs, cu, K2_WGMMA_V_BLOCK)
        for key in ((True, True), (False, True)):
            same = bits[(key[0], False)]
            assert torch.equal(bits[key][0], same[0]) and torch.equal(bits[key][1], same[1]), key
        (o_wg, s_wg), (o_warp, s_warp) = bits[True, False], bits[False, False]
        err_o = reference.rel_rmse(o_wg.view(torch.bfloat16).float(), o_warp.view(torch.bfloat16).float())
        err_s = reference.rel_rmse(s_wg.view(torch.float32), s_warp.view(torch.float32))
        print(f"wgmma vs warp MMA (slow_decay={slow_decay}): o {err_o:.2e}, state {err_s:.2e}")
        assert err_o <= 5e-3 and err_s <= 5e-3


@pytest.mark.parametrize("slow_decay", [False, True])
def test_fused_prefill_meets_the_bound_and_tracks_the_two_kernel_path(slow_decay):
    # The fused kernel runs K1's and the 64-column wgmma K2's work with the records in shared
    # memory (and kr as k̂·2^−G·2^G[15], one rounding off K1's): against float64, against K1 then
    # K2 at v_block 64, and bitwise against itself, varlen (ragged tails, one-token and one-tile
    # sequences) and fixed.
    lengths = [700, 33, 1, 2100, 16, 17, 250]
    cu = cu_seqlens_of(lengths, "cuda")
    inputs = standard_inputs(1, sum(lengths), 8, device="cuda", slow_decay=slow_decay)
    fixed = standard_inputs(3, 1000, 8, device="cuda", slow_decay=slow_decay)
    _run(inputs, cu_seqlens=cu, fused=True, label=f"fused varlen H=8 slow_decay={slow_decay}")
    _run(fixed, layout="kv", fused=True, label=f"fused fixed B=3 T=1000 H=8 kv slow_decay={slow_decay}")
    for x, c in ((inputs, cu), (fixed, None)):
        fused, again, two = _bits(x, c, None, fused=True), _bits(x, c, None, fused=True), _bits(x, c, 64, fused=False)
        assert torch.equal(fused[0], again[0]) and torch.equal(fused[1], again[1]), "fused prefill is not deterministic"
        err_o = reference.rel_rmse(fused[0].view(torch.bfloat16).float(), two[0].view(torch.bfloat16).float())
        err_s = reference.rel_rmse(fused[1].view(torch.float32), two[1].view(torch.float32))
        print(f"fused vs K1 + K2 (slow_decay={slow_decay}, varlen={c is not None}): o {err_o:.2e}, state {err_s:.2e}")
        assert err_o <= 5e-3 and err_s <= 5e-3


@pytest.mark.parametrize("case", range(len(FIXED)))
def test_fused_fixed_states_and_layouts(case):
    batch, seq_len = FIXED[case]
    init, final = [(True, True), (False, True), (True, False), (False, False)][case % 4]
    layout = ("vk", "kv")[case % 2]
    heads = (1, 64)[case % 2]
    inputs = standard_inputs(batch, seq_len, heads, device="cuda")
    _run(
        inputs,
        init=init,
        final=final,
        layout=layout,
        fused=True,
        label=f"fused fixed B={batch} T={seq_len} H={heads} init={init} final={final} {layout}",
    )


@pytest.mark.parametrize("count", [128, 129])
def test_longest_first_up_to_its_limit_and_index_order_past_it(count):
    # ORDER_MAX_SEQS (128) sequences are ranked on the device; one more runs in index order.
    from cula_aot.layout import ORDER_MAX_SEQS

    assert ORDER_MAX_SEQS == 128
    lengths = [1 + (37 * i) % 61 for i in range(count)]
    lengths[count // 2] = 700
    inputs = standard_inputs(1, sum(lengths), 1, device="cuda")
    _run(inputs, cu_seqlens=cu_seqlens_of(lengths, "cuda"), label=f"varlen {count} seqs H=1")


def test_two_runs_are_bitwise_equal():
    lengths = [1000, 17, 3000]
    inputs = standard_inputs(1, sum(lengths), 8, device="cuda")
    cu = cu_seqlens_of(lengths, "cuda")
    o1, s1 = _run(inputs, cu_seqlens=cu, label="determinism run 1")
    o1, s1 = o1.clone(), s1.clone()
    s0 = torch.zeros(3, 8, 128, 128, device="cuda")
    args = (inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"])
    kw = dict(A_log=inputs["A_log"], dt_bias=inputs["dt_bias"], lower_bound=inputs["lower_bound"], cu_seqlens=cu)
    a = cula_aot.kda_prefill(*args, initial_state=s0, output_final_state=True, **kw)
    b = cula_aot.kda_prefill(*args, initial_state=s0, output_final_state=True, **kw)
    assert torch.equal(a[0].view(torch.int16), b[0].view(torch.int16))
    assert torch.equal(a[1].view(torch.int32), b[1].view(torch.int32))


def test_defaults_and_fwd_in_place():
    inputs = standard_inputs(2, 50, 8, device="cuda", seed=fresh_seed())
    args = (inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"])
    kw = dict(A_log=inputs["A_log"], dt_bias=inputs["dt_bias"], lower_bound=inputs["lower_bound"])
    o, fs = cula_aot.kda_prefill(*args, **kw)
    assert fs is None and o.shape == inputs["v"].shape and o.dtype == torch.bfloat16
    o2, fs2 = cula_aot.kda_prefill(*args, output_final_state=True, **kw)
    assert fs2.shape == (2, 8, 128, 128) and fs2.dtype == torch.float32
    assert torch.equal(o, o2)
    out = torch.full_like(o, float("nan"))
    final = torch.full_like(fs2, float("nan"))
    assert (
        cula_aot.fwd(*args, None, out, inputs["A_log"], inputs["dt_bias"], inputs["lower_bound"], final_state=final)
        is None
    )
    assert torch.equal(out, o) and torch.equal(final, fs2)


def test_scale_and_lower_bound_are_runtime():
    inputs = standard_inputs(1, 200, 8, device="cuda")
    args = (inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"])
    for lower_bound, scale in ((-0.5, 0.3), (-4.0, None)):
        o, _ = cula_aot.kda_prefill(
            *args, A_log=inputs["A_log"], dt_bias=inputs["dt_bias"], lower_bound=lower_bound, scale=scale
        )
        ref, _ = reference.kda_chunked(
            *args, A_log=inputs["A_log"], dt_bias=inputs["dt_bias"], lower_bound=lower_bound, scale=scale
        )
        assert reference.rel_rmse(o, ref) <= BOUND
