#!/usr/bin/env python3
"""The fused decode layer (``cula_aot.kda_decode_layer``) against the KDA step alone
(``kda_decode`` on the same pool) and, when importable, fla's own decode path for the same layer
(three ``causal_conv1d_update`` calls, ``fused_recurrent_kda`` on the pool through
``ssm_state_indices``, ``FusedRMSNormGated``), all in one process.

    python -m benchmarks.bench_decode_layer [--json PATH] [--quick] [--budget-s S]
    bash benchmarks/with_fla.sh python3 -m benchmarks.bench_decode_layer --json "$OUT/decode_layer.json"

Rows: T ∈ {1, 4} × H ∈ {3, 12, 24, 96} × N ∈ {1, 32, 256} (Kimi-K3's local head counts), fp32
and bf16 "vk" pools of N + 8 slots, safe gate, bf16 conv states ``[slots, 3·H·128, 3]``.  Each
path is one CUDA-graph replay (25 warm-up, 100 timed, interquartile mean; ``--quick`` 5 / 20).
``host_us``: the median host time of an eager ``kda_decode_layer`` call (a burst of 200 calls,
no synchronisation inside), what an engine that runs the layer outside its graph pays;
``bound_host_us`` the same through a ``DecodeLayerStep``.
Output: ``docs/bench/decode_layer.{json,md}`` unless ``--json`` says otherwise.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import cula_aot
from benchmarks.timing import capture_graph, time_cuda

D = 128
W = 4
ROWS = [(t, h, n) for t in (1, 4) for h in (3, 12, 24, 96) for n in (1, 32, 256)]


def make_inputs(n, tokens, heads, pool_dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    c = heads * D
    fused = torch.randn(n, tokens, 5 * c, generator=gen, device="cuda").to(torch.bfloat16)
    q, k, v, g, z = (fused[..., i * c : (i + 1) * c].unflatten(-1, (heads, D)) for i in range(5))
    slots = n + 8
    return dict(
        q=q,
        k=k,
        v=v,
        g=g,
        z=z,
        beta=torch.randn(n, tokens, heads, generator=gen, device="cuda").to(torch.bfloat16),
        A_log=torch.log(torch.rand(heads, generator=gen, device="cuda") * 15 + 1).float(),
        dt_bias=0.1 * torch.randn(heads, D, generator=gen, device="cuda"),
        pool=(0.1 * torch.randn(slots, heads, D, D, generator=gen, device="cuda")).to(pool_dtype),
        conv_state=torch.randn(slots, 3 * c, W - 1, generator=gen, device="cuda").to(torch.bfloat16),
        conv_weight=(0.5 * torch.randn(3 * c, W, generator=gen, device="cuda")).to(torch.bfloat16),
        norm_weight=torch.ones(D, device="cuda", dtype=torch.bfloat16),
        slots=torch.randperm(slots, generator=torch.Generator().manual_seed(seed))[:n].to(torch.int32).cuda(),
        out=torch.empty(n, tokens, heads, D, device="cuda", dtype=torch.bfloat16),
    )


def _step_args(x) -> dict:
    """The KDA step's arguments, shared by the layer and the step alone."""
    return dict(
        A_log=x["A_log"],
        dt_bias=x["dt_bias"],
        lower_bound=-5.0,
        state_pool=x["pool"],
        state_indices=x["slots"],
        out=x["out"],
    )


def layer_call(x):
    layer = dict(
        conv_weight=x["conv_weight"], conv_state=x["conv_state"], out_gate=x["z"], norm_weight=x["norm_weight"]
    )
    inputs = [x[name] for name in ("q", "k", "v", "g", "beta")]
    return lambda: cula_aot.kda_decode_layer(*inputs, **layer, **_step_args(x))


def bound_call(x):
    """The layer through a ``DecodeLayerStep`` holding its fixed tensors."""
    args = _step_args(x)
    per_call = dict(state_indices=args.pop("state_indices"), out=args.pop("out"))
    step = cula_aot.DecodeLayerStep(
        conv_weight=x["conv_weight"], conv_state=x["conv_state"], norm_weight=x["norm_weight"], **args
    )
    inputs = [x[name] for name in ("q", "k", "v", "g", "beta", "z")]
    return lambda: step(*inputs, per_call["state_indices"], out=per_call["out"])


