#!/usr/bin/env python3
"""KDA decode benchmark (docs/CONTRACT.md §10): cula_aot.kda_decode against the HBM copy rate and fla.

    python -m benchmarks.bench_decode [--json PATH] [--markdown PATH] [--quick] [--no-fla]
                                      [--heads 4 8 ..] [--seqs 1 16 ..] [--tokens 1 4]
                                      [--dtypes fp32 bf16] [--sweep] [--budget-s S] [--dry-run]

Rows: pool dtype ∈ {fp32, bf16} × H ∈ {4, 8, 16, 32, 64} × N ∈ {1, 16, 64, 256, 1024} ×
T ∈ {1, 4}, "vk" pools of exactly N slots, indices a random permutation.  Each row times, as
CUDA-graph replays (one call captured, static pointers):

* ``ours``: kda_decode updating the pool in place (state read + write once, outputs per token);
* ``ours_inter`` (T > 1): the same with ``intermediate_states`` (the state after every token,
  the pool dtype: T more state writes), what speculative-decoding verification needs;
* ``ours_slots`` (T > 1): vLLM's form of it, ``state_indices`` ``[N, T]`` (a pool slot per token,
  a random permutation of a pool of N·T slots) and ``num_accepted`` = T: one state read, T
  written, no final write-back;
* ``fla``: flash-linear-attention's ``fused_recurrent_kda_fwd`` (Triton) with the same
  semantics, when importable: V-first ``[V, K]`` states (``state_v_first=True``), gate, q/k
  l2norm and β sigmoid in the kernel.  T = 1: the pool updated in place through
  ``ssm_state_indices`` (its serving path).  T > 1: its ``[N, T]`` index path crashed with an
  illegal address on the H200 (2026-12-01, fla-core 0.6.0), so it runs its plain path: states
  read from an ``[N, H, V, K]`` initial_state and the final states written to a separate
  buffer (the same bytes: one state read and one written per head).  It is only called,
  never copied.  Its output is compared with ours (rel-RMSE) on the same initial states.

``--no-fla`` / ``--fla-only`` split the two into separate processes (a crash in one cannot take
the other's numbers down); ``--merge A.json B.json`` joins them into one JSON/markdown.

Timing: before every timed replay a 256 MB buffer is *read* (evicting the pool from the 60 MB
L2 without leaving dirty lines to write back during the timed kernel), then CUDA events
around the replay alone; 25 warm-up / 100 timed (``--quick``: 5 / 30), interquartile mean.
A decode step in a model runs between other layers, so cold-L2 is the honest case; at
N·H ≥ 1024 the pool (≥ 32 MB) is L2-sized or larger anyway.

Bytes moved (the floor of HBM traffic): state read + write (64 KB each per fp32 head state,
32 KB bf16) of the non-padding rows, + T states for ``ours_inter``, + T − 1 for ``ours_slots``,
+ q, k, v, g, out (bf16,
T·128 per head) + β + indices.  ``% copy`` = (bytes / time) / the device-to-device copy rate
measured in this run (read + write per second, 4 GB copy).  ``vs fla`` = fla time / ours
(> 1: we are faster).

Rows with N·H ≥ ``--variants-min-nh`` (default 256) also time every (v_block, items) kernel in
``VARIANTS`` (``row["variants"]``, µs), the data ``ops.decode.pick_variant`` is chosen from;
``--sweep`` times them on a subset of every size (all N, H ∈ {4, 32, 64}).
"""

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch

from benchmarks import peers
from benchmarks.timing import ColdReplay, capture_graph
from cula_aot.specs import DECODE_CHUNK_VARIANTS, DECODE_VARIANTS
from cula_aot.testing import standard_inputs

