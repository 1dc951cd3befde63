#!/usr/bin/env python3
"""The fused decode layer (``cula_aot.kda_decode_layer``) on the engines' decode grid: against the
bytes it must move at this run's copy rate, the KDA step alone (``kda_decode`` on the same pool),
its speculative verify, and fla's decode composite for the same layer, all in one process.

    python -m benchmarks.bench_decode_layer [--seqs 1 8 ..] [--heads 3 6 ..] [--tokens 1 4 8]
                                            [--dtypes fp32 bf16] [--no-fla] [--quick] [--budget-s S]
                                            [--json PATH]
    bash benchmarks/with_fla.sh python3 -m benchmarks.bench_decode_layer --json "$OUT/decode_layer.json"

Rows: pool dtype ∈ {fp32, bf16} × T ∈ {1, 4, 8} × local H ∈ {3, 6, 12, 24, 32, 48, 96} (Kimi-K3,
GLM-5.3-Flash and Ling-3.0 under tensor parallelism) × N ∈ {1, 8, 32, 128, 512}; safe gate, "vk"
pools of N + 8 slots (the requests' slots a random choice), bf16 conv states ``[slots, 3·H·128,
3]``, q, k, v, g and the output gate z slices of one fused projection.

Per row, CUDA-graph replays with the L2 evicted before each (``timing.ColdReplay``: 25 warm-up,
100 timed, interquartile mean; ``--quick`` 5 / 30):

* ``ours_graph_us``: ``kda_decode_layer`` (conv update, gate, KDA step, gated RMSNorm: one launch);
* ``step_graph_us``: ``kda_decode`` alone on the same pool and inputs (no conv, no norm);
* ``verify_graph_us`` (T > 1): the layer's speculative step: it commits the previous replay's
  draft (all T tokens accepted: the most commit work) and verifies T new draft tokens, writing
  their records instead of the pool's state;
* ``fla_graph_us``: fla's decode of the same layer as vLLM calls it: three
  ``causal_conv1d_update`` on per-request caches (T > 1: ``causal_conv1d`` from the caches as
  initial states, each cache then written back), ``fused_recurrent_kda_fwd``, then
  ``FusedRMSNormGated``.  T = 1: the state read from and written to the pool in place through
  ``[N]`` ``ssm_state_indices``, the pool's slots.  T > 1: its ``[N, T]`` index path (vLLM's
  speculative contract, a state written per token) failed with cudaErrorInvalidAddressSpace at
  the first graph replay on an H100 (2026-12-08, fla-core 0.6.0; an illegal address on an H200
  before), so it runs its plain path: the first N states in, each request's final state out (one
  state read and one written, fewer bytes than the T states vLLM's contract writes: this favours
  fla).  (fla's public
  ``fused_recurrent_kda`` drops ``ssm_state_indices`` and ``inplace_final_state``: it reads the
  first N states and writes none.)  fla's convolution caches are dense per request (no slot
  gather), which only favours it.  A failure is recorded in ``fla_error`` and the row goes on;
* ``ours_eager_host_us`` / ``ours_bound_host_us``: the median host time of one eager call in a
  burst with no synchronisation inside (what an engine that runs the layer outside its graph
  pays), plain and through a ``DecodeLayerStep``;
* ``bytes`` (what the layer must move: each request's state read and written, its conv state
  read and written, q, k, v, g, z in and o out, β and the slot, the conv and norm weights, A_log,
  dt_bias) and ``copy_bw_fraction`` = bytes / ``ours_graph_us`` / this run's device-to-device copy
  rate (``peers.copy_bandwidth``, read + write).

With ``--variants``, ``variant`` (the one ``pick_layer_variant`` takes) and ``variant_graph_us``
(graph µs with each built ``"v_blockxitems"`` forced): the data its thresholds come from.

``meta`` holds the copy rate, the launch floor of this harness (a graph replaying a one-element
fill) and, per pool dtype, a verify record's bytes per token and head against a full state's
(``record_vs_state``).  The JSON is rewritten after every row, so a run cut short keeps what it
measured; markdown beside it.
"""

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

