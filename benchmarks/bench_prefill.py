#!/usr/bin/env python3
"""The KDA prefill benchmark suite (docs/CONTRACT.md §7): cula_aot against its peers on one GPU.

    python -m benchmarks.bench_prefill [--json PATH] [--markdown PATH] [--only SECTIONS]
                                       [--quick] [--no-fla] [--budget-s S] [--dry-run]

Sections (default: all, in this order; ``--only spec,cp`` picks some):

* ``overhead``: host time per call of a tiny problem (H=8, T=16) issued back to back, for
  cula_aot and for fla, plus the tiny problem's eager and CUDA-graph time.
* ``spec``: CONTRACT §7 serial workloads (H ∈ {64, 96}: fixed 1×8192, varlen 6 seqs, uniform
  8×1024) for every K2 V block the build compiled, beside K1 alone, the published cuLA H200
  figures and fla.
* ``serving``: the serving matrix (CONTRACT §7's serving shapes): H ∈ {4, 8, 16, 32} × varlen batches 1×8192,
  8×1024, 32×256 and 4×2048 + 16×128; K1 alone, serial and ``intracard_cp="auto"``, eager and
  graph (``auto`` must never lose to serial), fla beside when importable.
* ``gates``: the production shards (H12 1×2048 and 1×8192, H16/H24/H32 1×8192, H16 8×2048) and
  the serving matrix (``--shards-only``: not the matrix), each with the safe gate and with fla's
  softplus gate (``testing.standard_inputs(gate="softplus")``), graph replay, fla beside; the
  forced splits s ∈ {2, 4, 8} too (short prompts: the planner's data beside fla).
* ``cp``: CONTRACT §7 intracard-CP workloads (H ∈ {4, 8}): serial, s_split ∈ {2, 4, 8, 16} and the
  planner's ``auto``, eager; s ∈ {4, 8, 16, auto}, serial and fla also under CUDA-graph replay.
* ``cp_long``: long contexts: H ∈ {1, 4, 8} × [65536], [131072] and
  [131072, 5 × 1024], CUDA-graph replay only: serial, s_split ∈ {8, 16, 32, 64} and ``auto``,
  with the CP speedup over serial (``auto`` must never lose to serial).
* ``cp_sweep``: planner data (the CP cost model's fit): H ∈ {1, 2, 4, 8, 16, 32} × single 4k–16k
  sequences and many-sequence batches, and single 1k–4k prompts at the shards' H (4–64),
  CUDA-graph replay only: serial, s_split ∈ {2, 4, 8, 16, 32} and ``auto`` (how far ``auto`` is
  from the best split, and that it never loses to serial).
* ``checkpoints``: the cost of prefix-cache checkpoints (``checkpoint_every``) on the spec, serving
  and CP rows: CUDA-graph replay of the automatic path without checkpoints, with one every 1024
  tokens and one every 256 (each to its own slot of an fp32 pool), as ratios with ÷ without.
* ``fixed``: H=64, (B, T) ∈ {1, 2} × {512, 1024, 4096, 8192, 16384}, automatic V block.
* ``varlen``: H=64, B=1, N ∈ {10, 20} sequences × total T ∈ {4096, 8192, 16384} × length
  distribution, automatic V block.  Lengths (see ``varlen_lengths``), seeded by the string
  ``"N-total-dist"`` (Python's ``random.Random``, version-2 string seeding: the same on every
  machine): ``uniform`` = total/N each; ``random`` = weights U(0.25, 1.75); ``skewed`` = Zipf
  weights 1/i^1.5 (the longest ≈ half the tokens) in a seeded random order; each apportioned
  to sum exactly to the total by largest remainder, every length ≥ 1.

Every workload runs with an initial and a final state (fp32, ``[N, H, V, K]``).  Times: CUDA
events, 25 warm-up / 100 timed, interquartile mean (``benchmarks/timing.py``), eager (the
Python call on the current stream, host work included) and CUDA graph (one call captured with
static inputs, ``graph.replay()`` timed).  fla's ``chunk_kda`` (flash-linear-attention, Triton) is
called in the same process with the same semantics (``benchmarks/peers.py``) when importable;
its outputs are compared with ours (relative RMSE) so the comparison is known to be like for
like.  Achieved bandwidth = unavoidable HBM bytes (q, k, v, g, β, o, states) / graph time,
against a device copy measured in the same run.  Ratios are ours ÷ fla: < 1 means we are faster.

JSON and markdown are rewritten after every workload, so a run cut short keeps what it measured.

Run time on an H200: cula_aot's own timings take ~2 min for everything.  fla's first call per
(head count, fixed/varlen) pays Triton's JIT compile and autotuning, ~100-120 s each on a fresh
machine (measured 2026-11-29: 118 s for H=64 fixed); all sections with fla need 7 such families
(~14 min).  The gate is not part of fla's autotune keys: on 2026-12-04 the first varlen call
took 117 s at H=12 and 98 s at H=16 with the safe gate, then 11-13 s with the softplus gate at
the same H.  fla turns on Triton's ``cache_results``, so a persistent ``TRITON_CACHE_DIR``
should keep the tuned configurations across processes (not yet timed that way):
``benchmarks/with_fla.sh`` carries its ``*.autotune.json`` records (a few KB) from one bounded
device call to the next, so several calls can warm it before one run times every row.
``--fla-heads 64`` limits fla to chosen head counts; ``--budget-s`` keeps a bounded device call
from being killed mid-workload.
"""

import argparse
import datetime
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks import peers
from benchmarks.timing import capture_graph, time_cuda
from cula_aot.ops.paths import planned_split
from cula_aot.specs import K2_DEFAULT_V_BLOCK, K2_V_BLOCKS, auto_v_block
from cula_aot.testing import cu_seqlens_of, standard_inputs

SECTIONS = ("overhead", "spec", "serving", "gates", "cp", "cp_long", "cp_sweep", "checkpoints", "fixed", "varlen")
LOWER_BOUND = -5.0