HEADS = (4, 8, 16, 32, 64)
SEQS = (1, 16, 64, 256, 1024)
TOKENS = (1, 4)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LOWER_BOUND = -5.0
D = 128
FLUSH_BYTES = 256 << 20
# Kernels timed per row: the token kernel's (v_block, items) and the chunk kernel's ("chunk",
# warps, items), the built ones (specs.DECODE_VARIANTS, DECODE_CHUNK_VARIANTS).
VARIANTS = DECODE_VARIANTS
CHUNK_VARIANTS = tuple(("chunk", *v) for v in DECODE_CHUNK_VARIANTS)


def variant_name(variant) -> str:
    """ "32x2" for a (v_block, items) variant, "chunk4x2" for the chunk kernel (warps x items)."""
    return f"chunk{variant[1]}x{variant[2]}" if variant[0] == "chunk" else "x".join(map(str, variant))


def row_variants(dtype_name, tokens, layout) -> tuple:
    """Every built kernel that can run a row without intermediate states (every gate has each)."""
    from cula_aot.ops.decode import chunk_applies

    return VARIANTS + (CHUNK_VARIANTS if chunk_applies(tokens, dtype_name == "bf16", layout, False) else ())


class Bench:
    def __init__(self, args):
        self.args = args
        self.warmup, self.iters = (5, 30) if args.quick else (25, 100)
        self.start = time.perf_counter()
        self.rows, self.sweep, self.errors = [], [], []
        self.meta = {}
        self.cold = ColdReplay(self.warmup, self.iters, FLUSH_BYTES)
        self.fla = None if args.mode == "ours" else _fla_function()
        # The safe gate's bound; the softplus gate has none (ours and fla's alike).
        self.lower_bound = LOWER_BOUND if args.gate == "safe" else None

    # ---- timing ----------------------------------------------------------------------------
    def time_replay(self, graph) -> float:
        """Milliseconds per replay, L2 flushed (by reading) before each, IQM of ``iters``."""
        return self.cold(graph)

    def over_budget(self) -> bool:
        return self.args.budget_s is not None and time.perf_counter() - self.start > self.args.budget_s

    # ---- one row -----------------------------------------------------------------------------
    def inputs(self, n, tokens, heads, dtype, seed=0):
        """CONTRACT §8 draws (``cula_aot.testing.standard_inputs``, seeded, on the GPU), the pool
        (one slot per sequence, ~ 0.1·N(0,1) in ``dtype``), a random permutation of the slots
        and the output buffer."""
        shape = (n, tokens, heads, D)
        std = standard_inputs(n, tokens, heads, device="cuda", seed=seed, n_states=n)
        x = {name: std[name] for name in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")}
        x["pool"] = std["initial_state"].to(dtype)
        x["indices"] = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).to(torch.int32).cuda()
        x["out"] = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
        return x

    def ours_call(self, x, inter=None, variant=None, slots=None):
        """kda_decode on ``x`` (``slots``: ``(pool, [N, T] indices, counts)`` for vLLM's per-token
        slots instead of ``x``'s pool and indices)."""
        from cula_aot.ops.decode import decode

        pool, indices, accepted = slots if slots is not None else (x["pool"], x["indices"], None)

        def run():
            decode(
                x["q"],
                x["k"],
                x["v"],
                x["g"],
                x["beta"],
                A_log=x["A_log"],
                dt_bias=x["dt_bias"],
                lower_bound=self.lower_bound,
                gate=self.args.gate,
                state_pool=pool,
                state_indices=indices,
                num_accepted=accepted,
                out=x["out"],
                state_layout=self.args.layout,
                intermediate_states=inter,
                variant=variant,
            )

        return run

    def fla_call(self, x, pool, out):
        """fla on ``pool``: in place through the indices (T = 1), or reading ``pool`` as the
        [N, H, V, K] initial states and returning new final states (T > 1, see the docstring)."""
        n, tokens, heads, _ = x["q"].shape
        dt_bias = x["dt_bias"].reshape(heads * D)
        pool_path = tokens == 1
        common = dict(
            q=x["q"],
            k=x["k"],
            v=x["v"],
            g=x["g"],
            beta=x["beta"],
            A_log=x["A_log"],
            dt_bias=dt_bias,
            scale=D**-0.5,
            initial_state=pool,
            state_v_first=self.args.layout == "vk",
            use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
            lower_bound=self.lower_bound,
            out=out,
        )

        def run():
            with torch.no_grad():
                if pool_path:
                    return self.fla(**common, inplace_final_state=True, ssm_state_indices=x["indices"])[1]
                return self.fla(**common, inplace_final_state=False, output_final_state=True)[1]

        return run

    def row(self, dtype_name, heads, n, tokens):
        dtype = DTYPES[dtype_name]
        x = self.inputs(n, tokens, heads, dtype)
        esize = torch.empty((), dtype=dtype).element_size()
        state_bytes = n * heads * D * D * esize
        io_bytes = 5 * n * tokens * heads * D * 2 + n * tokens * heads * 2 + 4 * n
        row = {
            "dtype": dtype_name,
            "layout": self.args.layout,
            "heads": heads,
            "seqs": n,
            "tokens": tokens,
            "nh": n * heads,
            "bytes": 2 * state_bytes + io_bytes,
        }
        from cula_aot.ops.decode import pick_variant

        chosen = pick_variant(n, heads, tokens, dtype == torch.bfloat16, self.args.layout, gate=self.args.gate)
        row["v_block"] = variant_name(chosen)
        if tokens > 1:
            row["inter_variant"] = variant_name(
                pick_variant(
                    n, heads, tokens, dtype == torch.bfloat16, self.args.layout, intermediates=True, gate=self.args.gate
                )
            )
        # Like for like on one pool state: ours vs fla outputs and new states.
        row["bytes_inter"] = row["bytes"] + tokens * state_bytes
        row["bytes_slots"] = row["bytes"] + (tokens - 1) * state_bytes + 4 * n * (tokens - 1)
        if self.fla is not None and self.args.mode != "ours":
            # Like for like from one pool state: the identity permutation, so that fla's plain
            # path (T > 1) reads the same states as the indexed kernels.
            x["indices"] = torch.arange(n, dtype=torch.int32, device="cuda")
            pool0 = x["pool"].clone()
            fla_out = torch.empty_like(x["out"])
            fla_state = self.fla_call(x, pool0, fla_out)()
            mine = x["pool"].clone()
            self.ours_call({**x, "pool": mine})()
            torch.cuda.synchronize()
            row["rmse_o_vs_fla"] = _rel_rmse(x["out"], fla_out)
            row["rmse_state_vs_fla"] = _rel_rmse(mine, fla_state)
            del pool0, mine, fla_state
            row["fla_ms"] = self.time_replay(capture_graph(self.fla_call(x, x["pool"], fla_out)))
            row["fla_path"] = "pool in place" if tokens == 1 else "plain (states in, new states out)"
        if self.args.mode != "fla":
            row["ours_ms"] = self.time_replay(capture_graph(self.ours_call(x)))
            if tokens > 1:
                inter = torch.empty(n, tokens, heads, D, D, dtype=dtype, device="cuda")
                row["ours_inter_ms"] = self.time_replay(capture_graph(self.ours_call(x, inter)))
                del inter
                table = torch.randperm(n * tokens, generator=torch.Generator().manual_seed(1)).to(torch.int32)
                pool = torch.empty(n * tokens, heads, D, D, dtype=dtype, device="cuda")
                pool.view(n, tokens, heads, D, D).copy_(x["pool"][:, None])  # every slot a real state
                slots = (pool, table.view(n, tokens).cuda(), torch.full((n,), tokens, dtype=torch.int32, device="cuda"))
                row["ours_slots_ms"] = self.time_replay(capture_graph(self.ours_call(x, slots=slots)))
                del slots, pool
            if n * heads >= self.args.variants_min_nh:
                row["variants"] = {
                    variant_name(v): (
                        row["ours_ms"] if v == chosen else self.time_replay(capture_graph(self.ours_call(x, variant=v)))
                    )
                    for v in row_variants(dtype_name, tokens, self.args.layout)
                }
        self.rows.append(row)
        del x
        self.progress(row)

    def sweep_rows(self):
        for dtype_name in self.args.dtypes:
            for heads in (4, 32, 64):
                for n in self.args.seqs:
                    for tokens in (1, 4):
                        if self.over_budget() or len(self.sweep) >= self.args.sweep_max:
                            return
                        x = self.inputs(n, tokens, heads, DTYPES[dtype_name])
                        entry = {"dtype": dtype_name, "heads": heads, "seqs": n, "tokens": tokens}
                        for v in row_variants(dtype_name, tokens, self.args.layout):
                            entry[f"v{variant_name(v)}_ms"] = self.time_replay(
                                capture_graph(self.ours_call(x, variant=v))
                            )
                        self.sweep.append(entry)
                        print("sweep", json.dumps(entry), flush=True)
                        del x

    def progress(self, row):
        keep = {k: (round(v, 5) if isinstance(v, float) else v) for k, v in row.items()}
        print(json.dumps(keep), flush=True)
        self.save()

    def run(self):
        self.collect_meta()
        if self.args.sweep and self.args.mode != "fla":
            self.sweep_rows()
        for dtype_name in self.args.dtypes:
            for heads in self.args.heads:
                for n in self.args.seqs:
                    for tokens in self.args.tokens:
                        if self.over_budget():
                            self.errors.append("budget reached: remaining rows skipped")
                            self.save()
                            return
                        try:
                            self.row(dtype_name, heads, n, tokens)
                        except Exception as exc:  # noqa: BLE001 - report and go on
                            self.errors.append(f"{dtype_name} H={heads} N={n} T={tokens}: {type(exc).__name__}: {exc}")
                            print(self.errors[-1], flush=True)
                        torch.cuda.empty_cache()
        self.save()

    def collect_meta(self):
        props = torch.cuda.get_device_properties(0)
        self.meta = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": props.name,
            "sms": props.multi_processor_count,
            "torch": torch.__version__,
            "fla": peers.fla_version() if self.fla is not None else None,
            "warmup": self.warmup,
            "iters": self.iters,
            "layout": self.args.layout,
            "gate": self.args.gate,
            "copy_bandwidth": peers.copy_bandwidth("cuda"),
            "mode": self.args.mode,
            "launch_floor_ms": self.launch_floor(),
        }
        print(json.dumps(self.meta), flush=True)

    def launch_floor(self) -> float:
        """The timing of a graph replaying one kernel that writes one element: what no row can
        go below in this harness (graph launch, a kernel's start and end, the events)."""
        one = torch.empty(1, device="cuda")
        return self.time_replay(capture_graph(lambda: one.fill_(1.0)))

    def save(self):
        result = {"meta": self.meta, "rows": self.rows, "sweep": self.sweep, "errors": self.errors}
        if self.args.json:
            Path(self.args.json).write_text(json.dumps(result, indent=1) + "\n")
        if self.args.markdown:
            Path(self.args.markdown).write_text(render_markdown(result))