import torch

import cula_aot
from benchmarks import peers
from benchmarks.timing import ColdReplay, capture_graph
from cula_aot.ops.decode_layer import decode_layer
from cula_aot.specs import LAYER_VARIANTS, pick_layer_variant

D = 128
W = 4
LOWER_BOUND = -5.0
SEQS = (1, 8, 32, 128, 512)
HEADS = (3, 6, 12, 24, 32, 48, 96)
TOKENS = (1, 4, 8)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SPARE_SLOTS = 8


def make_inputs(n, tokens, heads, pool_dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    c = heads * D
    fused = torch.randn(n, tokens, 5 * c, generator=gen, device="cuda").to(torch.bfloat16)
    q, k, v, g, z = (fused[..., i * c : (i + 1) * c].unflatten(-1, (heads, D)) for i in range(5))
    slots = n + SPARE_SLOTS
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


def layer_bytes(n, tokens, heads, pool_dtype) -> int:
    """The bytes one layer call must move at least (the module docstring's list)."""
    c = heads * D
    state = heads * D * D * torch.empty((), dtype=pool_dtype).element_size()
    conv_state = 3 * c * (W - 1) * 2
    per_request = 2 * state + 2 * conv_state + 6 * tokens * c * 2 + tokens * heads * 2 + 4
    weights = 3 * c * W * 2 + D * 2 + heads * 4 + c * 4
    return n * per_request + weights


def record_vs_state(pool_dtype) -> dict:
    """A verify record per token and head (one token's and head's rows of ``draft_buffers``)
    against the full state an intermediate-state verify writes per token and head."""
    record = cula_aot.draft_buffers(1, 1).records[0, 0, 0, 0].nbytes
    state = D * D * torch.empty((), dtype=pool_dtype).element_size()
    return {"record_bytes": record, "state_bytes": state, "state_over_record": state / record}


def _step_args(x) -> dict:
    """The KDA step's arguments, shared by the layer and the step alone."""
    return dict(
        A_log=x["A_log"],
        dt_bias=x["dt_bias"],
        lower_bound=LOWER_BOUND,
        state_pool=x["pool"],
        state_indices=x["slots"],
        out=x["out"],
    )


def _layer_args(x) -> dict:
    return dict(conv_weight=x["conv_weight"], conv_state=x["conv_state"], out_gate=x["z"], norm_weight=x["norm_weight"])


def layer_call(x):
    inputs = [x[name] for name in ("q", "k", "v", "g", "beta")]
    return lambda: cula_aot.kda_decode_layer(*inputs, **_layer_args(x), **_step_args(x))


def variant_call(x, variant):
    """The layer with its (v_block, items) forced (``ops.decode_layer.decode_layer``'s override)."""
    inputs = [x[name] for name in ("q", "k", "v", "g", "beta")]
    return lambda: decode_layer(*inputs, **_layer_args(x), **_step_args(x), variant=variant)


def verify_call(x):
    """The speculative step: commit the previous call's draft (all T accepted), verify T more."""
    n, tokens, heads, _ = x["q"].shape
    drafts = cula_aot.draft_buffers(x["pool"].shape[0], heads, "cuda")
    accepted = torch.full((n,), tokens, dtype=torch.int32, device="cuda")
    inputs = [x[name] for name in ("q", "k", "v", "g", "beta")]
    speculation = dict(drafts=drafts, num_accepted=accepted, verify=True)
    return lambda: cula_aot.kda_decode_layer(*inputs, **_layer_args(x), **_step_args(x), **speculation)


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
    """fla's decode of the same layer (the module docstring)."""
    import importlib
    import inspect

    from fla.modules import FusedRMSNormGated
    from fla.modules.causal_conv1d.ops import causal_conv1d, causal_conv1d_update

    # fla's own Triton entry, past any backend dispatch wrapped around it.
    recurrent = inspect.unwrap(importlib.import_module("fla.ops.kda.fused_recurrent").fused_recurrent_kda_fwd)
    n, tokens, heads, _ = x["q"].shape
    c = heads * D
    # fla keeps [N, C, W] caches per request; dense here (no gather by slot).
    caches = [torch.zeros(n, c, W, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    weights = x["conv_weight"].split(c)
    norm = FusedRMSNormGated(D, activation="sigmoid", eps=1e-5).to("cuda", torch.bfloat16)
    a_log, dt_bias = x["A_log"], x["dt_bias"].flatten()
    if tokens == 1:
        pool, state_args = x["pool"], dict(ssm_state_indices=x["slots"], inplace_final_state=True)
    else:
        # Its [N, T] index path (vLLM's speculative contract) fails under graph replay on Hopper
        # (module docstring), so its plain path: the first N states in, each final state out.
        pool = x["pool"][:n]
        state_args = dict(
            cu_seqlens=torch.arange(n + 1, device="cuda") * tokens, inplace_final_state=False, output_final_state=True
        )

    def convolve(t, cache, weight):
        if tokens == 1:
            return causal_conv1d_update(x=t.flatten(-2), cache=cache, weight=weight, activation="silu")[0]
        y, final = causal_conv1d(
            t.flatten(-2), weight=weight, initial_state=cache, output_final_state=True, activation="silu"
        )
        cache.copy_(final)
        return y

    def flat(t):
        return t if tokens == 1 else t.reshape(1, n * tokens, *t.shape[2:])

    def run():
        convolved = [
            flat(convolve(t, cache, w).unflatten(-1, (heads, D)))
            for t, cache, w in zip((x["q"], x["k"], x["v"]), caches, weights)
        ]
        o, _ = recurrent(
            *convolved,
            flat(x["g"]),
            flat(x["beta"]),
            A_log=a_log,
            dt_bias=dt_bias,
            initial_state=pool,
            use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
            lower_bound=LOWER_BOUND,
            state_v_first=True,
            **state_args,
        )
        return norm(o.view(n, tokens, heads, D), x["z"])

    return run


def host_us(fn, calls=200) -> float:
    """Median host µs of one call in a burst of ``calls`` (no synchronisation inside)."""
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(calls):
        start = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - start) / 1e3)
    torch.cuda.synchronize()
    return statistics.median(samples)


class Bench:
    def __init__(self, args):
        self.args = args
        warmup, iters = (5, 30) if args.quick else (25, 100)
        self.cold = ColdReplay(warmup, iters)
        self.start = time.time()
        self.rows, self.errors = [], []
        self.meta = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "fla": None if args.no_fla else peers.fla_version(),
            "warmup": warmup,
            "iters": iters,
            "copy_bandwidth": peers.copy_bandwidth("cuda"),
            "record_vs_state": {name: record_vs_state(DTYPES[name]) for name in args.dtypes},
        }
        one = torch.empty(1, device="cuda")
        self.meta["launch_floor_us"] = 1e3 * self.cold(capture_graph(lambda: one.fill_(1.0)))
        print(json.dumps(self.meta), flush=True)

    def graph_us(self, make, x) -> float:
        return 1e3 * self.cold(capture_graph(make(x)))

    def row(self, dtype_name, tokens, heads, n):
        pool_dtype = DTYPES[dtype_name]
        x = make_inputs(n, tokens, heads, pool_dtype)
        row = {
            "state_dtype": dtype_name,
            "T": tokens,
            "H": heads,
            "N": n,
            "bytes": layer_bytes(n, tokens, heads, pool_dtype),
        }
        row["ours_graph_us"] = self.graph_us(layer_call, x)
        row["copy_bw_fraction"] = row["bytes"] / (row["ours_graph_us"] * 1e-6) / self.meta["copy_bandwidth"]
        row["step_graph_us"] = self.graph_us(step_call, x)
        if self.args.variants:
            row["variant"] = "x".join(map(str, pick_layer_variant(n, heads, tokens, pool_dtype == torch.bfloat16)))
            row["variant_graph_us"] = {
                f"{v_block}x{items}": self.graph_us(lambda x, v=(v_block, items): variant_call(x, v), x)
                for v_block, items in LAYER_VARIANTS
            }
        if tokens > 1:
            row["verify_graph_us"] = self.graph_us(verify_call, x)
        row["ours_eager_host_us"] = host_us(layer_call(x))
        row["ours_bound_host_us"] = host_us(bound_call(x))
        if self.meta["fla"] is not None:
            try:
                row["fla_graph_us"] = self.graph_us(fla_call, x)
                row["fla_over_ours"] = row["fla_graph_us"] / row["ours_graph_us"]
            except Exception as exc:  # noqa: BLE001 - a failing peer is a result: recorded, the rest runs
                torch.cuda.synchronize()
                row["fla_error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        del x
        torch.cuda.empty_cache()
        return row

    def run(self):
        args = self.args
        for dtype_name in args.dtypes:
            for tokens in args.tokens:
                for heads in args.heads:
                    for n in args.seqs:
                        if time.time() - self.start > args.budget_s:
                            self.errors.append(f"budget of {args.budget_s} s spent: later rows not run")
                            self.save()
                            return
                        try:
                            row = self.row(dtype_name, tokens, heads, n)
                        except Exception as exc:  # noqa: BLE001 - one failing row must not take the run down
                            torch.cuda.synchronize()
                            self.errors.append(f"{dtype_name} T{tokens} H{heads} N{n}: {type(exc).__name__}: {exc}")
                            print(self.errors[-1], flush=True)
                            continue
                        print(json.dumps(row), flush=True)
                        self.rows.append(row)
                        self.save()
        self.save()

    def save(self):
        result = {"meta": self.meta, "rows": self.rows, "errors": self.errors}
        path = Path(self.args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")
        path.with_suffix(".md").write_text(render_markdown(result))


def _f(value, spec):
    return "–" if value is None else format(value, spec)


def render_markdown(res) -> str:
    meta = res["meta"]
    lines = [
        f"# Fused decode layer ({meta['device']}, graph replay, cold L2, µs)",
        "",
        f"Copy rate {meta['copy_bandwidth'] / 1e12:.2f} TB/s (read + write); launch floor "
        f"{meta['launch_floor_us']:.1f} µs; fla {meta['fla'] or 'absent'}. A verify record per token and head: "
        + ", ".join(
            f"{name} pool {r['state_over_record']:.1f}× smaller than a state"
            for name, r in meta["record_vs_state"].items()
        )
        + ".",
        "",
        "| pool | T | H | N | layer | % copy | step alone | verify | fla | fla ÷ ours | host eager | host bound |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in res["rows"]:
        fla = _f(r.get("fla_graph_us"), ".1f") if "fla_error" not in r else "error"
        lines.append(
            f"| {r['state_dtype']} | {r['T']} | {r['H']} | {r['N']} | {r['ours_graph_us']:.1f} | "
            f"{100 * r['copy_bw_fraction']:.0f}% | {r['step_graph_us']:.1f} | {_f(r.get('verify_graph_us'), '.1f')} | "
            f"{fla} | {_f(r.get('fla_over_ours'), '.2f')} | {r['ours_eager_host_us']:.1f} | {r['ours_bound_host_us']:.1f} |"
        )
    lines += [""] + [f"- {e}" for e in res["errors"]]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=list(SEQS))
    ap.add_argument("--heads", type=int, nargs="+", default=list(HEADS))
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    ap.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    ap.add_argument("--json", default="docs/bench/decode_layer.json")
    ap.add_argument("--quick", action="store_true", help="5 warm-up / 30 timed replays instead of 25 / 100")
    ap.add_argument("--budget-s", type=float, default=1e9, help="start no new row after this many seconds")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--variants", action="store_true", help="also time every built (v_block, items) of the layer")
    return ap.parse_args(argv)


def main(argv=None):
    Bench(parse_args(argv)).run()


if __name__ == "__main__":
    main()