# CONTRACT §7 serial: (label, heads, lengths or None for fixed, T for fixed, published cuLA H200 ms)
SPEC_LENGTHS = [1300, 547, 2048, 963, 271, 3063]
SPEC_WORKLOADS = [
    ("fixed 1x8192", 64, None, 8192, 1.1928),
    ("varlen 6 seqs 8K", 64, SPEC_LENGTHS, None, 0.9287),
    ("uniform 8x1024", 64, [1024] * 8, None, 0.6629),
    ("fixed 1x8192", 96, None, 8192, 1.3495),
    ("varlen 6 seqs 8K", 96, SPEC_LENGTHS, None, 1.2497),
    ("uniform 8x1024", 96, [1024] * 8, None, 0.9939),
]
# CONTRACT §7 CP: (heads, lengths, published cuLA H200 ms with s_split 8)
CP_WORKLOADS = [
    (4, [8192], 0.3561),
    (4, [8192, 2048], 0.3638),
    (4, [16384], 0.6357),
    (8, [8192], 0.3768),
    (8, [8192, 2048], 0.3911),
    (8, [16384], 0.6759),
]
CP_SPLITS = (False, 2, 4, 8, 16, "auto")
# CP splits also timed under CUDA-graph replay (CP captures once its plan has run eagerly).
CP_GRAPH_SPLITS = (4, 8, 16, "auto")
# Long contexts: (heads, lengths), graph replay only.
CP_LONG_WORKLOADS = [(h, lengths) for h in (1, 4, 8) for lengths in ([65536], [131072], [131072] + [1024] * 5)]
CP_LONG_SPLITS = (8, 16, 32, 64, "auto")
# Planner data (the CP cost model's fit): (heads, lengths), graph replay only.
CP_SWEEP_WORKLOADS = [
    (1, [8192]),
    (1, [16384]),
    (2, [8192]),
    (2, [16384]),
    (4, [1024] * 8),
    (4, [4096]),
    (8, [1024] * 8),
    (8, [4096]),
    (16, [8192]),
    (16, [16384]),
    (16, [2048] * 4 + [128] * 16),
    (32, [8192]),
    (32, [16384]),
    # single short prompts at the production shards' head counts
    (4, [2048]),
    (8, [2048]),
    (12, [1024]),
    (12, [2048]),
    (16, [2048]),
    (24, [2048]),
    (32, [2048]),
    (64, [2048]),
    (12, [4096]),
    (24, [4096]),
    # small batches where the planner's short-prompt overhead decides
    (4, [2048] * 4 + [128] * 16),
    (8, [2048] * 2),
    (12, [4096] * 2),
]
CP_SWEEP_SPLITS = (2, 4, 8, 16, 32, "auto")
# Serving matrix: tensor-parallel shard head counts × batch shapes, varlen.
SERVING_HEADS = (4, 8, 16, 32)
SERVING_BATCHES = [
    ("1x8192", [8192]),
    ("8x1024", [1024] * 8),
    ("32x256", [256] * 32),
    ("4x2048+16x128", [2048] * 4 + [128] * 16),
]
# Gates: production shards (Kimi Linear's 96 heads over 8 GPUs is H12) and the serving matrix, each
# with the safe and the softplus gate, CUDA-graph replay, fla beside.
SHARD_WORKLOADS = [
    (12, "1x2048", [2048]),
    (12, "1x8192", [8192]),
    (16, "1x8192", [8192]),
    (24, "1x8192", [8192]),
    (32, "1x8192", [8192]),
    (16, "8x2048", [2048] * 8),
]
GATE_WORKLOADS = SHARD_WORKLOADS + [
    (heads, label, lengths) for heads in SERVING_HEADS for label, lengths in SERVING_BATCHES
]
BENCH_GATES = ("safe", "softplus")
# Forced CP splits also timed on every gates row (graph replay): the planner's data on short
# prompts, beside fla in the same run.
GATE_CP_SPLITS = (2, 4, 8)
# Checkpoints: every spec, serving and CP row, at these periods (tokens).
CHECKPOINT_WORKLOADS = (
    [("spec", heads, label, lengths, seq_len) for label, heads, lengths, seq_len, _ in SPEC_WORKLOADS]
    + [("serving", heads, label, lengths, None) for heads in SERVING_HEADS for label, lengths in SERVING_BATCHES]
    + [("cp", heads, f"{len(lengths)} seqs {sum(lengths)}", lengths, None) for heads, lengths, _ in CP_WORKLOADS]
)
CHECKPOINT_PERIODS = (1024, 256)
SWEEP_HEADS = 64
FIXED_SWEEP = [(b, t) for b in (1, 2) for t in (512, 1024, 4096, 8192, 16384)]
VARLEN_SWEEP = [
    (n, total, dist) for n in (10, 20) for total in (4096, 8192, 16384) for dist in ("uniform", "random", "skewed")
]


def _apportion(total, weights):
    """Integers ≥ 1 proportional to ``weights`` summing exactly to ``total`` (largest remainder)."""
    n = len(weights)
    spare = total - n
    scaled = [spare * w / sum(weights) for w in weights]
    lengths = [1 + int(s) for s in scaled]
    order = sorted(range(n), key=lambda i: scaled[i] - int(scaled[i]), reverse=True)
    for i in order[: total - sum(lengths)]:
        lengths[i] += 1
    return lengths


def varlen_lengths(n, total, dist):
    """The sequence lengths of one varlen sweep workload (see the module docstring)."""
    rng = random.Random(f"{n}-{total}-{dist}")
    if dist == "uniform":
        weights = [1.0] * n
    elif dist == "random":
        weights = [rng.uniform(0.25, 1.75) for _ in range(n)]
    elif dist == "skewed":
        weights = [1.0 / (i + 1) ** 1.5 for i in range(n)]
        rng.shuffle(weights)
    else:
        raise ValueError(f"unknown length distribution {dist!r}")
    lengths = _apportion(total, weights)
    assert sum(lengths) == total and min(lengths) >= 1
    return lengths


def make_inputs(heads, batch, lengths, seq_len, device, seed=0, gate="safe"):
    """CONTRACT §8 inputs drawn on the device (seeded; ``cula_aot.testing.standard_inputs``): q, k,
    v, g ~ N(0,1) bf16, β ~ N(0,1) bf16 logits, A_log = log U(1,16), dt_bias ~ 0.1·N(0,1), initial
    state ``s0`` ~ 0.1·N(0,1) fp32 per sequence; ``cu``/``cu_cpu`` (varlen) on the device and the host;
    ``gate``: the decay the calls use ("safe" with lower_bound -5, or "softplus")."""
    total = sum(lengths) if lengths else seq_len
    n = len(lengths) if lengths else batch
    x = standard_inputs(batch, total, heads, device=device, seed=seed, n_states=n, gate=gate)
    cu = cu_cpu = None
    if lengths:
        cu_cpu = cu_seqlens_of(lengths)
        cu = cu_cpu.to(device)
    return {
        "q": x["q"],
        "k": x["k"],
        "v": x["v"],
        "g": x["g"],
        "beta": x["beta"],
        "cu": cu,
        "cu_cpu": cu_cpu,
        "A_log": x["A_log"],
        "dt_bias": x["dt_bias"],
        "s0": x["initial_state"],
        "gate": gate,
    }


