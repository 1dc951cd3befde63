"""Ahead-of-time build: every specialization → sm_90a cubin + ``manifest.json``, on a CPU machine.

Each specialization compiles in a worker process (CuTeDSL tracing is single-threaded), results
are verified (ABI vs PTX ``.entry``), cubins are written atomically, and the manifest is written
last, so a failed build never leaves a manifest pointing at stale or missing cubins.
Incremental: a specialization whose build key (kernel sources + toolchain + spec) and cubin
sha256 match the existing manifest is not recompiled.
"""

import concurrent.futures as futures
import hashlib
import importlib.metadata
import json
import multiprocessing
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from .._version import __version__
from ..runtime.manifest import MANIFEST_NAME, SCHEMA_VERSION
from ..specs import ARCH, CUTEDSL_VERSION, KernelSpec, default_specs
from .cubin import place_params
from .ptx import check_abi, parse_entry, ptx_toolchain

PACKAGE_DIR = Path(__file__).resolve().parent.parent
# Everything that determines the generated code besides the toolchain.
SOURCE_FILES = sorted(
    [
        *(PACKAGE_DIR / "kernels").glob("*.py"),
        *(PACKAGE_DIR / "specs").glob("*.py"),
        PACKAGE_DIR / "layout.py",
        PACKAGE_DIR / "gates.py",
    ]
)


class BuildError(RuntimeError):
    """A specialization failed to compile or verify."""


def source_sha256() -> str:
    digest = hashlib.sha256()
    for path in SOURCE_FILES:
        digest.update(path.relative_to(PACKAGE_DIR).as_posix().encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def toolchain() -> dict:
    """Versions that key the manifest: every nvidia-cutlass-dsl* distribution and the ptxas
    linked into the CuTeDSL compiler library (whose sha256 pins the whole compiler)."""
    dists = {
        d.metadata["Name"]: d.version
        for d in importlib.metadata.distributions()
        if (d.metadata["Name"] or "").lower().startswith("nvidia-cutlass-dsl")
    }
    if "nvidia-cutlass-dsl" not in dists:
        raise BuildError("nvidia-cutlass-dsl is not installed: pip install -e '.[build]'")
    if dists["nvidia-cutlass-dsl"] != CUTEDSL_VERSION:
        raise BuildError(
            f"nvidia-cutlass-dsl {dists['nvidia-cutlass-dsl']} is installed, but the kernels are keyed on "
            f"{CUTEDSL_VERSION}: pip install -e '.[build]'"
        )
    from cutlass._mlir import _mlir_libs

    libs = Path(_mlir_libs.__file__).parent
    dso = sorted(libs.glob("_cutlass_ir*.so"))
    if not dso:
        raise BuildError(f"CuTeDSL compiler library not found in {libs}")
    blob = dso[0].read_bytes()
    # libnvptxcompiler is linked statically; its banner follows the "FNLZR" finaliser strings.
    finaliser = blob.find(b"FNLZR")
    match = re.compile(rb"Cuda compilation tools, release [\d.]+, V([\d.]+)").search(blob, max(finaliser, 0))
    return {
        "cutedsl_version": dists["nvidia-cutlass-dsl"],
        "distributions": dict(sorted(dists.items())),
        "ptxas_version": match.group(1).decode() if match else None,
        "compiler_library": dso[0].name,
        "compiler_library_sha256": _sha256(blob),
    }


def _build_key(spec: KernelSpec, sources: str, tools: dict) -> str:
    material = json.dumps({"spec": spec.name, "arch": ARCH, "sources": sources, "tools": tools}, sort_keys=True)
    return _sha256(material.encode())


def _compile_worker(spec: KernelSpec) -> tuple[str, bytes, float]:
    """Compile one specialization in this (worker) process; returns (ptx, cubin, seconds)."""
    from ..kernels import compile_spec

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"cula_aot_{spec.name}_") as dump:
        ptx_path, cubin_path = compile_spec(spec, ARCH, dump)
        ptx, cubin = Path(ptx_path).read_text(), Path(cubin_path).read_bytes()
    return ptx, cubin, time.perf_counter() - start


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _load_previous(manifest_path: Path) -> dict:
    try:
        previous = json.loads(manifest_path.read_text())
    except (OSError, ValueError):
        return {}
    return previous.get("kernels", {}) if previous.get("schema_version") == SCHEMA_VERSION else {}