def step_call(x):
    inputs = [x[name] for name in ("q", "k", "v", "g", "beta")]
    return lambda: cula_aot.kda_decode(*inputs, **_step_args(x))


def fla_call(x):
    """fla's decode of the same layer, T = 1 (its conv update takes one token per call)."""
    from fla.modules import FusedRMSNormGated
    from fla.modules.causal_conv1d.ops import causal_conv1d_update
    from fla.ops.kda import fused_recurrent_kda

    n, _, heads, _ = x["q"].shape
    c = heads * D
    # fla keeps [N, C, W] caches per request; the slots are gathered into them once here.
    caches = [torch.zeros(n, c, W, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    weights = x["conv_weight"].split(c)
    norm = FusedRMSNormGated(D, activation="sigmoid", eps=1e-5).to("cuda", torch.bfloat16)
    a_log, dt_bias = x["A_log"], x["dt_bias"].flatten()
    pool = x["pool"].float() if x["pool"].dtype != torch.float32 else x["pool"]

    def run():
        convolved = [
            causal_conv1d_update(x=t.flatten(-2), cache=cache, weight=w, activation="silu")[0].unflatten(-1, (heads, D))
            for t, cache, w in zip((x["q"], x["k"], x["v"]), caches, weights)
        ]
        o, _ = fused_recurrent_kda(
            *convolved,
            x["g"],
            x["beta"],
            A_log=a_log,
            dt_bias=dt_bias,
            initial_state=pool,
            inplace_final_state=True,
            ssm_state_indices=x["slots"].long(),
            use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
            lower_bound=-5.0,
            state_v_first=True,
        )
        return norm(o, x["z"])

    return run


def host_us(fn, calls=200) -> float:
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(calls):
        start = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - start) / 1e3)
    torch.cuda.synchronize()
    return statistics.median(samples)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default="docs/bench/decode_layer.json")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--budget-s", type=float, default=1e9)
    ap.add_argument("--no-fla", action="store_true")
    args = ap.parse_args(argv)
    warmup, iters = (5, 20) if args.quick else (25, 100)
    start = time.time()
    rows = []
    for pool_dtype in (torch.float32, torch.bfloat16):
        for tokens, heads, n in ROWS:
            if time.time() - start > args.budget_s:
                break
            x = make_inputs(n, tokens, heads, pool_dtype)
            row = {"pool": str(pool_dtype)[6:], "T": tokens, "H": heads, "N": n}
            for name, make in (("layer", layer_call), ("step", step_call)):
                graph = capture_graph(make(x))
                row[f"{name}_us"] = 1e3 * time_cuda(graph.replay, warmup, iters)
            row["host_us"] = host_us(layer_call(x))
            row["bound_host_us"] = host_us(bound_call(x))
            if tokens == 1 and pool_dtype == torch.float32 and not args.no_fla:
                try:
                    graph = capture_graph(fla_call(x))
                    row["fla_us"] = 1e3 * time_cuda(graph.replay, warmup, iters)
                except Exception as e:  # fla absent or failing: recorded, the rest still runs
                    row["fla_error"] = f"{type(e).__name__}: {str(e)[:120]}"
            print(json.dumps(row), flush=True)
            rows.append(row)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "quick": args.quick}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = [
        f"# Fused decode layer ({meta['device']}, graph replay, µs)",
        "",
        "| pool | T | H | N | layer | KDA step alone | layer / step | fla's decode path | host µs (eager) | host µs (bound) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        fla = f"{r['fla_us']:.1f}" if "fla_us" in r else "–"
        lines.append(
            f"| {r['pool']} | {r['T']} | {r['H']} | {r['N']} | {r['layer_us']:.1f} | {r['step_us']:.1f} | "
            f"{r['layer_us'] / r['step_us']:.2f} | {fla} | {r['host_us']:.1f} | {r['bound_host_us']:.1f} |"
        )
    Path(args.json).with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
