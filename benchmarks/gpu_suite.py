"""The GPU suite as concurrent pytest processes sharing one GPU: the same tests in a fraction of
the wall time of one process, for device calls that are short and scarce.

    python -m benchmarks.gpu_suite [--shards 4] [--out DIR] [--timeout S] [PATH ...]

Collects the ``gpu``-marked tests under PATH (default ``tests``), cuts their node ids, in
collection order, into contiguous shards of nearly equal counts (so a module's fixtures are
built by one or two shards, not all), and runs one pytest process per shard at once (each its
own CUDA context; logs ``DIR/shard_<i>.log``).  Most tests wait on the host (float64 references,
compiles, launches), so the shards overlap well on one card.

A test that fails or errors in a shard is run again alone afterwards (``DIR/rerun.log``): a
failure that passes alone is printed as such, since only a test that shares no state between
processes can pass that way, and the exit status counts the rerun (0 when every test passed,
in its shard or alone).  Tests are never timed here, so sharing the GPU changes no result.
"""

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

PYTEST = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]
OUTCOME = re.compile(r"^(FAILED|ERROR|PASSED) (.+)$", re.MULTILINE)
SUMMARY = re.compile(r"^=*\s*((?:\d+ \w|no tests).*?) in [\d.]+s", re.MULTILINE)


def shards(node_ids: list, count: int) -> list:
    """``node_ids`` cut into at most ``count`` contiguous, non-empty runs whose sizes differ by ≤ 1."""
    count = max(1, min(count, len(node_ids)))
    size, extra = divmod(len(node_ids), count)
    out, start = [], 0
    for i in range(count):
        end = start + size + (1 if i < extra else 0)
        out.append(node_ids[start:end])
        start = end
    return [s for s in out if s]


def listed_ids(log: str, known: list, outcomes=("FAILED", "ERROR")) -> list:
    """The node ids pytest's short summary lists with one of ``outcomes``, in order, once each.
    An id may hold spaces (a parameter's id), so a line names the longest of ``known`` it starts
    with, followed by the end of the line or " - " and a message; else its first word."""
    found = []
    for m in OUTCOME.finditer(log):
        if m.group(1) not in outcomes:
            continue
        rest = m.group(2)
        named = [k for k in known if rest == k or rest.startswith(k + " - ")]
        found.append(max(named, key=len) if named else rest.split()[0])
    return list(dict.fromkeys(found))


def summary_line(log: str) -> str:
    found = SUMMARY.findall(log)
    return found[-1] if found else "no summary (killed or crashed?)"


def node_root(paths: list) -> str:
    """Where the node ids of ``paths`` are rooted: the working directory (the repository root,
    whose pyproject.toml is pytest's rootdir) when every path lies under it, else their common
    folder (pytest's rootdir without a configuration file)."""
    here = os.getcwd()
    absolute = [os.path.abspath(path) for path in paths]
    if all(os.path.commonpath([here, path]) == here for path in absolute):
        return here
    common = os.path.commonpath(absolute)
    return common if os.path.isdir(common) else os.path.dirname(common)


def collect(paths: list, root: str) -> list:
    done = subprocess.run(
        [*PYTEST, "-q", "-m", "gpu", "--collect-only", *paths], capture_output=True, text=True, check=False, cwd=root
    )
    ids = [line for line in done.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if not ids:
        sys.exit(f"gpu_suite: no gpu tests collected under {paths}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return ids


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="*", default=["tests"])
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu_suite"), help="log folder")
    p.add_argument("--timeout", type=float, default=None, help="seconds before unfinished shards are killed")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    root = node_root(args.paths)
    ids = collect([os.path.abspath(path) for path in args.paths], root)
    parts = shards(ids, args.shards)
    print(f"gpu_suite: {len(ids)} tests in {len(parts)} shards ({time.time() - start:.0f} s to collect)", flush=True)
    runs = []
    for i, part in enumerate(parts):
        log = (out / f"shard_{i}.log").open("w")
        proc = subprocess.Popen([*PYTEST, "-q", "-rfEs", *part], stdout=log, stderr=subprocess.STDOUT, cwd=root)
        runs.append((proc, log))
    deadline = None if args.timeout is None else start + args.timeout
    for proc, log in runs:
        try:
            proc.wait(timeout=None if deadline is None else max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    failures = []
    for i in range(len(parts)):
        log = (out / f"shard_{i}.log").read_text()
        print(f"shard {i} ({len(parts[i])} tests): {summary_line(log)}", flush=True)
        failures += listed_ids(log, parts[i])
    complete = all(proc.returncode in (0, 1) for proc, _ in runs)
    if not complete:
        print("gpu_suite: a shard was killed or crashed; its unrun tests are not retried", flush=True)
    if not failures:
        print(f"gpu_suite: done in {time.time() - start:.0f} s", flush=True)
        return 0 if complete else 1
    print(f"gpu_suite: {len(failures)} failed in a shard; running them alone", flush=True)
    rerun = subprocess.run([*PYTEST, "-q", "-rA", *failures], capture_output=True, text=True, check=False, cwd=root)
    (out / "rerun.log").write_text(rerun.stdout + rerun.stderr)
    # Only a test pytest reports as passed passed alone: one it could not find or run did not.
    passed = set(listed_ids(rerun.stdout, failures, ("PASSED",)))
    for node in failures:
        print(f"  {'passed alone (failed beside other shards)' if node in passed else 'FAILED alone'}: {node}")
    print(f"rerun: {summary_line(rerun.stdout)}; done in {time.time() - start:.0f} s", flush=True)
    return 0 if complete and rerun.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
