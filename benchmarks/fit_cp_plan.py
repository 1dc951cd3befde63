#!/usr/bin/env python3
"""Refit the intracard-CP planner's constants (``cula_aot.ops.cp_plan``) to measured splits:

    python3 -m benchmarks.fit_cp_plan docs/bench/cp_sweep.json new_run.json [--top 8]

Reads every row of the ``cp_sweep`` and ``cp_long`` sections (graph ms of serial and of each
forced split) and the forced splits of the ``gates`` rows, then searches CTAS_PER_SM, MERGE_STEP
and OVERHEAD on a grid: a row's loss is the time of the split ``auto_split`` would pick over the
row's fastest measured time (the pick's nearest measured split where it was not timed).  Prints
the current constants' picks and the best candidates', ranked by their worst loss, then the sum
of log losses, then the rms of log(time / (unit · cost)) with the best unit, so a change to the
constants is a measured choice.  Fit on timings of the kernels the wheel ships: older runs timed
older kernels.  CPU only.
"""

import argparse
import contextlib
import itertools
import json
import math
from pathlib import Path

from cula_aot.layout import D
from cula_aot.ops import cp_plan
from cula_aot.specs import K2_SEGMENTED_V_BLOCK

SM_COUNT = 132  # H100 / H200
V_BLOCKS = D // K2_SEGMENTED_V_BLOCK  # what ops.prefill passes the planner
GRID = {
    "CTAS_PER_SM": (1.5, 2.0, 2.5, 3.0, 4.0),
    "MERGE_STEP": (1.0, 2.0, 4.0, 6.0, 8.0),
    "OVERHEAD": (10.0, 20.0, 30.0, 40.0, 60.0, 80.0, 120.0),
}


def measured_rows(results: list) -> list:
    """[(H, lengths, {split: graph ms})] from bench JSON results (split 1 = serial)."""
    rows = []
    for res in results:
        for section in ("cp_sweep", "cp_long"):
            for r in res.get(section, []):
                times = {1: r.get("serial_graph_ms")}
                times.update({s: r.get(f"cp_{s}_graph_ms") for s in cp_plan.SPLITS[1:]})
                rows.append((r["H"], r["lengths"], {s: t for s, t in times.items() if t}))
        for r in res.get("gates", []):
            # Serial there may be the fused kernel: only the forced splits are the planner's data.
            times = {s: r.get(f"cp_{s}_graph_ms") for s in cp_plan.SPLITS[1:]}
            times = {s: t for s, t in times.items() if t}
            if times and r.get("lengths"):
                rows.append((r["H"], r["lengths"], times))
    return [row for row in rows if len(row[2]) >= 2]


@contextlib.contextmanager
def constants(**values):
    """``cp_plan``'s module constants set to ``values`` for the block."""
    old = {name: getattr(cp_plan, name) for name in values}
    for name, value in values.items():
        setattr(cp_plan, name, value)
    try:
        yield
    finally:
        for name, value in old.items():
            setattr(cp_plan, name, value)


def picks(rows) -> list:
    """[(H, lengths, pick, fastest split, pick time ÷ fastest)] under the current constants."""
    out = []
    for heads, lengths, times in rows:
        pick = cp_plan.auto_split(lengths, heads, SM_COUNT, V_BLOCKS)
        timed = pick if pick in times else min(times, key=lambda s: (abs(math.log2(s) - math.log2(pick)), s))
        fastest = min(times, key=times.get)
        out.append((heads, lengths, pick, fastest, times[timed] / times[fastest]))
    return out


def score(rows) -> tuple:
    """(worst pick ÷ fastest, summed log of pick ÷ fastest, rms of log(time / (unit · cost))."""
    losses = [ratio for *_, ratio in picks(rows)]
    logs = [
        math.log(t / cp_plan.cost(lengths, heads, SM_COUNT, s, V_BLOCKS))
        for heads, lengths, times in rows
        for s, t in times.items()
    ]
    mean = sum(logs) / len(logs)
    return (max(losses), sum(math.log(x) for x in losses), math.sqrt(sum((x - mean) ** 2 for x in logs) / len(logs)))


def search(rows) -> list:
    """[(worst, summed log loss, rms, constants)] over ``GRID``, best first."""
    found = []
    for combo in itertools.product(*GRID.values()):
        values = dict(zip(GRID, combo))
        with constants(**values):
            found.append((*score(rows), values))
    return sorted(found, key=lambda f: (round(f[0], 3), round(f[1], 4), f[2]))


def _label(lengths) -> str:
    return str(lengths) if len(lengths) <= 2 else f"{len(lengths)} seqs, {sum(lengths)} tokens"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", nargs="+", help="bench_prefill --json outputs")
    parser.add_argument("--top", type=int, default=8, help="candidates to list")
    args = parser.parse_args(argv)
    rows = measured_rows([json.loads(Path(path).read_text()) for path in args.json])
    current = {name: getattr(cp_plan, name) for name in GRID}
    worst, loss, rms = score(rows)
    print(f"{len(rows)} rows; current {current}: worst {worst:.3f}, log loss {loss:.4f}, rms {rms:.3f}")
    for heads, lengths, pick, fastest, ratio in picks(rows):
        print(f"  H{heads} {_label(lengths)}: pick {pick}, fastest {fastest}, pick / fastest {ratio:.3f}")
    for worst, loss, rms, values in search(rows)[: args.top]:
        print(f"candidate {values}: worst {worst:.3f}, log loss {loss:.4f}, rms {rms:.3f}")


if __name__ == "__main__":
    main()
