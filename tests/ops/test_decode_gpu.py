"""kda_decode on the GPU against the float64 token recurrence (CONTRACT §8, §10).

Every case poisons ``out`` and ``intermediate_states`` with NaN, draws fresh inputs (token-
strided views of one fused projection, β at an unaligned offset) and a pool with more slots
than sequences (padded slot stride in some cases), and prints its rel-RMSE; the bound is
CONTRACT §8's 1e-2 (target 5e-3).
"""

import pytest
import torch

import cula_aot
from cula_aot import reference
from cula_aot.ops.decode import decode
from cula_aot.specs import DECODE_CHUNK_VARIANTS, DECODE_VARIANTS
from tests.decode_helpers import decode_reference, from_pool_layout, fused_inputs, to_pool_layout
from tests.helpers import fresh_seed, standard_inputs

pytestmark = pytest.mark.gpu

BOUND = 1e-2
D = 128


def _pool(slots, heads, dtype, layout, *, pad=0, seed=0):
    """A pool of 0.1·N(0,1) states, each slot padded by ``pad`` elements, and its S values
    ([slots, H, K, V] float64, exactly as stored)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    per_slot = heads * D * D
    storage = torch.empty(slots * (per_slot + pad), device="cuda", dtype=dtype)
    pool = storage.as_strided((slots, heads, D, D), (per_slot + pad, D * D, D, 1))
    pool.copy_((0.1 * torch.randn(slots, heads, D, D, generator=gen, device="cuda")).to(dtype))
    return pool


def _run_case(
    n, tokens, heads, dtype, layout, *, pad=0, padding=(), variant=None, inter=True, label="", slow_decay=False
):
    seed = fresh_seed()
    x = fused_inputs(n, tokens, heads, device="cuda", seed=seed)
    if slow_decay:  # α ≈ 1: the state and every earlier token's update survive each step
        x.update(A_log=torch.full((heads,), -4.0, device="cuda"), lower_bound=-0.05)
    slots = n + 5
    pool = _pool(slots, heads, dtype, layout, pad=pad, seed=seed + 1)
    perm = torch.randperm(slots, generator=torch.Generator().manual_seed(seed))[:n].to(torch.int32)
    for i in padding:
        perm[i] = -1 if i % 2 == 0 else -7
    indices = perm.cuda()
    before = pool.clone()
    out = torch.full((n, tokens, heads, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    inter_buf = torch.full((n, tokens, heads, D, D), float("nan"), device="cuda", dtype=dtype) if inter else None
    o = decode(
        x["q"],
        x["k"],
        x["v"],
        x["g"],
        x["beta"],
        A_log=x["A_log"],
        dt_bias=x["dt_bias"],
        lower_bound=x["lower_bound"],
        state_pool=pool,
        state_indices=indices,
        out=out,
        state_layout=layout,
        intermediate_states=inter_buf,
        variant=variant,
    )
    torch.cuda.synchronize()
    assert o.data_ptr() == out.data_ptr()
    valid = [i for i in range(n) if i not in padding]
    rows = perm[valid].long()
    s0 = from_pool_layout(before[rows].to(torch.float64), layout)
    sel = {name: x[name][valid] for name in ("q", "k", "v", "g", "beta")}
    ref_o, ref_states = decode_reference(
        **sel, A_log=x["A_log"], dt_bias=x["dt_bias"], lower_bound=x["lower_bound"], initial_state=s0
    )
    report = f"decode {label} seed={seed}"
    assert torch.isfinite(out[valid]).all(), f"{report}: unwritten or non-finite output"
    err_o = reference.rel_rmse(out[valid], ref_o)
    new_s = from_pool_layout(pool[rows], layout)
    err_s = reference.rel_rmse(new_s, ref_states[:, -1])
    report += f": o rel-RMSE {err_o:.2e}, state rel-RMSE {err_s:.2e}"
    if padding:
        assert bool((out[list(padding)] == 0).all()), f"{report}: padding rows' outputs are not zero"
    untouched = [s for s in range(slots) if s not in set(rows.tolist())]
    assert torch.equal(
        pool[untouched].view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
        before[untouched].view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
    ), f"{report}: a slot that no sequence owns changed"
    if inter:
        got = from_pool_layout(inter_buf[valid], layout)
        err_i = reference.rel_rmse(got, ref_states)
        report += f", intermediates rel-RMSE {err_i:.2e}"
        assert err_i <= BOUND, report
        assert torch.equal(inter_buf[valid][:, -1], pool[rows]), f"{report}: last intermediate != new pool state"
        if padding:
            assert bool(torch.isnan(inter_buf[list(padding)].float()).all()), f"{report}: padding rows written"
    print(report)
    assert err_o <= BOUND and err_s <= BOUND, report
    return err_o, err_s


CASES = [  # (N, T, H, pool dtype, layout, slot padding, padding rows)
    (1, 1, 4, torch.float32, "vk", 0, ()),
    (7, 1, 8, torch.bfloat16, "kv", 64, (2,)),
    (16, 4, 16, torch.float32, "kv", 0, (0, 15)),
    (5, 8, 4, torch.bfloat16, "vk", 8, (1, 3)),
    (33, 2, 32, torch.float32, "vk", 4, (7,)),
    (3, 3, 64, torch.bfloat16, "vk", 0, ()),
    (64, 1, 64, torch.float32, "kv", 0, (10, 11)),
    (9, 5, 1, torch.float32, "vk", 0, (4,)),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_float64_recurrence(case):
    n, tokens, heads, dtype, layout, pad, padding = CASES[case]
    _run_case(
        n,
        tokens,
        heads,
        dtype,
        layout,
        pad=pad,
        padding=padding,
        inter=tokens > 1,
        label=f"N={n} T={tokens} H={heads} {str(dtype)[6:]} {layout} pad={pad} padding={padding}",
    )


VARIANTS = list(DECODE_VARIANTS)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["vk", "kv"])
def test_every_built_variant(variant, dtype, layout):
    """Every (v_block, items) kernel, with T = 3 and T = 8 (the most tokens: two rounds of v / o
    staging for four-item CTAs, the stage refilled three times), padding rows and intermediate
    states."""
    for tokens in (3, 8):
        _run_case(
            6,
            tokens,
            8,
            dtype,
            layout,
            padding=(4,),
            variant=variant,
            pad=8 if tokens == 8 else 0,
            label=f"variant={variant} T={tokens} {str(dtype)[6:]} {layout}",
        )


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("tokens", [1, 2, 3, 8])
def test_slow_decay_matches_float64_recurrence(variant, tokens):
    """Slow decay (A_log = −4, lower_bound = −0.05: α ≈ 1, so the initial state and every earlier
    token's update survive each step, which standard draws, forgetting most keys, barely test):
    every built variant, both pool dtypes and layouts, with and without intermediates (separate
    token loops in the kernel)."""
    for dtype, layout in ((torch.bfloat16, "vk"), (torch.float32, "kv")):
        for inter in (False, True):
            _run_case(
                6,
                tokens,
                8,
                dtype,
                layout,
                padding=(1,),
                variant=variant,
                inter=inter,
                slow_decay=True,
                label=f"slow decay variant={variant} T={tokens} {str(dtype)[6:]} {layout} inter={inter}",
            )


@pytest.mark.parametrize("warps_items", DECODE_CHUNK_VARIANTS)
@pytest.mark.parametrize("tokens", [2, 3, 4])
@pytest.mark.parametrize("slow_decay", [False, True])
def test_chunk_kernel_matches_float64_recurrence(warps_items, tokens, slow_decay):
    """The tensor-core chunk kernel (bf16 "vk" pools, 2–4 tokens, no intermediates) on every
    built CTA size: padding rows of both kinds, a padded slot stride, one head and many heads."""
    for n, heads, pad, padding in ((9, 8, 8, (2, 5)), (3, 64, 0, ()), (5, 1, 64, (0,))):
        _run_case(
            n,
            tokens,
            heads,
            torch.bfloat16,
            "vk",
            pad=pad,
            padding=padding,
            variant=("chunk", *warps_items),
            inter=False,
            slow_decay=slow_decay,
            label=f"chunk{warps_items} T={tokens} N={n} H={heads} slow={slow_decay}",
        )


def test_chunk_variant_refuses_what_it_cannot_run():
    """An explicit chunk variant with intermediate states, a fp32 pool or T = 1 is rejected before
    anything is written."""
    x = fused_inputs(2, 2, 8, device="cuda", seed=0)
    for dtype, tokens, inter in ((torch.bfloat16, 2, True), (torch.float32, 2, False), (torch.bfloat16, 1, False)):
        y = {n: (t[:, :tokens] if n in ("q", "k", "v", "g", "beta") else t) for n, t in x.items()}
        pool = _pool(2, 8, dtype, "vk")
        before = pool.clone()
        out = torch.full((2, tokens, 8, D), 7.0, device="cuda", dtype=torch.bfloat16)
        buf = torch.full((2, tokens, 8, D, D), 3.0, device="cuda", dtype=dtype) if inter else None
        with pytest.raises(ValueError, match="chunk kernel"):
            decode(
                y["q"],
                y["k"],
                y["v"],
                y["g"],
                y["beta"],
                A_log=y["A_log"],
                dt_bias=y["dt_bias"],
                lower_bound=y["lower_bound"],
                state_pool=pool,
                state_indices=torch.arange(2, dtype=torch.int32, device="cuda"),
                out=out,
                intermediate_states=buf,
                variant=("chunk", 4, 2),
            )
        assert torch.equal(pool, before) and bool((out == 7.0).all())
        assert buf is None or bool((buf == 3.0).all())


def _plain_call(x, pool, indices, layout="vk", **kw):
    return cula_aot.kda_decode(
        x["q"],
        x["k"],
        x["v"],
        x["g"],
        x["beta"],
        A_log=x["A_log"],
        dt_bias=x["dt_bias"],
        lower_bound=x["lower_bound"],
        state_pool=pool,
        state_indices=indices,
        state_layout=layout,
        **kw,
    )


def test_several_calls_on_one_pool():
    """Two decode steps on the same slots, and a second batch on other slots of the same pool."""
    heads, layout = 8, "kv"
    seed = fresh_seed()
    pool = _pool(12, heads, torch.float32, layout, seed=seed)
    before = pool.clone()
    a = torch.tensor([3, 0, 7], dtype=torch.int32, device="cuda")
    b = torch.tensor([5, -1, 11, 1], dtype=torch.int32, device="cuda")
    x1 = fused_inputs(3, 2, heads, device="cuda", seed=seed + 1)
    x2 = fused_inputs(3, 1, heads, device="cuda", seed=seed + 2)
    y = fused_inputs(4, 3, heads, device="cuda", seed=seed + 3)
    o1 = _plain_call(x1, pool, a, layout)
    oy = _plain_call(y, pool, b, layout)
    o2 = _plain_call(x2, pool, a, layout)
    torch.cuda.synchronize()
    common = dict(A_log=x1["A_log"], dt_bias=x1["dt_bias"], lower_bound=-5.0)
    s0 = from_pool_layout(before[a.long()].double(), layout)
    r1, st1 = decode_reference(**{n: x1[n] for n in ("q", "k", "v", "g", "beta")}, **common, initial_state=s0)
    r2, st2 = decode_reference(
        **{n: x2[n] for n in ("q", "k", "v", "g", "beta")},
        A_log=x2["A_log"],
        dt_bias=x2["dt_bias"],
        lower_bound=-5.0,
        initial_state=st1[:, -1],
    )
    rows_b = [0, 2, 3]
    sy = from_pool_layout(before[b[rows_b].long()].double(), layout)
    ry, sty = decode_reference(
        **{n: y[n][rows_b] for n in ("q", "k", "v", "g", "beta")},
        A_log=y["A_log"],
        dt_bias=y["dt_bias"],
        lower_bound=-5.0,
        initial_state=sy,
    )
    errs = [
        reference.rel_rmse(o1, r1),
        reference.rel_rmse(o2, r2),
        reference.rel_rmse(oy[rows_b], ry),
        reference.rel_rmse(from_pool_layout(pool[a.long()], layout), st2[:, -1]),
        reference.rel_rmse(from_pool_layout(pool[b[rows_b].long()], layout), sty[:, -1]),
    ]
    print("several calls on one pool: rel-RMSE", [f"{e:.2e}" for e in errs])
    assert max(errs) <= BOUND
    assert bool((oy[1] == 0).all())
    for s in (2, 4, 6, 8, 9, 10):
        assert torch.equal(pool[s], before[s])


@pytest.mark.parametrize("inter", [True, False])
def test_bitwise_deterministic(inter):
    """Both kernels of a bf16 "vk" pool at T = 4: the token kernel (intermediates) and the chunk kernel."""
    x = fused_inputs(40, 4, 16, device="cuda", seed=fresh_seed())
    pool = _pool(48, 16, torch.bfloat16, "vk", seed=1)
    indices = torch.randperm(48)[:40].to(torch.int32).cuda()
    results = []
    for _ in range(2):
        p = pool.clone()
        buf = torch.empty(40, 4, 16, D, D, device="cuda", dtype=torch.bfloat16) if inter else None
        o = _plain_call(x, p, indices, intermediate_states=buf)
        torch.cuda.synchronize()
        results.append((o.view(torch.int16), p.view(torch.int16)) + ((buf.view(torch.int16),) if inter else ()))
    for first, second in zip(*results):
        assert torch.equal(first, second)


def test_token_major_3d_input():
    n, tokens, heads = 6, 3, 4
    x = fused_inputs(n, tokens, heads, device="cuda", seed=fresh_seed())
    pool = _pool(n, heads, torch.float32, "vk", seed=2)
    indices = torch.arange(n, dtype=torch.int32, device="cuda")
    p4 = pool.clone()
    o4 = _plain_call(x, p4, indices)
    flat = {name: (x[name].flatten(0, 1) if name in ("q", "k", "v", "g", "beta") else x[name]) for name in x}
    o3 = _plain_call(flat, pool, indices, num_tokens=tokens)
    torch.cuda.synchronize()
    assert o3.shape == (n * tokens, heads, D)
    assert torch.equal(o3.view(torch.int16), o4.flatten(0, 1).view(torch.int16)) and torch.equal(pool, p4)


@pytest.mark.parametrize("layout", ["vk", "kv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_then_decode_equals_one_prefill(layout, dtype):
    """kda_prefill of T0 tokens (final state into a pool slot), then decode steps of 1, 4 and 2
    tokens from that slot, equals one kda_prefill of all T0 + 7 tokens (CONTRACT §10)."""
    heads, t0, steps = 8, 37, (1, 4, 2)
    total = t0 + sum(steps)
    x = standard_inputs(2, total, heads, device="cuda")
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    common = dict(A_log=x["A_log"], dt_bias=x["dt_bias"], lower_bound=x["lower_bound"])
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed())
    s0_kv = 0.1 * torch.randn(2, heads, D, D, generator=gen, device="cuda")
    s0 = to_pool_layout(s0_kv, layout).contiguous()
    o_full, s_full = cula_aot.kda_prefill(
        *args, **common, initial_state=s0, output_final_state=True, state_layout=layout
    )
    o_pre, s_pre = cula_aot.kda_prefill(
        *(a[:, :t0].contiguous() for a in args),
        **common,
        initial_state=s0,
        output_final_state=True,
        state_layout=layout,
    )
    pool = torch.zeros(5, heads, D, D, device="cuda", dtype=dtype)
    indices = torch.tensor([4, 1], dtype=torch.int32, device="cuda")
    pool[indices.long()] = s_pre.to(dtype)
    pieces, start = [o_pre], t0
    for step in steps:
        sl = slice(start, start + step)
        pieces.append(
            cula_aot.kda_decode(
                *(a[:, sl] for a in args), **common, state_pool=pool, state_indices=indices, state_layout=layout
            )
        )
        start += step
    torch.cuda.synchronize()
    o_mixed = torch.cat(pieces, 1)
    tail = slice(t0, total)
    err_o = reference.rel_rmse(o_mixed[:, tail], o_full[:, tail])
    err_s = reference.rel_rmse(pool[indices.long()].float(), s_full)
    ref_o, ref_s = reference.kda_recurrent(*args, **common, initial_state=s0_kv)
    err_ref = reference.rel_rmse(o_mixed[:, tail], ref_o[:, tail])
    err_ref_s = reference.rel_rmse(from_pool_layout(pool[indices.long()].double(), layout), ref_s)
    print(
        f"prefill {t0} + decode {steps} vs one prefill ({layout}, {str(dtype)[6:]} pool): o {err_o:.2e}, "
        f"state {err_s:.2e}; vs float64: o {err_ref:.2e}, state {err_ref_s:.2e}"
    )
    assert max(err_o, err_s, err_ref, err_ref_s) <= BOUND


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_capture_and_replay_with_new_values(dtype):
    """fp32 with intermediates (the token kernel), bf16 without (the chunk kernel)."""
    n, tokens, heads = 24, 2, 16
    seed = fresh_seed()
    x = fused_inputs(n, tokens, heads, device="cuda", seed=seed)
    pool = _pool(n + 8, heads, dtype, "vk", seed=seed)
    indices = torch.randperm(n + 8)[:n].to(torch.int32).cuda()
    out = torch.empty(n, tokens, heads, D, device="cuda", dtype=torch.bfloat16)
    inter = torch.empty(n, tokens, heads, D, D, device="cuda", dtype=dtype) if dtype == torch.float32 else None

    def step():
        _plain_call(x, pool, indices, out=out, intermediate_states=inter)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up: loads the kernel
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        step()
    torch.cuda.synchronize()
    for trial in range(2):
        fresh = fused_inputs(n, tokens, heads, device="cuda", seed=seed + 10 + trial)
        for name in ("q", "k", "v", "g", "beta", "A_log", "dt_bias"):
            x[name].copy_(fresh[name])
        indices.copy_(torch.randperm(n + 8)[:n].to(torch.int32))
        indices[3] = -1
        pool.copy_(_pool(n + 8, heads, dtype, "vk", seed=seed + 20 + trial))
        expect_pool = pool.clone()
        expect = _plain_call(x, expect_pool, indices)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), expect.view(torch.int16)), f"replay {trial}: outputs differ"
        assert torch.equal(pool, expect_pool), f"replay {trial}: pool differs"
        valid = [i for i in range(n) if i != 3]
        s0 = from_pool_layout(
            _pool(n + 8, heads, dtype, "vk", seed=seed + 20 + trial)[indices[valid].long()].double(), "vk"
        )
        ref_o, _ = decode_reference(
            **{k: x[k][valid] for k in ("q", "k", "v", "g", "beta")},
            A_log=x["A_log"],
            dt_bias=x["dt_bias"],
            lower_bound=-5.0,
            initial_state=s0,
        )
        err = reference.rel_rmse(out[valid], ref_o)
        print(f"graph replay {trial}: o rel-RMSE {err:.2e}")
        assert err <= BOUND and bool((out[3] == 0).all())