def gate_options(x) -> dict:
    """The gate arguments of our calls on inputs ``x``."""
    return {"gate": x["gate"], "lower_bound": LOWER_BOUND if x["gate"] == "safe" else None}


def prefill_runner(x, **options):
    """A no-argument call of our full prefill (initial + final state) on inputs ``x``, writing
    into preallocated ``out``/``final``; returns ``(out, final)``."""
    from cula_aot.ops.prefill import prefill

    out = torch.empty_like(x["v"])
    final = torch.empty_like(x["s0"])

    def run():
        prefill(
            x["q"],
            x["k"],
            x["v"],
            x["g"],
            x["beta"],
            A_log=x["A_log"],
            dt_bias=x["dt_bias"],
            initial_state=x["s0"],
            cu_seqlens=x["cu"],
            cu_seqlens_cpu=x["cu_cpu"],
            out=out,
            final_state=final,
            **gate_options(x),
            **options,
        )
        return out, final

    return run


def checkpoint_options(x, every):
    """``checkpoint_*`` arguments writing every checkpoint of inputs ``x`` at period ``every`` to
    its own slot of an fp32 pool."""
    lengths = x["cu_cpu"].diff().tolist() if x["cu"] is not None else [x["q"].shape[1]] * x["q"].shape[0]
    columns = max(1, max(lengths) // every)
    slots = max(1, sum(n // every for n in lengths))
    indices = torch.full((len(lengths), columns), -1, dtype=torch.int32)
    slot = 0
    for n, length in enumerate(lengths):
        for j in range(length // every):
            indices[n, j] = slot
            slot += 1
    heads = x["q"].shape[2]
    pool = torch.empty(slots, heads, 128, 128, device=x["q"].device)
    return {"checkpoint_every": every, "checkpoint_pool": pool, "checkpoint_indices": indices.to(x["q"].device)}


def k1_runner(x):
    from cula_aot.ops.prepare import prepare

    def run():
        prepare(
            x["q"],
            x["k"],
            x["g"],
            x["beta"],
            A_log=x["A_log"],
            dt_bias=x["dt_bias"],
            cu_seqlens=x["cu"],
            **gate_options(x),
        )

    return run


class Bench:
    """Holds the options, the results and the output files; every measurement goes through it."""

    def __init__(self, args):
        self.args = args
        self.warmup, self.iters = (5, 20) if args.quick else (25, 100)
        self.device = torch.device("cuda", 0)
        self.start = time.perf_counter()
        self.results = {"meta": {}, "errors": []}
        self.use_fla = not args.no_fla and peers.fla_version() is not None
        self.sm_count = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.fla_heads = None if args.fla_heads is None else {int(h) for h in args.fla_heads.split(",")}

    def fla_for(self, heads):
        return self.use_fla and (self.fla_heads is None or heads in self.fla_heads)

    # -- timing helpers -------------------------------------------------------------------------
    def time(self, fn):
        return time_cuda(fn, warmup=self.warmup, iters=self.iters)

    def time_graph(self, fn, what):
        """IQM ms of replaying one captured call of ``fn``, or None (reason recorded) if capture fails."""
        try:
            graph = capture_graph(fn)
        except Exception as exc:  # noqa: BLE001 - a peer that cannot be captured is a result, not a crash
            torch.cuda.synchronize()
            self.error(f"{what}: CUDA-graph capture failed: {type(exc).__name__}: {str(exc)[:300]}")
            return None
        try:
            return self.time(graph.replay)
        finally:
            del graph

    def error(self, message):
        print(f"[bench] {message}", flush=True)
        self.results["errors"].append(message)

    def skipped_for_budget(self, rows, row):
        """Past ``--budget-s``: record ``row`` as skipped and say so."""
        budget = self.args.budget_s
        if budget is None or time.perf_counter() - self.start <= budget:
            return False
        row["skipped"] = "time budget"
        rows.append(row)
        return True

    def measure(self, x, ours_eager_ms=None):
        """Ours eager (unless already timed) + graph (serial, automatic V block), fla eager + graph,
        and fla-vs-ours relative RMSE."""
        heads, num_seqs = x["q"].shape[2], (x["q"].shape[0] if x["cu"] is None else x["cu"].numel() - 1)
        row = {"GB": peers.prefill_bytes(x) / 1e9, "auto_v_block": auto_v_block(heads, num_seqs, self.sm_count)}
        ours = prefill_runner(x, intracard_cp=False)
        row["ours_eager_ms"] = self.time(ours) if ours_eager_ms is None else ours_eager_ms
        row["ours_graph_ms"] = self.time_graph(ours, "ours")
        # Both serial paths whatever auto picks: the fused kernel and K1 then K2.
        for path, fused in (("fused", True), ("two_kernel", False)):
            row[f"ours_{path}_graph_ms"] = self.time_graph(
                prefill_runner(x, intracard_cp=False, fused=fused), f"ours {path}"
            )
        row.update(
            fla_eager_ms=None, fla_graph_ms=None, fla_first_call_s=None, fla_rel_rmse_o=None, fla_rel_rmse_state=None
        )
        if self.fla_for(x["q"].shape[2]):
            fla = peers.fla_runner(x, gate_options(x)["lower_bound"])
            try:
                t0 = time.perf_counter()
                o_fla, s_fla = fla()
                torch.cuda.synchronize()
                row["fla_first_call_s"] = time.perf_counter() - t0
                o, s = ours()
                row["fla_rel_rmse_o"] = rel_rmse(o, o_fla)
                row["fla_rel_rmse_state"] = rel_rmse(s, s_fla)
                del o_fla, s_fla
                row["fla_eager_ms"] = self.time(fla)
            except Exception as exc:  # noqa: BLE001
                torch.cuda.synchronize()
                self.error(f"fla chunk_kda failed: {type(exc).__name__}: {str(exc)[:300]}")
            else:
                row["fla_graph_ms"] = self.time_graph(fla, "fla")
        return row

    # -- sections -------------------------------------------------------------------------------
    def run_overhead(self):
        """Host time per call, tiny problem (H=8, T=16, one sequence, states), back to back."""
        x = make_inputs(8, 1, None, 16, self.device)
        res = {"H": 8, "B": 1, "T": 16}

        def per_call_us(fn, calls):
            for _ in range(50):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            return 1e6 * (time.perf_counter() - t0) / calls

        ours = prefill_runner(x, intracard_cp=False)
        res["ours_host_us"] = per_call_us(ours, 2000)
        res["ours_eager_ms"] = self.time(ours)
        res["ours_graph_ms"] = self.time_graph(ours, "ours tiny")
        res.update(fla_host_us=None, fla_eager_ms=None, fla_graph_ms=None)
        if self.fla_for(8):
            fla = peers.fla_runner(x, LOWER_BOUND)
            try:
                res["fla_host_us"] = per_call_us(fla, 500)
                res["fla_eager_ms"] = self.time(fla)
            except Exception as exc:  # noqa: BLE001
                self.error(f"fla tiny problem failed: {type(exc).__name__}: {str(exc)[:300]}")
            else:
                res["fla_graph_ms"] = self.time_graph(fla, "fla tiny")
        self.results["overhead"] = res
        self.save()

    def run_spec(self):
        rows = self.results.setdefault("spec", [])
        for label, heads, lengths, seq_len, published in SPEC_WORKLOADS:
            row = {
                "workload": label,
                "H": heads,
                "lengths": lengths,
                "T": seq_len or sum(lengths),
                "published_cula_ms": published,
            }
            if self.skipped_for_budget(rows, row):
                continue
            x = make_inputs(heads, 1, lengths, seq_len, self.device)
            row["k1_ms"] = self.time(k1_runner(x))
            for vb in K2_V_BLOCKS:
                row[f"ours_eager_ms_vb{vb}"] = self.time(prefill_runner(x, intracard_cp=False, v_block=vb))
            picked = auto_v_block(heads, 1 if lengths is None else len(lengths), self.sm_count)
            row.update(self.measure(x, ours_eager_ms=row[f"ours_eager_ms_vb{picked}"]))
            row["ours_eager_ms"] = min(row[f"ours_eager_ms_vb{vb}"] for vb in K2_V_BLOCKS)
            del x
            self.finish_row(rows, row, f"spec H={heads} {label}")

    def run_serving(self):
        """Serial and ``intracard_cp="auto"`` on the serving matrix, eager and graph, with K1 alone."""
        rows = self.results.setdefault("serving", [])
        for heads in SERVING_HEADS:
            for label, lengths in SERVING_BATCHES:
                row = {"H": heads, "workload": label, "lengths": lengths}
                if self.skipped_for_budget(rows, row):
                    continue
                x = make_inputs(heads, 1, lengths, None, self.device)
                row["k1_ms"] = self.time(k1_runner(x))
                auto = prefill_runner(x, intracard_cp="auto")
                row["cp_auto_ms"] = self.time(auto)
                row["cp_auto_graph_ms"] = self.time_graph(auto, f"serving H={heads} {label} auto")
                row["auto_split"] = planned_split(lengths, heads, self.device)
                row.update(self.measure(x))
                del x
                self.finish_row(rows, row, f"serving H={heads} {label} (auto split {row['auto_split']})")

    def run_gates(self):
        """The production shards and the serving matrix with the safe and the softplus gate side by
        side (one row per gate; ``softplus_over_safe`` on the softplus rows): graph replay of the
        automatic path, fla beside."""
        rows = self.results.setdefault("gates", [])
        for heads, label, lengths in gate_workloads(self.args.shards_only):
            safe_ms = None
            for gate in BENCH_GATES:
                row = {"H": heads, "workload": label, "lengths": lengths, "gate": gate}
                if self.skipped_for_budget(rows, row):
                    continue
                x = make_inputs(heads, 1, lengths, None, self.device, gate=gate)
                row["k1_ms"] = self.time(k1_runner(x))
                row.update(self.measure(x))
                auto = prefill_runner(x, intracard_cp="auto")
                row["cp_auto_graph_ms"] = self.time_graph(auto, f"gates H={heads} {label} {gate} auto")
                row["auto_split"] = planned_split(lengths, heads, self.device)
                for split in GATE_CP_SPLITS:
                    row[f"cp_{split}_graph_ms"] = self.time_graph(
                        prefill_runner(x, intracard_cp=split), f"gates H={heads} {label} {gate} s={split}"
                    )
                if gate == "safe":
                    safe_ms = row["ours_graph_ms"]
                elif safe_ms and row["ours_graph_ms"]:
                    row["softplus_over_safe"] = row["ours_graph_ms"] / safe_ms
                del x
                self.finish_row(rows, row, f"gates H={heads} {label} {gate}")

    def run_cp(self):
        rows = self.results.setdefault("cp", [])
        for heads, lengths, published in CP_WORKLOADS:
            row = {"H": heads, "lengths": lengths, "published_cula_ms": published}
            if self.skipped_for_budget(rows, row):
                continue
            x = make_inputs(heads, 1, lengths, None, self.device)
            for split in CP_SPLITS:
                row[f"cp_{split}_ms"] = self.time(prefill_runner(x, intracard_cp=split))
            for split in CP_GRAPH_SPLITS:
                row[f"cp_{split}_graph_ms"] = self.time_graph(prefill_runner(x, intracard_cp=split), f"cp s={split}")
            row.update(self.measure(x, ours_eager_ms=row["cp_False_ms"]))
            del x
            self.finish_row(rows, row, f"cp H={heads} {lengths}")

    def run_cp_long(self):
        self._run_split_graphs("cp_long", CP_LONG_WORKLOADS, CP_LONG_SPLITS)

    def run_cp_sweep(self):
        self._run_split_graphs("cp_sweep", CP_SWEEP_WORKLOADS, CP_SWEEP_SPLITS)

    def _run_split_graphs(self, section, workloads, splits):
        """Serial and every split in ``splits`` under CUDA-graph replay, with the planner's pick."""
        rows = self.results.setdefault(section, [])
        for heads, lengths in workloads:
            row = {"H": heads, "lengths": lengths}
            if self.skipped_for_budget(rows, row):
                continue
            x = make_inputs(heads, 1, lengths, None, self.device)
            row["GB"] = peers.prefill_bytes(x) / 1e9
            row["serial_graph_ms"] = self.time_graph(prefill_runner(x, intracard_cp=False), "serial")
            for split in splits:
                row[f"cp_{split}_graph_ms"] = self.time_graph(prefill_runner(x, intracard_cp=split), f"cp s={split}")
            row["auto_split"] = planned_split(lengths, heads, self.device)
            del x
            self.finish_row(rows, row, f"{section} H={heads} {len(lengths)} seqs, {sum(lengths)} tokens")

    def run_checkpoints(self):
        """Graph replay of the automatic path without and with checkpoints (``CHECKPOINT_PERIODS``):
        ``checkpoint_<N>_ratio`` = with ÷ without."""
        rows = self.results.setdefault("checkpoints", [])
        for source, heads, label, lengths, seq_len in CHECKPOINT_WORKLOADS:
            row = {"source": source, "H": heads, "workload": label, "lengths": lengths, "T": seq_len or sum(lengths)}
            if self.skipped_for_budget(rows, row):
                continue
            x = make_inputs(heads, 1, lengths, seq_len, self.device)
            row["auto_split"] = 1 if lengths is None else planned_split(lengths, heads, self.device)
            plain = row["plain_graph_ms"] = self.time_graph(
                prefill_runner(x, intracard_cp="auto"), f"checkpoints H={heads} {label}"
            )
            for every in CHECKPOINT_PERIODS:
                options = checkpoint_options(x, every)
                row[f"checkpoints_{every}"] = int((options["checkpoint_indices"] >= 0).sum())
                timed = row[f"checkpoint_{every}_graph_ms"] = self.time_graph(
                    prefill_runner(x, intracard_cp="auto", **options), f"checkpoints H={heads} {label} every {every}"
                )
                if plain and timed:
                    row[f"checkpoint_{every}_ratio"] = timed / plain
                del options
            del x
            self.finish_row(
                rows,
                row,
                f"checkpoints {source} H={heads} {label}: "
                + " ".join(f"every {n} x{_f(row.get(f'checkpoint_{n}_ratio'), 3)}" for n in CHECKPOINT_PERIODS),
            )

    def run_fixed(self):
        rows = self.results.setdefault("fixed", [])
        for batch, seq_len in FIXED_SWEEP:
            row = {"H": SWEEP_HEADS, "B": batch, "T": seq_len}
            if self.skipped_for_budget(rows, row):
                continue
            x = make_inputs(SWEEP_HEADS, batch, None, seq_len, self.device)
            row.update(self.measure(x))
            del x
            self.finish_row(rows, row, f"fixed {batch}x{seq_len}")

    def run_varlen(self):
        rows = self.results.setdefault("varlen", [])
        for n, total, dist in VARLEN_SWEEP:
            lengths = varlen_lengths(n, total, dist)
            row = {"H": SWEEP_HEADS, "N": n, "T": total, "dist": dist, "max_len": max(lengths), "lengths": lengths}
            if self.skipped_for_budget(rows, row):
                continue
            x = make_inputs(SWEEP_HEADS, 1, lengths, None, self.device)
            row.update(self.measure(x))
            del x
            self.finish_row(rows, row, f"varlen N={n} T={total} {dist}")

    def finish_row(self, rows, row, what):
        """Keep a measured workload: record it, report it, free its memory, save the files."""
        rows.append(row)
        self.progress(what, row)
        torch.cuda.empty_cache()
        self.save()

    def progress(self, what, row):
        keys = ("ours_eager_ms", "ours_graph_ms", "fla_eager_ms", "fla_graph_ms")
        cells = " ".join(f"{k[:-3]}={_f(row.get(k))}" for k in keys)
        print(f"[{time.perf_counter() - self.start:6.1f}s] {what}: {cells}", flush=True)

    # -- driver ---------------------------------------------------------------------------------
    def collect_meta(self):
        props = torch.cuda.get_device_properties(self.device)
        meta = self.results["meta"]
        meta.update(
            date_utc=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            command=" ".join(sys.argv),
            gpu=props.name,
            sm_count=props.multi_processor_count,
            torch=torch.__version__,
            cuda=torch.version.cuda,
            warmup=self.warmup,
            iters=self.iters,
            default_v_block=K2_DEFAULT_V_BLOCK,
            v_blocks=list(K2_V_BLOCKS),
            fla=peers.fla_version(),
            fla_used=self.use_fla,
            fla_heads=None if self.fla_heads is None else sorted(self.fla_heads),
        )
        try:
            import triton

            meta["triton"] = triton.__version__
        except ImportError:
            meta["triton"] = None
        try:
            meta["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                check=False,
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            meta["driver"] = None
        import cula_aot

        meta["cula_aot"] = cula_aot.__version__

    def run(self, sections):
        self.collect_meta()
        bandwidth = peers.copy_bandwidth(self.device)
        self.results["meta"]["copy_bandwidth_Bps"] = bandwidth
        print(
            f"device copy bandwidth: {bandwidth / 1e12:.2f} TB/s (read + write); fla: "
            f"{self.results['meta']['fla'] if self.use_fla else 'not used'}",
            flush=True,
        )
        for section in sections:
            getattr(self, f"run_{section}")()
        self.results["meta"]["elapsed_s"] = time.perf_counter() - self.start
        self.save()

    def save(self):
        if self.args.json:
            Path(self.args.json).write_text(json.dumps(self.results, indent=1))
        if self.args.markdown:
            Path(self.args.markdown).write_text(render_markdown(self.results))


def rel_rmse(a, b):
    """‖a − b‖ / ‖b‖ over all elements (fp32 accumulation; NaN/Inf in ``a`` gives inf)."""
    a, b = a.float(), b.float()
    if not bool(torch.isfinite(a).all()):
        return float("inf")
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))


# -- markdown -----------------------------------------------------------------------------------
def _f(v, digits=4):
    return "–" if v is None else f"{v:.{digits}f}"


def _ratio(a, b):
    return "–" if a is None or b is None else f"{a / b:.2f}x"


def _pct_bw(row, key, bandwidth):
    ms = row.get(key)
    if ms is None or not bandwidth:
        return "–"
    return f"{100 * row['GB'] * 1e9 / (ms * 1e-3) / bandwidth:.1f}%"


def _rmse(row):
    o, s = row.get("fla_rel_rmse_o"), row.get("fla_rel_rmse_state")
    return "–" if o is None else f"{o:.1e} / {s:.1e}"


def _table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


PEER_HEADER = ["ours eager ms", "ours graph ms", "fla eager ms", "fla graph ms", "ours/fla eager", "ours/fla graph"]


def _peer_cells(r):
    return [
        _f(r.get("ours_eager_ms")),
        _f(r.get("ours_graph_ms")),
        _f(r.get("fla_eager_ms")),
        _f(r.get("fla_graph_ms")),
        _ratio(r.get("ours_eager_ms"), r.get("fla_eager_ms")),
        _ratio(r.get("ours_graph_ms"), r.get("fla_graph_ms")),
    ]


def lengths_label(lengths):
    """Run-length form of a batch's lengths: [131072, 1024 × 5] → "131072 + 5×1024"."""
    runs = []
    for n in lengths:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    return " + ".join(str(n) if count == 1 else f"{count}×{n}" for n, count in runs)


def _split_graph_table(rows, splits, bw):
    """The table of a ``_run_split_graphs`` section: serial, each split, the best and auto."""
    header = (
        ["H", "lengths", "serial graph"]
        + [f"s={s} graph" for s in splits]
        + ["auto split", "best CP", "serial ÷ best CP", "serial ÷ auto", "auto ÷ best", "% BW (best)"]
    )
    out = []
    for r in rows:
        label = lengths_label(r["lengths"])
        if r.get("skipped"):
            out.append([r["H"], label, f"skipped ({r['skipped']})"] + [""] * (len(header) - 3))
            continue
        cps = [r.get(f"cp_{s}_graph_ms") for s in splits]
        serial, auto = r.get("serial_graph_ms"), r.get("cp_auto_graph_ms")
        best = min((v for v in cps + [serial] if v is not None), default=None)
        best_cp = min((v for v in cps if v is not None), default=None)
        pct = f"{100 * r['GB'] * 1e9 / (best * 1e-3) / bw:.0f}%" if best and bw else "–"
        out.append(
            [r["H"], label, _f(serial)]
            + [_f(v) for v in cps]
            + [r.get("auto_split"), _f(best_cp), _ratio(serial, best_cp), _ratio(serial, auto), _ratio(auto, best), pct]
        )
    return _table(header, out)


def render_markdown(res):
    meta = res.get("meta", {})
    bw = meta.get("copy_bandwidth_Bps")
    out = ["# KDA prefill benchmark", ""]
    out.append(
        f"{meta.get('gpu', '?')} ({meta.get('sm_count', '?')} SMs), driver {meta.get('driver', '?')}, "
        f"torch {meta.get('torch', '?')} (CUDA {meta.get('cuda', '?')}), triton {meta.get('triton', '?')}, "
        f"fla {meta.get('fla') or 'not installed'}, cula_aot {meta.get('cula_aot', '?')}; "
        f"{meta.get('date_utc', '?')}; `{meta.get('command', '')}`."
    )
    out.append(
        f"CUDA events, {meta.get('warmup', '?')} warm-up / {meta.get('iters', '?')} timed, interquartile "
        f"mean, ms. Initial + final state everywhere. Eager = the Python call (host work included); graph = "
        f"replay of one captured call. Ratios are ours ÷ fla (< 1: ours faster). Device copy bandwidth "
        f"{'–' if bw is None else f'{bw / 1e12:.2f} TB/s'} (read + write); % BW = unavoidable bytes / graph "
        f"time / copy bandwidth. RMSE = relative RMSE of fla's o / final state against ours."
    )
    out.append("")
    if "overhead" in res:
        r = res["overhead"]
        out += [
            "## Host overhead (H=8, B=1, T=16, back to back)",
            "",
            _table(
                ["impl", "host µs per call", "eager ms", "graph ms"],
                [
                    ["cula_aot", _f(r.get("ours_host_us"), 1), _f(r.get("ours_eager_ms")), _f(r.get("ours_graph_ms"))],
                    [
                        "fla chunk_kda",
                        _f(r.get("fla_host_us"), 1),
                        _f(r.get("fla_eager_ms")),
                        _f(r.get("fla_graph_ms")),
                    ],
                ],
            ),
            "",
        ]
    if res.get("spec"):
        vbs = meta.get("v_blocks", list(K2_V_BLOCKS))
        header = (
            ["H", "workload", "K1 ms"]
            + [f"eager vb={vb}" for vb in vbs]
            + PEER_HEADER
            + [
                "cuLA published ms",
                "ours graph / cuLA",
                "best peer ms",
                "ours graph / best peer",
                "GB",
                "ours % BW",
                "fla % BW",
                "RMSE o / state",
            ]
        )
        rows = []
        for r in res["spec"]:
            if r.get("skipped"):
                rows.append([r["H"], r["workload"], f"skipped ({r['skipped']})"] + [""] * (len(header) - 3))
                continue
            peers_ms = [
                v for v in (r["published_cula_ms"], r.get("fla_eager_ms"), r.get("fla_graph_ms")) if v is not None
            ]
            best_peer = min(peers_ms)
            rows.append(
                [r["H"], r["workload"], _f(r.get("k1_ms"))]
                + [_f(r.get(f"ours_eager_ms_vb{vb}")) for vb in vbs]
                + _peer_cells(r)
                + [
                    _f(r["published_cula_ms"]),
                    _ratio(r.get("ours_graph_ms"), r["published_cula_ms"]),
                    _f(best_peer),
                    _ratio(r.get("ours_graph_ms"), best_peer),
                    _f(r["GB"], 3),
                    _pct_bw(r, "ours_graph_ms", bw),
                    _pct_bw(r, "fla_graph_ms", bw),
                    _rmse(r),
                ]
            )
        title = (
            "## CONTRACT §7 serial workloads (ours graph: the automatic V block, see the JSON's auto_v_block; "
            "'ours eager ms' = the best V block)"
        )
        out += [title, "", _table(header, rows), ""]
    if res.get("serving"):
        header = [
            "H",
            "workload",
            "K1 ms",
            "serial eager",
            "serial graph",
            "auto split",
            "auto eager",
            "auto graph",
            "serial ÷ auto (graph)",
            "fla graph",
            "ours best graph / fla graph",
            "GB",
            "% BW (best graph)",
            "RMSE o / state",
        ]
        rows = []
        for r in res["serving"]:
            if r.get("skipped"):
                rows.append([r["H"], r["workload"], f"skipped ({r['skipped']})"] + [""] * (len(header) - 3))
                continue
            graphs = [v for v in (r.get("ours_graph_ms"), r.get("cp_auto_graph_ms")) if v is not None]
            best = min(graphs, default=None)
            pct = f"{100 * r['GB'] * 1e9 / (best * 1e-3) / bw:.1f}%" if best and bw else "–"
            rows.append(
                [
                    r["H"],
                    r["workload"],
                    _f(r.get("k1_ms")),
                    _f(r.get("ours_eager_ms")),
                    _f(r.get("ours_graph_ms")),
                    r.get("auto_split"),
                    _f(r.get("cp_auto_ms")),
                    _f(r.get("cp_auto_graph_ms")),
                    _ratio(r.get("ours_graph_ms"), r.get("cp_auto_graph_ms")),
                    _f(r.get("fla_graph_ms")),
                    _ratio(best, r.get("fla_graph_ms")),
                    _f(r["GB"], 3),
                    pct,
                    _rmse(r),
                ]
            )
        out += [
            "## Serving matrix (varlen, initial + final state; auto must never lose to serial)",
            "",
            _table(header, rows),
            "",
        ]
    if res.get("gates"):
        header = [
            "H",
            "workload",
            "gate",
            "K1 ms",
            "serial graph",
            "auto split",
            "auto graph",
            "best forced split (graph)",
            "fla graph",
            "ours best graph / fla graph",
            "softplus ÷ safe (serial graph)",
            "RMSE o / state",
        ]
        rows = []
        for r in res["gates"]:
            if r.get("skipped"):
                rows.append([r["H"], r["workload"], r["gate"], f"skipped ({r['skipped']})"] + [""] * (len(header) - 4))
                continue
            best = min([v for v in (r.get("ours_graph_ms"), r.get("cp_auto_graph_ms")) if v is not None], default=None)
            forced = {s: r[f"cp_{s}_graph_ms"] for s in GATE_CP_SPLITS if r.get(f"cp_{s}_graph_ms")}
            split = min(forced, key=forced.get, default=None)
            rows.append(
                [
                    r["H"],
                    r["workload"],
                    r["gate"],
                    _f(r.get("k1_ms")),
                    _f(r.get("ours_graph_ms")),
                    r.get("auto_split"),
                    _f(r.get("cp_auto_graph_ms")),
                    "" if split is None else f"{_f(forced[split])} (s={split})",
                    _f(r.get("fla_graph_ms")),
                    _ratio(best, r.get("fla_graph_ms")),
                    _f(r.get("softplus_over_safe"), 3),
                    _rmse(r),
                ]
            )
        out += [
            "## Gates: production shards and serving rows, safe and softplus (graph replay)",
            "",
            _table(header, rows),
            "",
        ]
    if res.get("cp"):
        header = (
            ["H", "lengths", "serial eager"]
            + [f"s={s} eager" for s in CP_SPLITS[1:-1]]
            + ["auto eager"]
            + [f"s={s} graph" for s in CP_GRAPH_SPLITS]
            + [
                "serial graph",
                "fla eager",
                "fla graph",
                "serial graph / fla graph",
                "cuLA s=8 published",
                "best ours",
                "best peer",
                "best ours / best peer",
                "RMSE o / state",
            ]
        )
        rows = []
        for r in res["cp"]:
            if r.get("skipped"):
                rows.append([r["H"], r["lengths"], f"skipped ({r['skipped']})"] + [""] * (len(header) - 3))
                continue
            graphs = [r.get(f"cp_{s}_graph_ms") for s in CP_GRAPH_SPLITS]
            best = min(
                v for v in [r[f"cp_{s}_ms"] for s in CP_SPLITS] + graphs + [r.get("ours_graph_ms")] if v is not None
            )
            best_peer = min(
                v for v in (r["published_cula_ms"], r.get("fla_eager_ms"), r.get("fla_graph_ms")) if v is not None
            )
            rows.append(
                [r["H"], r["lengths"]]
                + [_f(r[f"cp_{s}_ms"]) for s in CP_SPLITS]
                + [_f(v) for v in graphs]
                + [
                    _f(r.get("ours_graph_ms")),
                    _f(r.get("fla_eager_ms")),
                    _f(r.get("fla_graph_ms")),
                    _ratio(r.get("ours_graph_ms"), r.get("fla_graph_ms")),
                    _f(r["published_cula_ms"]),
                    _f(best),
                    _f(best_peer),
                    _ratio(best, best_peer),
                    _rmse(r),
                ]
            )
        out += ["## CONTRACT §7 intracard-CP workloads (eager and CUDA-graph replay)", "", _table(header, rows), ""]
    for section, splits, title in (
        ("cp_long", CP_LONG_SPLITS, "Long contexts, intracard CP"),
        ("cp_sweep", CP_SWEEP_SPLITS, "Planner sweep: forced splits against auto"),
    ):
        if res.get(section):
            out += [
                f"## {title} (CUDA-graph replay; ratios > 1: CP faster than serial)",
                "",
                _split_graph_table(res[section], splits, bw),
                "",
            ]
    if res.get("checkpoints"):
        header = ["rows", "H", "workload", "auto split", "without (graph ms)"] + [
            c
            for n in CHECKPOINT_PERIODS
            for c in (f"every {n}: checkpoints", f"every {n}: ms", f"every {n}: with ÷ without")
        ]
        rows = []
        for r in res["checkpoints"]:
            if r.get("skipped"):
                rows.append(
                    [r["source"], r["H"], r["workload"], f"skipped ({r['skipped']})"] + [""] * (len(header) - 4)
                )
                continue
            rows.append(
                [r["source"], r["H"], r["workload"], r.get("auto_split"), _f(r.get("plain_graph_ms"))]
                + [
                    c
                    for n in CHECKPOINT_PERIODS
                    for c in (
                        r.get(f"checkpoints_{n}"),
                        _f(r.get(f"checkpoint_{n}_graph_ms")),
                        _f(r.get(f"checkpoint_{n}_ratio"), 3),
                    )
                ]
            )
        out += [
            "## Prefix-cache checkpoints (automatic path, graph replay; fp32 pool, one slot per checkpoint)",
            "",
            _table(header, rows),
            "",
        ]
    if res.get("fixed"):
        header = ["B", "T"] + PEER_HEADER + ["GB", "ours % BW", "fla % BW", "RMSE o / state"]
        rows = []
        for r in res["fixed"]:
            if r.get("skipped"):
                rows.append([r["B"], r["T"], f"skipped ({r['skipped']})"] + [""] * (len(header) - 3))
                continue
            rows.append(
                [r["B"], r["T"]]
                + _peer_cells(r)
                + [_f(r["GB"], 3), _pct_bw(r, "ours_graph_ms", bw), _pct_bw(r, "fla_graph_ms", bw), _rmse(r)]
            )
        out += [f"## Sweep: fixed length, H={SWEEP_HEADS}, automatic V block", "", _table(header, rows), ""]
    if res.get("varlen"):
        header = (
            ["N", "total T", "length dist", "max len"] + PEER_HEADER + ["GB", "ours % BW", "fla % BW", "RMSE o / state"]
        )
        rows = []
        for r in res["varlen"]:
            if r.get("skipped"):
                rows.append(
                    [r["N"], r["T"], r["dist"], r["max_len"], f"skipped ({r['skipped']})"] + [""] * (len(header) - 5)
                )
                continue
            rows.append(
                [r["N"], r["T"], r["dist"], r["max_len"]]
                + _peer_cells(r)
                + [_f(r["GB"], 3), _pct_bw(r, "ours_graph_ms", bw), _pct_bw(r, "fla_graph_ms", bw), _rmse(r)]
            )
        out += [
            f"## Sweep: varlen, H={SWEEP_HEADS}, B=1, automatic V block (lengths: see the JSON)",
            "",
            _table(header, rows),
            "",
        ]
    if res.get("errors"):
        out += ["## Errors", ""] + [f"- {e}" for e in res["errors"]] + [""]
    if "elapsed_s" in meta:
        out.append(f"Elapsed: {meta['elapsed_s']:.0f} s.")
    return "\n".join(out) + "\n"


def dry_run(sections, shards_only=False):
    """List the workloads (no GPU needed)."""
    if "overhead" in sections:
        print("overhead: H=8 B=1 T=16 (ours 2000 calls, fla 500 calls)")
    if "spec" in sections:
        for label, heads, lengths, seq_len, published in SPEC_WORKLOADS:
            print(
                f"spec: H={heads} {label} T={seq_len or sum(lengths)} lengths={lengths} "
                f"V blocks {list(K2_V_BLOCKS)} cuLA {published} ms"
            )
    if "serving" in sections:
        for heads in SERVING_HEADS:
            for label, lengths in SERVING_BATCHES:
                print(f"serving: H={heads} {label} ({len(lengths)} seqs, {sum(lengths)} tokens): serial and auto")
    if "gates" in sections:
        for heads, label, lengths in gate_workloads(shards_only):
            print(
                f"gates: H={heads} {label} gates {list(BENCH_GATES)}: serial, auto and "
                f"s={'/'.join(map(str, GATE_CP_SPLITS))}, graph"
            )
    if "cp" in sections:
        for heads, lengths, published in CP_WORKLOADS:
            print(f"cp: H={heads} lengths={lengths} splits={list(CP_SPLITS)} cuLA {published} ms")
    if "cp_long" in sections:
        for heads, lengths in CP_LONG_WORKLOADS:
            print(
                f"cp_long: H={heads} lengths={lengths[:2]}{'…' if len(lengths) > 2 else ''} splits {list(CP_LONG_SPLITS)}"
            )
    if "cp_sweep" in sections:
        for heads, lengths in CP_SWEEP_WORKLOADS:
            print(f"cp_sweep: H={heads} lengths={lengths_label(lengths)} splits {list(CP_SWEEP_SPLITS)}")
    if "checkpoints" in sections:
        for source, heads, label, lengths, seq_len in CHECKPOINT_WORKLOADS:
            print(f"checkpoints: {source} H={heads} {label}: without, every {list(CHECKPOINT_PERIODS)} tokens")
    if "fixed" in sections:
        for batch, seq_len in FIXED_SWEEP:
            print(f"fixed: H={SWEEP_HEADS} B={batch} T={seq_len}")
    if "varlen" in sections:
        for n, total, dist in VARLEN_SWEEP:
            lengths = varlen_lengths(n, total, dist)
            print(
                f"varlen: H={SWEEP_HEADS} N={n} T={total} {dist}: max {max(lengths)} min {min(lengths)} "
                f"lengths={lengths}"
            )


def gate_workloads(shards_only: bool):
    """The gates section's rows: the production shards, then (unless ``shards_only``) the serving matrix."""
    return SHARD_WORKLOADS if shards_only else GATE_WORKLOADS


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write all results here as JSON")
    parser.add_argument("--markdown", help="write the tables here as markdown")
    parser.add_argument(
        "--only",
        default=",".join(SECTIONS),
        help=f"comma-separated sections to run, from {','.join(SECTIONS)} (default: all)",
    )
    parser.add_argument("--quick", action="store_true", help="5 warm-up / 20 timed instead of 25 / 100")
    parser.add_argument("--no-fla", action="store_true", help="do not run flash-linear-attention even if importable")
    parser.add_argument("--fla-heads", help="run fla only for these head counts, e.g. 64 (default: all)")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="skip (and mark) the workloads that would start after this many seconds",
    )
    parser.add_argument(
        "--shards-only",
        action="store_true",
        help="gates: the production shards only, not the serving matrix (fla tunes per head count)",
    )
    parser.add_argument("--dry-run", action="store_true", help="list the workloads and exit (no GPU)")
    args = parser.parse_args(argv)
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {unknown}; choose from {list(SECTIONS)}")
    args.sections = [s for s in SECTIONS if s in sections]
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.dry_run:
        dry_run(args.sections, args.shards_only)
        if args.markdown:
            Path(args.markdown).write_text(render_markdown({"meta": {}, "errors": []}))
        return
    bench = Bench(args)
    bench.run(args.sections)
    print(render_markdown(bench.results))


if __name__ == "__main__":
    main()
