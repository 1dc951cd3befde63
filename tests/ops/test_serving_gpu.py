"""Serving contracts on the GPU (CONTRACT §9): state pools (indices, padding rows, padded slots,
aliasing), bf16 states, token-strided views cut from one fused projection, sync-free varlen and
CUDA-graph capture of ``kda_prefill`` / ``fwd`` with only a device ``cu_seqlens``.

Every result is checked against the float64 reference (or bitwise against a plain-tensor run
of the same values); outputs and untouched pool slots are poisoned / fingerprinted first.
"""

import pytest
import torch

import cula_aot
from cula_aot import reference
from cula_aot.ops.prefill import prefill
from tests.helpers import cu_seqlens_of, fresh_seed, standard_inputs

pytestmark = pytest.mark.gpu

BOUND = 1e-2
LENGTHS = [700, 33, 1, 260]


def _args(x):
    return x["q"], x["k"], x["v"], x["g"], x["beta"]


def _gate(x):
    return dict(A_log=x["A_log"], dt_bias=x["dt_bias"], lower_bound=x["lower_bound"])


def _random_states(n, heads):
    gen = torch.Generator(device="cpu").manual_seed(fresh_seed())
    return (0.1 * torch.randn(n, heads, 128, 128, generator=gen)).cuda()


def _as_layout(state_kv, layout):
    """Reference states are S ([.., K, V]); "vk" stores Sᵀ per head."""
    return state_kv.transpose(-1, -2) if layout == "vk" else state_kv


def _padded_pool(slots, heads, dtype):
    """A pool whose slots are one head's worth of elements apart more than packed."""
    backing = torch.full((slots, heads + 1, 128, 128), float("nan"), device="cuda", dtype=dtype)
    return backing[:, :heads]


def _paths(cp):
    """(entry point, its path options): ``cp`` an intracard_cp value, or "fused" for the serial
    path as the fused kernel."""
    if cp == "fused":
        return prefill, dict(intracard_cp=False, fused=True)
    return cula_aot.kda_prefill, dict(intracard_cp=cp)


