"""Reliability on the GPU: wrong devices, concurrent callers, NaN/Inf inputs, >2^31-element inputs."""

import threading

import pytest
import torch

import cula_aot
from cula_aot import KDAInputError, reference
from tests.helpers import cu_seqlens_of, standard_inputs

pytestmark = pytest.mark.gpu


def _call(x, **kw):
    return cula_aot.kda_prefill(
        x["q"],
        x["k"],
        x["v"],
        x["g"],
        x["beta"],
        A_log=x["A_log"],
        dt_bias=x["dt_bias"],
        lower_bound=x["lower_bound"],
        **kw,
    )


def test_mixed_devices_are_refused_before_launch():
    x = standard_inputs(1, 40, 2, device="cuda")
    out = torch.full_like(x["v"], 7.0)
    for name in ("k", "A_log", "dt_bias"):
        bad = dict(x, **{name: x[name].cpu()})
        with pytest.raises(KDAInputError, match=f"{name} is on cpu but q is on cuda"):
            _call(bad, out=out)
    with pytest.raises(KDAInputError, match="initial_state is on cpu"):
        _call(x, initial_state=torch.zeros(1, 2, 128, 128), out=out)
    assert bool((out == 7.0).all())


def test_concurrent_threads_and_streams_match_serial_runs():
    cases = [
        (standard_inputs(1, 700, 8, device="cuda"), cu_seqlens_of([300, 400], "cuda")),
        (standard_inputs(2, 333, 4, device="cuda"), None),
    ]
    expected = [_call(x, cu_seqlens=cu, output_final_state=True) for x, cu in cases]
    torch.cuda.synchronize()
    results = [[None] * 10 for _ in cases]
    errors = []

    def worker(i):
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                x, cu = cases[i]
                for it in range(10):
                    results[i][it] = _call(
                        x, cu_seqlens=cu, cu_seqlens_cpu=None if cu is None else cu.cpu(), output_final_state=True
                    )
            stream.synchronize()
        except Exception as exc:  # surfaced below: a thread's exception would otherwise vanish
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, (o_ref, s_ref) in enumerate(expected):
        for o, s in results[i]:
            assert torch.equal(o, o_ref) and torch.equal(s, s_ref)


def test_nan_and_inf_inputs_give_nan_not_a_crash():
    lengths = [50, 60]
    x = standard_inputs(1, sum(lengths), 4, device="cuda")
    cu = cu_seqlens_of(lengths, "cuda")
    clean, _ = _call(x, cu_seqlens=cu)
    x["v"][0, 10, 1, 3] = float("nan")
    x["k"][0, 20, 2, 5] = float("inf")
    o, s = _call(x, cu_seqlens=cu, output_final_state=True)
    torch.cuda.synchronize()
    assert torch.isnan(o[0, :50]).any() and torch.isnan(s[0]).any()
    # The second sequence never sees the first one's values.
    assert torch.equal(o[0, 50:], clean[0, 50:]) and torch.isfinite(s[1]).all()


def test_inputs_beyond_2_31_elements():
    # H·128·tokens > 2^31: the checked sequence starts past element 2^31 of every input tensor.
    heads, filler = 64, 2**31 // (64 * 128) + 1000
    lengths = [filler, 3000]
    x = standard_inputs(1, sum(lengths), heads, device="cuda")
    assert x["q"].numel() > 2**31
    cu = cu_seqlens_of(lengths, "cuda")
    o, s = _call(x, cu_seqlens=cu, cu_seqlens_cpu=cu.cpu(), output_final_state=True)
    tail = {k: (v[:, filler:].contiguous() if k in ("q", "k", "v", "g", "beta") else v) for k, v in x.items()}
    ref_o, ref_s = reference.kda_chunked(
        tail["q"],
        tail["k"],
        tail["v"],
        tail["g"],
        tail["beta"],
        A_log=x["A_log"],
        dt_bias=x["dt_bias"],
        lower_bound=x["lower_bound"],
    )
    err_o = reference.rel_rmse(o[:, filler:], ref_o)
    err_s = reference.rel_rmse(s[1].transpose(-1, -2), ref_s[0])
    print(f"2^31 spot check: tokens {sum(lengths)}, H {heads}, o rel-RMSE {err_o:.2e}, state {err_s:.2e}")
    assert err_o <= 1e-2 and err_s <= 1e-2
    # A fixed-layout batch whose second row lies past 2^31: outputs depend only on their prefix.
    del x, tail, o, s
    torch.cuda.empty_cache()
    seq = 2**31 // (heads * 128 * 2) + 600
    fx = standard_inputs(2, seq, heads, device="cuda")
    assert fx["q"].numel() > 2**31
    o, _ = _call(fx)
    head = {k: (v[1:, :2048].contiguous() if k in ("q", "k", "v", "g", "beta") else v) for k, v in fx.items()}
    ref_o, _ = reference.kda_chunked(
        head["q"],
        head["k"],
        head["v"],
        head["g"],
        head["beta"],
        A_log=fx["A_log"],
        dt_bias=fx["dt_bias"],
        lower_bound=fx["lower_bound"],
    )
    assert reference.rel_rmse(o[1:, :2048], ref_o) <= 1e-2