def merge(results):
    """One result from several runs of the same rows: per row, the union of their fields (a
    field two results both have keeps the first one's value: list ours before fla)."""
    key = ("dtype", "layout", "heads", "seqs", "tokens")
    rows, meta, sweep, errors = {}, {}, [], []
    for res in results:
        meta = {**res["meta"], **meta} if res["meta"].get("mode") != "ours" else {**meta, **res["meta"]}
        sweep += res.get("sweep", [])
        errors += res.get("errors", [])
        for r in res["rows"]:
            row = rows.setdefault(tuple(r[k] for k in key), {})
            for name, value in r.items():
                row.setdefault(name, value)
    meta["mode"] = "merged"
    meta["fla"] = next((r["meta"].get("fla") for r in results if r["meta"].get("fla")), None)
    return {"meta": meta, "rows": list(rows.values()), "sweep": sweep, "errors": errors}


def repick(result):
    """Rows' ``ours_ms`` become the timing of the variant ``pick_variant`` picks now (measured in
    the same run, ``row["variants"]``); ``ours_inter_ms`` stays as measured (its variant is kept
    in ``inter_variant``)."""
    from cula_aot.ops.decode import pick_variant

    for r in result["rows"]:
        chosen = variant_name(
            pick_variant(r["seqs"], r["heads"], r["tokens"], r["dtype"] == "bf16", r.get("layout", "vk"))
        )
        if "ours_inter_ms" in r:
            r.setdefault("inter_variant", r["v_block"])
        if r.get("variants") and chosen in r["variants"]:
            r["ours_ms"], r["v_block"] = r["variants"][chosen], chosen
        elif chosen != r["v_block"]:
            result["errors"].append(
                f"{r['dtype']} H={r['heads']} N={r['seqs']} T={r['tokens']}: picked {chosen} "
                f"was not timed; {r['v_block']} reported"
            )
    result["meta"]["repicked"] = True