@pytest.mark.parametrize("cp", [False, 4, "fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["vk", "kv"])
def test_pool_in_place_with_padding_rows(layout, dtype, cp):
    heads = 4
    lengths = [3000, 40, 2100, 17] if cp == 4 else LENGTHS
    x = standard_inputs(1, sum(lengths), heads, device="cuda", slow_decay=True)
    cu = cu_seqlens_of(lengths, "cuda")
    pool = _padded_pool(9, heads, dtype)
    s0 = _random_states(9, heads)  # S per slot, [K, V]
    pool.copy_(_as_layout(s0, layout).to(dtype))
    before = pool.clone()
    indices = torch.tensor([6, -1, 2, 0], dtype=torch.int32, device="cuda")
    out = torch.full_like(x["v"], float("nan"))
    entry, path = _paths(cp)
    o, fs = entry(
        *_args(x),
        **_gate(x),
        initial_state=pool,
        state_indices=indices,
        output_final_state=True,
        cu_seqlens=cu,
        cu_seqlens_cpu=cu.cpu(),
        state_layout=layout,
        out=out,
        **path,
    )
    torch.cuda.synchronize()
    assert fs is pool and o is out
    # Reference: padding row (-1) starts from zero; its slot does not exist.
    start = torch.stack(
        [_as_layout(before[i].float(), layout) if i >= 0 else torch.zeros_like(s0[0]) for i in indices.tolist()]
    )
    ref_o, ref_s = reference.kda_chunked(*_args(x), **_gate(x), initial_state=start, cu_seqlens=cu)
    err_o = reference.rel_rmse(o, ref_o)
    errs = [
        reference.rel_rmse(_as_layout(pool[i].float(), layout), ref_s[n])
        for n, i in enumerate(indices.tolist())
        if i >= 0
    ]
    print(f"pool {layout} {dtype} cp={cp}: o {err_o:.2e}, states {max(errs):.2e}")
    assert torch.isfinite(o).all() and err_o <= BOUND and max(errs) <= BOUND
    untouched = [i for i in range(9) if i not in indices.tolist()]
    assert torch.equal(
        pool[untouched].view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
        before[untouched].view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
    )
    backing = pool.as_strided((9, heads + 1, 128, 128), pool.stride())
    assert torch.isnan(backing[:, heads].float()).all(), "a write landed in the pool's padding"


def test_separate_pools_and_zero_start_pool():
    """final_state may be another pool; initial_state=None with indices is a zero start."""
    heads = 8
    x = standard_inputs(1, sum(LENGTHS), heads, device="cuda")
    cu = cu_seqlens_of(LENGTHS, "cuda")
    dst = torch.full((6, heads, 128, 128), float("nan"), device="cuda")
    indices = torch.tensor([5, 1, -1, 3], dtype=torch.int32, device="cuda")
    o, fs = cula_aot.kda_prefill(*_args(x), **_gate(x), final_state=dst, state_indices=indices, cu_seqlens=cu)
    torch.cuda.synchronize()
    ref_o, ref_s = reference.kda_chunked(*_args(x), **_gate(x), cu_seqlens=cu)
    assert reference.rel_rmse(o, ref_o) <= BOUND
    for n, i in enumerate(indices.tolist()):
        if i >= 0:
            assert reference.rel_rmse(dst[i].transpose(-1, -2), ref_s[n]) <= BOUND
    assert torch.isnan(dst[[0, 2, 4]]).all()


@pytest.mark.parametrize("layout", ["vk", "kv"])
def test_bf16_states_against_fp32_states(layout):
    heads = 8
    x = standard_inputs(2, 900, heads, device="cuda", slow_decay=True)
    s0 = _random_states(2, heads)
    s0_bf16 = _as_layout(s0, layout).to(torch.bfloat16)
    final_bf16 = torch.full((2, heads, 128, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
    o16, _ = cula_aot.kda_prefill(
        *_args(x), **_gate(x), initial_state=s0_bf16.contiguous(), final_state=final_bf16, state_layout=layout
    )
    o32, f32 = cula_aot.kda_prefill(
        *_args(x), **_gate(x), initial_state=s0_bf16.float().contiguous(), output_final_state=True, state_layout=layout
    )
    torch.cuda.synchronize()
    # bf16 in is exact (the same values as fp32 in), so outputs agree bitwise; bf16 out is one rounding.
    assert torch.equal(o16, o32)
    assert torch.equal(final_bf16, f32.to(torch.bfloat16))
    ref_o, ref_s = reference.kda_chunked(*_args(x), **_gate(x), initial_state=_as_layout(s0_bf16.float(), layout))
    err_s16 = reference.rel_rmse(_as_layout(final_bf16.float(), layout), ref_s)
    err_s32 = reference.rel_rmse(_as_layout(f32, layout), ref_s)
    print(
        f"bf16 states {layout}: o {reference.rel_rmse(o16, ref_o):.2e}; final state bf16 {err_s16:.2e} "
        f"vs fp32 {err_s32:.2e}"
    )
    assert err_s16 <= BOUND and reference.rel_rmse(o16, ref_o) <= BOUND


def _fused(batch, seq_len, heads, x, pad=24):
    """q, k, v, g, beta as views of one [B, T, 4·H·128 + H + pad] projection (plus an output
    buffer of the same kind), holding the values of ``x``."""
    width = 4 * heads * 128 + heads + pad
    fused = torch.empty(batch, seq_len, width, dtype=torch.bfloat16, device="cuda")
    views = {}
    for n, name in enumerate(("q", "k", "v", "g")):
        views[name] = fused[..., n * heads * 128 : (n + 1) * heads * 128].unflatten(-1, (heads, 128))
        views[name].copy_(x[name])
    views["beta"] = fused[..., 4 * heads * 128 : 4 * heads * 128 + heads]
    views["beta"].copy_(x["beta"])
    return views


@pytest.mark.parametrize("path", [False, "fused"])
@pytest.mark.parametrize("varlen", [False, True])
def test_token_strided_views_are_read_in_place(varlen, path):
    heads = 8
    batch, seq_len = (1, sum(LENGTHS)) if varlen else (2, 500)
    x = standard_inputs(batch, seq_len, heads, device="cuda")
    cu = cu_seqlens_of(LENGTHS, "cuda") if varlen else None
    views = _fused(batch, seq_len, heads, x)
    assert not views["q"].is_contiguous() and not views["beta"].is_contiguous()
    out_backing = torch.full((batch, seq_len, heads + 2, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = out_backing[:, :, 1 : heads + 1]
    s0 = _random_states(batch if cu is None else len(LENGTHS), heads)
    entry, options = _paths(path)
    o, fs = entry(
        *_args(views), **_gate(x), initial_state=s0, output_final_state=True, cu_seqlens=cu, out=out, **options
    )
    o_ref, fs_ref = entry(*_args(x), **_gate(x), initial_state=s0, output_final_state=True, cu_seqlens=cu, **options)
    torch.cuda.synchronize()
    assert torch.equal(o, o_ref) and torch.equal(fs, fs_ref), "a strided view read other values"
    assert torch.isnan(out_backing[:, :, 0].float()).all() and torch.isnan(out_backing[:, :, -1].float()).all()


def test_serial_varlen_never_syncs():
    heads = 4
    x = standard_inputs(1, sum(LENGTHS), heads, device="cuda")
    cu = cu_seqlens_of(LENGTHS, "cuda")
    pool = _random_states(5, heads)
    indices = torch.tensor([4, 0, -1, 2], dtype=torch.int32, device="cuda")
    out = torch.empty_like(x["v"])
    cula_aot.kda_prefill(*_args(x), **_gate(x), cu_seqlens=cu, out=out)  # warm-up: loads, arena
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        cula_aot.kda_prefill(
            *_args(x),
            **_gate(x),
            cu_seqlens=cu,
            out=out,
            initial_state=pool,
            state_indices=indices,
            output_final_state=True,
        )
        cula_aot.fwd(
            *_args(x), None, out, x["A_log"], x["dt_bias"], x["lower_bound"], pool, pool, cu, state_indices=indices
        )
        # The detector is live: asking for the host check of a device cu_seqlens is a sync.
        with pytest.raises(RuntimeError, match="synchroniz"):
            cula_aot.kda_prefill(*_args(x), **_gate(x), cu_seqlens=cu, out=out, check_seqlens="host")
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _capture(run):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # warm-up: loads modules, sizes the capture stream's arena
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph


@pytest.mark.parametrize("entry", ["kda_prefill", "fwd"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_graph_replay_varlen_device_cu_seqlens_with_new_lengths(entry, state_dtype):
    """Capture with only a device cu_seqlens and a state pool, then replay with new values,
    new sequence lengths (same N and T) and new pool indices: the grid is bounded by shapes."""
    heads, total, slots = 8, sum(LENGTHS), 6
    static = standard_inputs(1, total, heads, device="cuda")
    cu = cu_seqlens_of(LENGTHS, "cuda")
    indices = torch.tensor([1, 3, -1, 0], dtype=torch.int32, device="cuda")
    pool = _random_states(slots, heads).to(state_dtype)
    out = torch.empty_like(static["v"])

    def run():
        if entry == "fwd":
            cula_aot.fwd(
                *_args(static),
                None,
                out,
                static["A_log"],
                static["dt_bias"],
                static["lower_bound"],
                pool,
                pool,
                cu,
                state_indices=indices,
            )
        else:
            cula_aot.kda_prefill(
                *_args(static),
                **_gate(static),
                initial_state=pool,
                output_final_state=True,
                state_indices=indices,
                cu_seqlens=cu,
                out=out,
            )

    graph = _capture(run)
    fresh = standard_inputs(1, total, heads, device="cuda")
    for name in ("q", "k", "v", "g", "beta", "A_log", "dt_bias"):
        static[name].copy_(fresh[name])
    new_lengths = [40, 500, 300, 154]
    assert sum(new_lengths) == total
    cu.copy_(cu_seqlens_of(new_lengths, "cuda"))
    indices.copy_(torch.tensor([5, -1, 2, 4], dtype=torch.int32))
    start = pool.clone()
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    eager_pool = start.clone()
    o_eager, _ = cula_aot.kda_prefill(
        *_args(fresh),
        **_gate(fresh),
        initial_state=eager_pool,
        output_final_state=True,
        state_indices=indices,
        cu_seqlens=cu,
    )
    torch.cuda.synchronize()
    assert torch.equal(out, o_eager) and torch.equal(pool, eager_pool)
    init = torch.stack(
        [
            start[i].float().transpose(-1, -2) if i >= 0 else torch.zeros(heads, 128, 128, device="cuda")
            for i in indices.tolist()
        ]
    )
    ref_o, _ = reference.kda_chunked(*_args(fresh), **_gate(fresh), initial_state=init, cu_seqlens=cu)
    assert reference.rel_rmse(out, ref_o) <= BOUND
