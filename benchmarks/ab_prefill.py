#!/usr/bin/env python3
"""A/B the prefill benchmark between source trees (or artifact sets) in one device call.

    python3 -m benchmarks.ab_prefill --arm main=../ab_main --arm new=. [--arm NAME=TREE[@ARTIFACTS] ...]
        [--rounds 2] [--out DIR] -- --only spec,serving,cp --no-fla --quick

Each round runs ``python -m benchmarks.bench_prefill`` once per arm, in arm order (A, B, A, B, …:
lent machines differ by up to ~8%, so only alternated runs in one call compare), with the
arm's tree as working directory (so the tree's own ``benchmarks`` and ``cula_aot`` are imported)
and ``CULA_AOT_ARTIFACTS=ARTIFACTS`` when given (a throw-away
``build_kernels.py --out DIR``).  JSON lands in ``DIR/<arm>.json`` (``{"rounds": [result, …]}``:
one file per arm, as a lent device returns a limited number of files); the summary table
(stdout and ``DIR/summary.md``) lists every graph timing the first arm has, per workload, as
the mean over rounds of each arm and its ratio to the first arm (< 1: faster).
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

# Section → how a row is labelled (the fields that identify a workload).
_ROW_KEYS = {
    "spec": ("workload", "H"),
    "serving": ("workload", "H"),
    "gates": ("workload", "H", "gate"),
    "checkpoints": ("source", "workload", "H"),
    "cp": ("H", "lengths"),
    "cp_long": ("H", "lengths"),
    "cp_sweep": ("H", "lengths"),
    "fixed": ("B", "T"),
    "varlen": ("N", "T", "dist"),
}


def parse_arm(text: str):
    """``NAME=TREE[@ARTIFACTS]`` → (name, tree, artifacts or None)."""
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise argparse.ArgumentTypeError(f"--arm wants NAME=TREE[@ARTIFACTS], got {text!r}")
    tree, _, artifacts = rest.partition("@")
    return name, tree, artifacts or None


def graph_timings(result: dict) -> dict:
    """{(section, row label, key): ms} for every ``*graph_ms`` value of a bench_prefill result."""
    out = {}
    for section, keys in _ROW_KEYS.items():
        for row in result.get(section, []):
            label = " ".join(f"{k}={row.get(k)}" for k in keys)
            for key, value in row.items():
                if key.endswith("graph_ms") and isinstance(value, (int, float)):
                    out[(section, label, key)] = float(value)
    return out


def summarize(runs: dict) -> str:
    """Markdown table from {arm: [result, …]} (arms in order; the first is the reference)."""
    arms = list(runs)
    means = {}
    for arm, results in runs.items():
        per_key: dict = {}
        for result in results:
            for key, value in graph_timings(result).items():
                per_key.setdefault(key, []).append(value)
        means[arm] = {key: sum(v) / len(v) for key, v in per_key.items()}
    header = ["section", "workload", "timing"] + [f"{a} ms" for a in arms] + [f"{a} ÷ {arms[0]}" for a in arms[1:]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for key in means[arms[0]]:
        cells = [key[0], key[1], key[2]]
        cells += [f"{means[a][key]:.4f}" if key in means[a] else "–" for a in arms]
        cells += [f"{means[a][key] / means[arms[0]][key]:.3f}" if key in means[a] else "–" for a in arms[1:]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    bench_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arm", type=parse_arm, action="append", required=True, help="NAME=TREE[@ARTIFACTS]")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=os.environ.get("OUT", "ab_out"))
    parser.add_argument("--timeout-s", type=float, default=300, help="per benchmark run")
    args = parser.parse_args(own)
    if len({name for name, _, _ in args.arm}) != len(args.arm):
        parser.error("arm names must differ")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = {name: [] for name, _, _ in args.arm}
    for round_ in range(1, args.rounds + 1):
        for name, tree, artifacts in args.arm:
            path = (out / f"{name}_{round_}.json").resolve()
            env = dict(os.environ)
            if artifacts:
                env["CULA_AOT_ARTIFACTS"] = str(Path(artifacts).resolve())
            command = [sys.executable, "-m", "benchmarks.bench_prefill", *bench_args, "--json", str(path)]
            done = subprocess.run(
                command,
                cwd=tree,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                timeout=args.timeout_s,
                check=False,
            )
            print(f"round {round_} {name}: rc={done.returncode}", flush=True)
            if done.returncode != 0:
                print(done.stderr[-2000:], file=sys.stderr)
            if path.exists():
                runs[name].append(json.loads(path.read_text()))
                path.unlink()
    # One file per arm (a lent device returns a limited number of files from a call).
    for name, results in runs.items():
        (out / f"{name}.json").write_text(json.dumps({"rounds": results}))
    table = summarize(runs)
    (out / "summary.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
