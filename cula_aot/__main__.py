"""``python -m cula_aot {info,verify,bench}``: what is installed, is it intact, how fast is it."""

import argparse
import hashlib
import os
import subprocess
import sys
from pathlib import Path

from ._version import __version__
from .runtime.manifest import ArtifactError, Manifest


def _info(manifest: Manifest) -> int:
    data = manifest.data
    sizes = sum(r["size"] for r in manifest.kernels.values())
    print(f"cula-aot {__version__}")
    print(f"manifest      {manifest.path}")
    print(f"arch          {data['arch']}")
    print(
        f"CuTeDSL       {data['cutedsl_version']} ({', '.join(f'{k} {v}' for k, v in data['distributions'].items())})"
    )
    print(f"ptxas         {data.get('ptxas_version')}")
    gates = sorted({r["args"]["gate"] for r in manifest.kernels.values() if "gate" in r.get("args", {})})
    print(f"gates         {', '.join(gates)}")
    print("heads         every kernel runs any H >= 1 (H is a launch value, not a build argument)")
    print(f"kernels       {len(manifest.kernels)} cubins, {sizes / 1e6:.1f} MB")
    by_kernel: dict[str, list] = {}
    for name, rec in manifest.kernels.items():
        by_kernel.setdefault(rec["kernel"], []).append(rec)
    for kernel, recs in sorted(by_kernel.items()):
        smem = sorted({r["dynamic_smem_bytes"] for r in recs})
        print(f"  {kernel:14s} {len(recs):3d} specializations, dynamic smem {smem} B")
    return 0


def _verify(manifest: Manifest) -> int:
    bad = 0
    for name, rec in sorted(manifest.kernels.items()):
        path = manifest.root / rec["cubin"]
        try:
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError as exc:
            print(f"MISSING  {name}: {exc}")
            bad += 1
            continue
        if digest != rec["sha256"]:
            print(f"MISMATCH {name}: {path} sha256 {digest[:16]}…, manifest {rec['sha256'][:16]}…")
            bad += 1
    total = len(manifest.kernels)
    print(f"{total - bad}/{total} artifacts verified against {manifest.path}")
    if bad:
        print("fix: rebuild with `python build_kernels.py` or reinstall the wheel")
    return 1 if bad else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cula_aot", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="package, toolchain, arch, gates, kernels and sizes")
    sub.add_parser("verify", help="sha256 of every artifact; exit 1 on any mismatch")
    bench = sub.add_parser("bench", help="run the prefill benchmark (needs an sm_90a GPU)")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="passed to python -m benchmarks.bench_prefill")
    args = parser.parse_args(argv)
    if args.command == "bench":
        root = Path(__file__).resolve().parent.parent
        if not (root / "benchmarks" / "bench_prefill.py").is_file():
            print("the benchmark ships with the source tree: run it from a checkout", file=sys.stderr)
            return 2
        # The checkout's benchmarks package, from wherever this is run.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p))
        return subprocess.run([sys.executable, "-m", "benchmarks.bench_prefill", *args.args], env=env).returncode
    try:
        manifest = Manifest.discover()
    except ArtifactError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return _info(manifest) if args.command == "info" else _verify(manifest)


if __name__ == "__main__":
    sys.exit(main())
