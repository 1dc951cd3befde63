"""The custom op under opcheck and torch.compile, and CUDA-graph capture/replay of a prefill."""

import pytest
import torch

import cula_aot
from cula_aot import reference
from tests.helpers import cu_seqlens_of, standard_inputs

pytestmark = pytest.mark.gpu


def _op_args(inputs, cu=None):
    args = (
        inputs["q"],
        inputs["k"],
        inputs["v"],
        inputs["g"],
        inputs["beta"],
        inputs["A_log"],
        inputs["dt_bias"],
        inputs["lower_bound"],
    )
    kwargs = {"output_final_state": True, "cu_seqlens": cu, "cu_seqlens_cpu": None if cu is None else cu.cpu()}
    return args, kwargs


@pytest.mark.parametrize("varlen", [False, True])
def test_opcheck(varlen):
    if varlen:
        inputs = standard_inputs(1, 100, 4, device="cuda")
        args, kwargs = _op_args(inputs, cu_seqlens_of([30, 70], "cuda"))
    else:
        inputs = standard_inputs(2, 50, 4, device="cuda")
        args, kwargs = _op_args(inputs)
    torch.library.opcheck(torch.ops.cula_aot.kda_prefill.default, args, kwargs)


def test_torch_compile_matches_eager():
    inputs = standard_inputs(1, 200, 8, device="cuda")
    cu = cu_seqlens_of([120, 80], "cuda")
    args, kwargs = _op_args(inputs, cu)

    def f(*a):
        o, s = torch.ops.cula_aot.kda_prefill(*a, **kwargs)
        return o.float() * 2, s + 1

    compiled = torch.compile(f, fullgraph=True)
    got = compiled(*args)
    want = f(*args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("varlen", [False, True])
def test_cuda_graph_replay_matches_eager(varlen):
    lengths = [300, 17, 500]
    batch, total = (1, sum(lengths)) if varlen else (2, 400)
    static = standard_inputs(batch, total, 8, device="cuda")
    cu = cu_seqlens_of(lengths, "cuda") if varlen else None
    cu_cpu = None if cu is None else cu.cpu()  # host lengths: no device→host copy under capture
    n = len(lengths) if varlen else batch
    s0 = 0.1 * torch.randn(n, 8, 128, 128, device="cuda")
    out = torch.empty_like(static["v"])
    final = torch.empty_like(s0)

    def run():
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
            intracard_cp=False,
        )

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # warm-up: loads modules, sizes the arena of the capture stream
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()

    # Replays with new inputs each: every replay must see its own K1's records.
    for _ in range(3):
        fresh = standard_inputs(batch, total, 8, device="cuda")
        for name in ("q", "k", "v", "g", "beta", "A_log", "dt_bias"):
            static[name].copy_(fresh[name])
        out.fill_(float("nan"))
        final.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        o_eager, s_eager = cula_aot.kda_prefill(
            fresh["q"],
            fresh["k"],
            fresh["v"],
            fresh["g"],
            fresh["beta"],
            A_log=fresh["A_log"],
            dt_bias=fresh["dt_bias"],
            lower_bound=fresh["lower_bound"],
            initial_state=s0,
            cu_seqlens=cu,
            output_final_state=True,
            intracard_cp=False,
        )
        assert torch.equal(out, o_eager) and torch.equal(final, s_eager)
    ref_o, _ = reference.kda_chunked(
        fresh["q"],
        fresh["k"],
        fresh["v"],
        fresh["g"],
        fresh["beta"],
        A_log=fresh["A_log"],
        dt_bias=fresh["dt_bias"],
        lower_bound=fresh["lower_bound"],
        initial_state=s0.transpose(-1, -2),
        cu_seqlens=cu,
    )
    assert reference.rel_rmse(out, ref_o) <= 1e-2


def test_pool_op_under_opcheck_and_compile():
    heads = 4
    inputs = standard_inputs(1, 100, heads, device="cuda")
    cu = cu_seqlens_of([30, 70], "cuda")
    pool = 0.1 * torch.randn(5, heads, 128, 128, device="cuda")
    indices = torch.tensor([3, -1], dtype=torch.int32, device="cuda")
    args = (
        inputs["q"],
        inputs["k"],
        inputs["v"],
        inputs["g"],
        inputs["beta"],
        inputs["A_log"],
        inputs["dt_bias"],
        inputs["lower_bound"],
        pool,
        indices,
    )
    torch.library.opcheck(torch.ops.cula_aot.kda_prefill_pool.default, args, {"cu_seqlens": cu})

    start = pool.clone()
    eager_pool = start.clone()
    o_eager, _ = cula_aot.kda_prefill(
        *args[:5],
        A_log=inputs["A_log"],
        dt_bias=inputs["dt_bias"],
        lower_bound=inputs["lower_bound"],
        initial_state=eager_pool,
        output_final_state=True,
        state_indices=indices,
        cu_seqlens=cu,
    )
    pool.copy_(start)
    compiled = torch.compile(lambda *a: torch.ops.cula_aot.kda_prefill_pool(*a, cu_seqlens=cu) * 1, fullgraph=True)
    o = compiled(*args)
    assert torch.equal(o, o_eager) and torch.equal(pool, eager_pool)