def _fla_function():
    os.environ.setdefault("FLA_FLASH_KDA", "0")
    try:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except ImportError:
        return None
    return fused_recurrent_kda_fwd


def _rel_rmse(a, b):
    a, b = a.double(), b.double()
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))


def render_markdown(res) -> str:
    meta = res["meta"]
    bw = meta.get("copy_bandwidth")
    lines = [
        f"# kda_decode on {meta.get('device')} ({meta.get('date')})",
        "",
        f"CUDA-graph replay, L2 flushed before each, {meta.get('warmup')} warm-up / {meta.get('iters')} "
        f"timed, IQM; copy bandwidth {bw / 1e9:.0f} GB/s (read + write)"
        if bw
        else "",
        "",
        f"launch floor (a graph replaying a one-element fill, same timing): {1e3 * meta['launch_floor_ms']:.1f} µs"
        if meta.get("launch_floor_ms")
        else "",
        "",
        f"fla: {meta.get('fla')} (T = 1: pool in place via ssm_state_indices; T > 1: plain path, "
        f"states in / new states out); state layout {meta.get('layout')}",
        "",
        "| pool | H | N | T | N·H | v_block | ours µs | GB/s | % copy | fla µs | vs fla | ours+inter µs | % copy "
        "| [N, T] slots µs | % copy | o vs fla | state vs fla |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in res["rows"]:
        if "ours_ms" not in r:
            continue
        gbs = r["bytes"] / (r["ours_ms"] * 1e-3) / 1e9
        pct = f"{100 * gbs * 1e9 / bw:.0f}%" if bw else ""
        fla = r.get("fla_ms")
        inter = r.get("ours_inter_ms")
        inter_pct = f"{100 * r['bytes_inter'] / (inter * 1e-3) / bw:.0f}%" if inter and bw else ""
        fla_us = f"{1e3 * fla:.1f}" if fla else "—"
        ratio = f"{fla / r['ours_ms']:.2f}×" if fla else "—"
        inter_us = f"{1e3 * inter:.1f}" if inter else "—"
        slots = r.get("ours_slots_ms")
        slots_us = f"{1e3 * slots:.1f}" if slots else "—"
        slots_pct = f"{100 * r['bytes_slots'] / (slots * 1e-3) / bw:.0f}%" if slots and bw else ""
        rmse_o = r.get("rmse_o_vs_fla", float("nan"))
        rmse_s = r.get("rmse_state_vs_fla", float("nan"))
        lines.append(
            f"| {r['dtype']} | {r['heads']} | {r['seqs']} | {r['tokens']} | {r['nh']} | {r['v_block']} "
            f"| {1e3 * r['ours_ms']:.1f} | {gbs:.0f} | {pct} | {fla_us} | {ratio} | {inter_us} | {inter_pct} "
            f"| {slots_us} | {slots_pct} | {rmse_o:.1e} | {rmse_s:.1e} |"
        )
    with_variants = [r for r in res["rows"] if r.get("variants")]
    if with_variants:
        names = list(dict.fromkeys(k for r in with_variants for k in r["variants"]))
        lines += [
            "",
            "Every (v_block × items) kernel, µs (the default pick is the v_block column above)",
            "",
            "| pool | H | N | T | " + " | ".join(names) + " | best |",
            "| --- | --- | --- | --- | " + " | ".join("---" for _ in names) + " | --- |",
        ]
        for r in with_variants:
            v = r["variants"]
            lines.append(
                f"| {r['dtype']} | {r['heads']} | {r['seqs']} | {r['tokens']} | "
                + " | ".join(f"{1e3 * v[k]:.1f}" if k in v else "—" for k in names)
                + f" | {min(v, key=v.get)} |"
            )
    if res.get("sweep"):
        keys = list(dict.fromkeys(k for e in res["sweep"] for k in e if k.endswith("_ms")))
        lines += [
            "",
            "V-block sweep (µs)",
            "",
            "| pool | H | N | T | " + " | ".join(keys) + " |",
            "| --- | --- | --- | --- | " + " | ".join("---" for _ in keys) + " |",
        ]
        for s in res["sweep"]:
            lines.append(
                f"| {s['dtype']} | {s['heads']} | {s['seqs']} | {s['tokens']} | "
                + " | ".join(f"{1e3 * s[k]:.1f}" if k in s else "—" for k in keys)
                + " |"
            )
    if res.get("errors"):
        lines += ["", "Errors:", ""] + [f"* {e}" for e in res["errors"]]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    parser.add_argument("--quick", action="store_true", help="5 warm-up / 30 timed instead of 25 / 100")
    parser.add_argument(
        "--no-fla", dest="mode", action="store_const", const="ours", default="both", help="time cula_aot only"
    )
    parser.add_argument("--fla-only", dest="mode", action="store_const", const="fla", help="time fla only")
    parser.add_argument("--merge", nargs="+", help="join the rows of these JSON results (ours + fla) and exit")
    parser.add_argument(
        "--repick",
        action="store_true",
        help="with --merge: report, per row, the time of the variant ops.decode.pick_variant picks now "
        "(from the row's per-variant timings; rows without them keep their default)",
    )
    parser.add_argument("--heads", type=int, nargs="+", default=list(HEADS))
    parser.add_argument("--seqs", type=int, nargs="+", default=list(SEQS))
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--layout", default="vk", choices=["vk", "kv"])
    parser.add_argument(
        "--gate",
        default="safe",
        choices=["safe", "softplus"],
        help="the decay of every call (softplus: fla's unbounded gate, no lower bound)",
    )
    parser.add_argument("--sweep", action="store_true", help="also time every built V block on a subset")
    parser.add_argument("--variants-min-nh", type=int, default=256, help="time every variant from this N·H")
    parser.add_argument("--sweep-max", type=int, default=1000, help="at most this many sweep entries")
    parser.add_argument("--budget-s", type=float, default=None, help="stop starting rows after this many seconds")
    parser.add_argument("--dry-run", action="store_true", help="list the rows and exit (no GPU)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.merge:
        merged = merge([json.loads(Path(p).read_text()) for p in args.merge])
        if args.repick:
            repick(merged)
        if args.json:
            Path(args.json).write_text(json.dumps(merged, indent=1) + "\n")
        if args.markdown:
            Path(args.markdown).write_text(render_markdown(merged))
        return 0
    if args.dry_run:
        for d in args.dtypes:
            for h in args.heads:
                for n in args.seqs:
                    for t in args.tokens:
                        print(d, h, n, t)
        return 0
    Bench(args).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