def _reusable(record: dict, out_dir: Path, key: str) -> bool:
    if not record or record.get("build_key") != key:
        return False
    cubin = out_dir / record["cubin"]
    return cubin.is_file() and _sha256(cubin.read_bytes()) == record["sha256"]


def _kernel_record(spec: KernelSpec, ptx: str, cubin: bytes, rel_path: str, key: str) -> dict:
    from ..kernels import dynamic_smem_bytes

    entry = parse_entry(ptx)
    abi, param_bytes = place_params(spec.name, cubin, entry["symbol"], check_abi(spec, entry), spec.block)
    return {
        "kernel": spec.kernel,
        "args": spec.args,
        "cubin": rel_path,
        "sha256": _sha256(cubin),
        "size": len(cubin),
        "entry": entry["symbol"],
        "block": list(spec.block),
        "cluster": list(spec.cluster),
        "dependent_launch": spec.dependent_launch,
        "dynamic_smem_bytes": dynamic_smem_bytes(spec),
        "grid": list(spec.grid),
        "params": abi,
        "param_bytes": param_bytes,
        "ptx_toolchain": ptx_toolchain(ptx),
        "build_key": key,
    }


def build(out_dir, jobs=None, force=False, log=print) -> dict:
    """Build every specialization into ``out_dir``; returns the manifest dict."""
    out_dir = Path(out_dir).resolve()
    manifest_path = out_dir / MANIFEST_NAME
    sources = source_sha256()
    tools = toolchain()
    arch_dir = Path("artifacts") / tools["cutedsl_version"] / ARCH
    specs = default_specs()
    previous = {} if force else _load_previous(manifest_path)

    records, todo = {}, []
    for spec in specs:
        key = _build_key(spec, sources, tools)
        if _reusable(previous.get(spec.name), out_dir, key):
            records[spec.name] = previous[spec.name]
        else:
            todo.append((spec, key))
    log(f"cula-aot build: {len(specs)} specializations for {ARCH}, {len(records)} up to date, {len(todo)} to compile")

    failures = []
    start = time.perf_counter()
    if todo:
        jobs = max(1, min(jobs or os.cpu_count() or 1, len(todo)))
        context = multiprocessing.get_context("spawn")
        with futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
            pending = {pool.submit(_compile_worker, spec): (spec, key) for spec, key in todo}
            for done, fut in enumerate(futures.as_completed(pending), 1):
                spec, key = pending[fut]
                try:
                    ptx, cubin, seconds = fut.result()
                    rel = (arch_dir / f"{spec.name}.cubin").as_posix()
                    record = _kernel_record(spec, ptx, cubin, rel, key)
                    _write_atomic(out_dir / rel, cubin)
                    records[spec.name] = record
                    log(f"  [{done}/{len(todo)}] {spec.name}: {len(cubin)} B in {seconds:.1f} s")
                except Exception as exc:  # noqa: BLE001 - every failure is reported with its spec
                    failures.append(spec.name)
                    log(f"  [{done}/{len(todo)}] {spec.name}: FAILED: {type(exc).__name__}: {exc}")
    if failures:
        raise BuildError(f"{len(failures)} specialization(s) failed to build: {', '.join(sorted(failures))}")

    manifest = {
        "schema_version": SCHEMA_VERSION,
        "package_version": __version__,
        "arch": ARCH,
        **tools,
        "source_sha256": sources,
        "kernels": {spec.name: records[spec.name] for spec in specs},
    }
    _write_atomic(manifest_path, (json.dumps(manifest, indent=1) + "\n").encode())
    log(f"cula-aot build: wrote {manifest_path} ({time.perf_counter() - start:.1f} s compiling)")
    return manifest


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Compile cula-aot kernels to sm_90a cubins (no GPU needed).")
    parser.add_argument("--out", default=str(PACKAGE_DIR.parent), help="directory for manifest.json and artifacts/")
    parser.add_argument("--jobs", type=int, default=None, help="parallel compile workers (default: all cores)")
    parser.add_argument("--force", action="store_true", help="recompile even when up to date")
    args = parser.parse_args(argv)
    try:
        build(args.out, jobs=args.jobs, force=args.force)
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