def test_decode_op_under_opcheck_and_compile():
    """torch.ops.cula_aot.kda_decode: opcheck (schema, fake, mutation declarations), then a
    compiled call equals the eager entry bitwise, pool and intermediate states included."""
    from tests.decode_helpers import fused_inputs

    heads, n, tokens = 4, 3, 2
    x = fused_inputs(n, tokens, heads, device="cuda", seed=11)
    q, k, v, g, beta = (x[name].contiguous() for name in ("q", "k", "v", "g", "beta"))
    pool = (0.1 * torch.randn(6, heads, 128, 128, device="cuda")).to(torch.bfloat16)
    indices = torch.tensor([4, -1, 0], dtype=torch.int32, device="cuda")
    inter = torch.zeros(n, tokens, heads, 128, 128, device="cuda", dtype=torch.bfloat16)
    args = (q, k, v, g, beta, x["A_log"], x["dt_bias"], x["lower_bound"], pool, indices, inter)
    torch.library.opcheck(torch.ops.cula_aot.kda_decode.default, args)
    torch.library.opcheck(torch.ops.cula_aot.kda_decode.default, args[:-1] + (None,))

    start = pool.clone()
    eager_pool, eager_inter = start.clone(), torch.zeros_like(inter)
    o_eager = cula_aot.kda_decode(
        q,
        k,
        v,
        g,
        beta,
        A_log=x["A_log"],
        dt_bias=x["dt_bias"],
        lower_bound=x["lower_bound"],
        state_pool=eager_pool,
        state_indices=indices,
        intermediate_states=eager_inter,
    )
    pool.copy_(start)
    inter.zero_()
    compiled = torch.compile(lambda *a: torch.ops.cula_aot.kda_decode(*a) * 1, fullgraph=True)
    o = compiled(*args)
    assert torch.equal(o, o_eager) and torch.equal(pool, eager_pool) and torch.equal(inter, eager_inter)


def test_layer_op_under_opcheck_and_compile():
    """torch.ops.cula_aot.kda_decode_layer: opcheck, then a compiled verify call equals the eager
    entry bitwise: output, pool, conv state and drafts."""
    from tests.decode_helpers import fused_inputs

    heads, n, tokens = 4, 3, 2
    c = heads * 128
    x = fused_inputs(n, tokens, heads, device="cuda", seed=12)
    q, k, v, g, beta = (x[name].contiguous() for name in ("q", "k", "v", "g", "beta"))
    z = torch.randn_like(v)
    weight = (0.5 * torch.randn(3 * c, 4, device="cuda")).to(torch.bfloat16)
    norm = torch.ones(128, device="cuda", dtype=torch.bfloat16)
    indices = torch.tensor([4, -1, 0], dtype=torch.int32, device="cuda")
    accepted = torch.tensor([1, 0, 2], dtype=torch.int32, device="cuda")

    def fresh():
        gen = torch.Generator(device="cuda").manual_seed(3)
        pool = (0.1 * torch.randn(6, heads, 128, 128, device="cuda", generator=gen)).float()
        conv = torch.randn(6, 3 * c, 3, device="cuda", generator=gen).to(torch.bfloat16)
        return pool, conv, cula_aot.draft_buffers(6, heads, "cuda")

    def op_args(pool, conv):
        return (q, k, v, g, beta, x["A_log"], x["dt_bias"], x["lower_bound"], weight, conv, z, norm, pool, indices)

    pool, conv, drafts = fresh()
    options = dict(draft_records=drafts.records, draft_marks=drafts.marks, num_accepted=accepted, verify=True)
    torch.library.opcheck(torch.ops.cula_aot.kda_decode_layer.default, op_args(pool, conv), options)

    eager_pool, eager_conv, eager_drafts = fresh()
    o_eager = cula_aot.kda_decode_layer(
        q, k, v, g, beta, conv_weight=weight, conv_state=eager_conv, out_gate=z, norm_weight=norm,
        A_log=x["A_log"], dt_bias=x["dt_bias"], lower_bound=x["lower_bound"], state_pool=eager_pool,
        state_indices=indices, drafts=eager_drafts, num_accepted=accepted, verify=True,
    )  # fmt: skip
    pool, conv, drafts = fresh()
    options = dict(draft_records=drafts.records, draft_marks=drafts.marks, num_accepted=accepted, verify=True)
    compiled = torch.compile(lambda *a: torch.ops.cula_aot.kda_decode_layer(*a, **options) * 1, fullgraph=True)
    o = compiled(*op_args(pool, conv))
    assert torch.equal(o, o_eager) and torch.equal(pool, eager_pool) and torch.equal(conv, eager_conv)
    # bitwise: the fp32 u rows seen as bf16 pairs hold NaN patterns, which torch.equal calls unequal
    assert torch.equal(drafts.records.view(torch.int16), eager_drafts.records.view(torch.int16))
    assert torch.equal(drafts.marks, eager_drafts.marks)
