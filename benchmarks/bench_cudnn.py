#!/usr/bin/env python3
"""cula_aot against NVIDIA's cuDNN frontend Hopper KDA prefill, both in one process on one GPU.

    python -m benchmarks.bench_cudnn --cudnn-path DIR [--rows a,b] [--regimes standard,mixed,slow]
                                     [--budget-s S] [--json PATH] [--markdown PATH] [--quick] [--dry-run]
    python -m benchmarks.bench_cudnn --render PATH.json      # markdown again from a results file

The peer is ``cudnn.linear_attention.kimi_delta_attention`` of the ``nvidia-cudnn-frontend`` wheel
(1.32.0), pinned to its ``kda_hopper_cuda`` engine (``--cudnn-plan``; "auto" lets cuDNN route): one
fused CUDA kernel that NVRTC compiles on first use and that is launched through the driver API
behind cuDNN's Python graph layer.  The frontend is optional: its directory (a ``pip install
--no-deps --target DIR`` of the wheel) comes from ``--cudnn-path`` or ``$CULA_CUDNN_PATH`` and is put
first on ``sys.path``; without it only our side runs and every cuDNN cell says why.

Semantics, the same on both sides: q, k, v bf16, g bf16 raw gate logits with the safe gate
γ = lower_bound·σ(e^A_log·(g + dt_bias)) per key channel (A_log fp32 [H], dt_bias fp32 [H, 128]),
β bf16 logits (σ in the kernel), q/k L2-normalised in the kernel, scale 128^-0.5, fp32 initial and
final states laid out [N, H, V, K], varlen through cu_seqlens.  cuDNN takes token-packed
[T, H, 128] tensors (our [1, T, H, 128] without its batch axis) and always a cu_seqlens.  Its kernel
reads g and β as fp32: given bf16 it converts them inside the call (two elementwise kernels, part
of its time here); "cuDNN fp32 gate" hands it g and β already in fp32, the kernel alone.

Decay regimes (all with the safe gate, ``draw_inputs``): *standard* (CONTRACT §8: A_log = log U(1,16),
dt_bias ~ 0.1·N(0,1), lower_bound -5); *mixed* (standard, but 4 of the 128 key channels of every
head get dt_bias = -12: long-memory channels beside fast ones, |γ| < 1e-4 per token there);
*slow* (A_log = -4, lower_bound -0.05).  They matter for cuDNN's kernel in particular: it cuts each
sequence into pieces to fill the GPU (about 264 CTAs) and runs each piece from a zero state started
as many chunks before it as its gates need to bound the dropped state below 2^-20 on every key
channel; one slow channel makes that warm-up reach back to the sequence start (exact, but each
piece then recomputes the whole prefix).

Before anything is timed both implementations are checked against the float64 reference
(``cula_aot.reference.kda_chunked``) on small rows of every regime (relative RMSE of o and of the
final state, bound 1e-2 as CONTRACT §8); a cuDNN state that only matches when read as [K, V] is
called out as a layout mismatch.  A regime where cuDNN fails the check still gets timed, but every
row of it is marked.  Every timed row also compares cuDNN's o and state with ours.

Times: CUDA events, 25 warm-up / 100 timed, interquartile mean (``benchmarks/timing.py``); graph =
replay of one captured call, eager = the Python call (host work included).  Ours is
``cula_aot.kda_prefill(..., intracard_cp="auto")`` (cu_seqlens_cpu given, so CP can plan).  Ratios
are cuDNN ÷ ours (> 1: ours faster).  JSON and markdown are rewritten after every row, so a run cut
short (``--budget-s``) keeps what it measured.

cuDNN compiles its kernel once per combination of input fusions (one combination here: L2 norm,
safe gate and β sigmoid), not per shape; its cubin is cached on disk
(``$CUDNN_FRONTEND_CAKE_CACHE_DIR``, else ``~/.cache/cudnn_frontend/cake``).  Each new shape (and
each lower_bound) builds a new cuDNN graph in Python on its first call; ``cudnn_first_call_s``
holds that cost per row.  NVRTC needs the CUDA headers (cuda_bf16.h, mma.h with crt/, CCCL's
nv/target): ``find_cuda_headers`` picks a complete tree and exports it as ``CUDA_HOME``.

On a machine without network, from wheels (the frontend with ``--no-deps``: its declared
nvidia-cutlass-dsl and apache-tvm-ffi are not used by this engine; the nvidia-cuda-runtime,
-cccl and -crt 13.0 wheels are only a header fallback, kept off ``sys.path``)::

    pip install --no-deps --target /tmp/cudnn nvidia_cudnn_frontend-1.32.0-cp312-*.whl
    pip install --no-deps --target /tmp/cuda_hdr nvidia_cuda_{runtime,cccl,crt}-13.0.*.whl
    python3 -m benchmarks.bench_cudnn --cudnn-path /tmp/cudnn --cuda-headers /tmp/cuda_hdr/nvidia/cu13 \
        --budget-s 200 --json OUT/prefill_vs_cudnn.json
"""

import argparse
import datetime
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.bench_prefill import lengths_label, rel_rmse
from benchmarks.timing import capture_graph, time_cuda
from cula_aot import reference
from cula_aot.testing import HEAD_DIM, cu_seqlens_of, standard_inputs

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_JSON = ROOT / "docs" / "bench" / "prefill_vs_cudnn.json"
PATH_ENV = "CULA_CUDNN_PATH"
DEFAULT_PLAN = "kda_hopper_cuda"

SCALE = HEAD_DIM**-0.5
REGIMES = ("standard", "mixed", "slow")
MIXED_CHANNELS = 4  # long-memory key channels per head in the mixed regime
MIXED_DT_BIAS = -12.0
CHECK_BOUND = 1e-2  # CONTRACT §8: rel-RMSE of o and of the final state against float64
AGREE_BOUND = 2e-2  # cuDNN against ours on a timed row (two bounded errors)

VARLEN6 = [1300, 547, 2048, 963, 271, 3063]  # CONTRACT §7's varlen row
SHORT6 = [3000, 1500, 700, 200, 64, 17]
# name: (heads, sequence lengths); a single length is a fixed-shape call on our side.
ROWS = {
    "h4-1x1024": (4, [1024]),
    "h12-1x2048": (12, [2048]),
    "h12-1x4096": (12, [4096]),
    "h12-4x2048": (12, [2048] * 4),
    "h16-1x8192": (16, [8192]),
    "h24-1x8192": (24, [8192]),
    "h16-8x2048": (16, [2048] * 8),
    "h64-1x8192": (64, [8192]),
    "h64-varlen6": (64, VARLEN6),
    "h64-8x1024": (64, [1024] * 8),
    "h96-1x8192": (96, [8192]),
    "h8-1x16384": (8, [16384]),
    "h12-short6": (12, SHORT6),
    "h6-short6": (6, SHORT6),
    "h3-1x32768": (3, [32768]),
}
# Reference checks per regime: a varlen batch with partial tiles, and one long sequence that cuDNN
# cuts into many pieces (its kernel splits a sequence to fill the GPU).
CHECK_ROWS = [(4, [2048, 1000, 300, 64, 17]), (2, [8192])]


# -- inputs ------------------------------------------------------------------------------------
def long_memory_channels(heads, seed) -> torch.Tensor:
    """int64 ``[heads, MIXED_CHANNELS]``: the mixed regime's long-memory key channels of each head
    (distinct within a head), drawn on the host from ``seed``."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.stack([torch.randperm(HEAD_DIM, generator=gen)[:MIXED_CHANNELS] for _ in range(heads)])


def draw_inputs(heads, lengths, regime, device, seed=0) -> dict:
    """One row's inputs in a decay regime: ``standard_inputs`` (B = 1, T = sum(lengths), one initial
    state ~ 0.1·N(0,1) per sequence) with ``lengths``, ``cu`` (int32, on ``device``), ``cu_cpu`` and
    ``regime`` added.  One seed gives the same q, k, v, g and β in every regime, and the mixed
    regime the standard one's tensors except for its long-memory channels' dt_bias."""
    if regime not in REGIMES:
        raise ValueError(f"regime must be one of {REGIMES}, got {regime!r}")
    x = standard_inputs(
        1, sum(lengths), heads, device=device, seed=seed, slow_decay=regime == "slow", n_states=len(lengths)
    )
    if regime == "mixed":
        channels = long_memory_channels(heads, seed).to(x["dt_bias"].device)
        x["dt_bias"] = x["dt_bias"].scatter(1, channels, MIXED_DT_BIAS)
    x["lengths"] = list(lengths)
    x["cu_cpu"] = cu_seqlens_of(lengths)
    x["cu"] = x["cu_cpu"].to(device)
    x["regime"] = regime
    return x


# -- the two implementations -------------------------------------------------------------------
def ours_runner(x, intracard_cp="auto", fused=None):
    """A no-argument call of ``cula_aot.kda_prefill`` on ``x`` returning ``(o [1, T, H, V], final
    [N, H, V, K])``; fresh outputs per call, as a caller gets them.  ``intracard_cp``: "auto", or
    "truncated" (``--truncated``: the certified-truncation pieces); ``fused`` False: the path
    override that keeps "truncated" off the fused kernel (the walking path)."""
    import cula_aot
    from cula_aot.ops.prefill import prefill

    single = len(x["lengths"]) == 1
    entry, override = (cula_aot.kda_prefill, {}) if fused is None else (prefill, {"fused": fused})

    def run():
        return entry(
            x["q"],
            x["k"],
            x["v"],
            x["g"],
            x["beta"],
            A_log=x["A_log"],
            dt_bias=x["dt_bias"],
            lower_bound=x["lower_bound"],
            gate="safe",
            scale=SCALE,
            initial_state=x["initial_state"],
            output_final_state=True,
            cu_seqlens=None if single else x["cu"],
            cu_seqlens_cpu=None if single else x["cu_cpu"],
            intracard_cp=intracard_cp,
            **override,
        )

    return run


def cudnn_runner(x, plan_name, fp32_gate=False):
    """A no-argument call of cuDNN's ``kimi_delta_attention`` on ``x`` (THD views of the same
    tensors) returning ``(o [1, T, H, V], final [N, H, V, K])``.  ``fp32_gate``: g and β are
    handed over as fp32 copies made here, outside the call."""
    from cudnn.linear_attention import kimi_delta_attention

    q, k, v, g, beta = (x[name][0] for name in ("q", "k", "v", "g", "beta"))
    if fp32_gate:
        g, beta = g.float(), beta.float()

    def run():
        o, final = kimi_delta_attention(
            q,
            k,
            v,
            g,
            beta,
            x["cu"],
            scale=SCALE,
            initial_state=x["initial_state"],
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
            safe_gate=True,
            gate_lower_bound=x["lower_bound"],
            a_log=x["A_log"],
            dt_bias=x["dt_bias"],
            plan_name=plan_name,
        )
        return o.unsqueeze(0), final

    return run


def cudnn_direct_runner(x):
    """cuDNN's fused sm90 kernel launched straight through its host module
    (``cudnn.linear_attention.hopper.cuda_host.launch``), skipping the graph layer: the fallback
    when the public op fails.  g and β as fp32 copies, outputs preallocated."""
    from cudnn.linear_attention.hopper import cuda_host

    q, k, v = (x[name][0] for name in ("q", "k", "v"))
    g, beta = x["g"][0].float().contiguous(), x["beta"][0].float().contiguous()
    total, heads = q.shape[0], q.shape[1]
    o = torch.empty_like(v)
    final = torch.empty_like(x["initial_state"])
    flags = cuda_host.FLAG_L2NORM | cuda_host.FLAG_SAFE_GATE | cuda_host.FLAG_BETA_SIGMOID

    def run():
        cuda_host.launch(
            device=q.device.index or 0,
            stream=torch.cuda.current_stream(q.device).cuda_stream,
            q=q.data_ptr(),
            k=k.data_ptr(),
            v=v.data_ptr(),
            g=g.data_ptr(),
            beta=beta.data_ptr(),
            cu_seqlens=x["cu"].data_ptr(),
            initial_state=x["initial_state"].data_ptr(),
            o=o.data_ptr(),
            final_state=final.data_ptr(),
            total_tokens=total,
            n_seqs=len(x["lengths"]),
            n_heads=heads,
            a_log=x["A_log"].data_ptr(),
            dt_bias=x["dt_bias"].data_ptr(),
            gate_lower_bound=float(x["lower_bound"]),
            flags=flags,
            q_scale=SCALE,
            n_qk_heads=heads,
        )
        return o.unsqueeze(0), final

    return run


def reference_outputs(x):
    """float64 ``(o [1, T, H, V], final [N, H, V, K])`` of CONTRACT §2 on ``x``."""
    ref_o, ref_s = reference.kda_chunked(
        x["q"],
        x["k"],
        x["v"],
        x["g"],
        x["beta"],
        A_log=x["A_log"],
        dt_bias=x["dt_bias"],
        lower_bound=x["lower_bound"],
        scale=SCALE,
        initial_state=x["initial_state"].transpose(-1, -2),
        cu_seqlens=x["cu"],
    )
    return ref_o, ref_s.transpose(-1, -2)


# -- environment -------------------------------------------------------------------------------
def _header_tree_report(root: Path) -> list:
    """What a CUDA tree at ``root`` lacks for NVRTC to compile cuDNN's kernel (empty: complete)."""
    inc = root / "include"
    need = {
        "cuda_bf16.h": inc / "cuda_bf16.h",
        "mma.h": inc / "mma.h",
        "crt/mma.h": inc / "crt" / "mma.h",
    }
    missing = [name for name, path in need.items() if not path.is_file()]
    if not ((inc / "cccl" / "nv" / "target").is_file() or (inc / "nv" / "target").is_file()):
        missing.append("nv/target (CCCL)")
    return missing


def _tree_cuda_version(root: Path):
    """``CUDA_VERSION`` of the tree at ``root`` (13000 for 13.0) from include/cuda.h, or None."""
    try:
        text = (root / "include" / "cuda.h").read_text(errors="replace")
    except OSError:
        return None
    match = re.search(r"#define\s+CUDA_VERSION\s+(\d+)", text)
    return int(match.group(1)) if match else None


def find_cuda_headers(extra=(), nvrtc_major=None) -> dict:
    """Pick a CUDA header tree NVRTC can compile cuDNN's kernel with and export it as ``CUDA_HOME``
    (cuDNN's compiler reads ``CUDA_HOME`` first, then pip ``nvidia/cu13`` trees, which may lack
    crt/, then /usr/local/cuda).  Candidates, in order: ``$CUDA_HOME``, ``$CUDA_PATH``,
    /usr/local/cuda, ``extra`` (``--cuda-headers``), every ``sys.path`` entry's nvidia/cu13; the
    first complete one whose CUDA major version is NVRTC's wins, else the first complete one."""
    candidates = [os.environ.get(var) for var in ("CUDA_HOME", "CUDA_PATH")]
    candidates += ["/usr/local/cuda", *extra]
    candidates += [str(Path(base) / "nvidia" / "cu13") for base in sys.path if base]
    seen, tried = set(), []
    for cand in candidates:
        if not cand or cand in seen:
            continue
        seen.add(cand)
        root = Path(cand)
        if not (root / "include").is_dir():
            continue
        tried.append({"root": str(root), "missing": _header_tree_report(root), "cuda": _tree_cuda_version(root)})
    complete = [t for t in tried if not t["missing"]]
    matching = [t for t in complete if nvrtc_major is not None and t["cuda"] and t["cuda"] // 1000 == nvrtc_major]
    chosen = (matching or complete or [None])[0]
    if chosen is not None:
        os.environ["CUDA_HOME"] = chosen["root"]
    return {"chosen": chosen and chosen["root"], "chosen_cuda": chosen and chosen["cuda"], "tried": tried}


def load_cudnn(path):
    """Import the cuDNN frontend from ``path`` (put first on sys.path): ``(module, None)`` or
    ``(None, reason)``."""
    if not path:
        return None, f"no cuDNN frontend: pass --cudnn-path or set ${PATH_ENV}"
    if not Path(path).is_dir():
        return None, f"--cudnn-path {path} is not a directory"
    sys.path.insert(0, str(Path(path).resolve()))
    try:
        import cudnn
        from cudnn.linear_attention import kimi_delta_attention  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - an absent or broken peer is a result, not a crash
        return None, f"import cudnn failed: {type(exc).__name__}: {str(exc)[:300]}"
    return cudnn, None


def instrument_compiles(log: list):
    """Record every cubin request of cuDNN's NVRTC path (source, options, seconds, and whether it
    compiled or came from the on-disk cache) into ``log``; returns the cache folder."""
    from cudnn.linear_attention.cake import compiler

    original = compiler.compile_cubin
    cache = compiler.cache_dir()

    def counted(source, arch, extra_options=()):
        before = set(cache.glob("*.cubin")) if cache.is_dir() else set()
        t0 = time.perf_counter()
        cubin = original(source, arch, extra_options)
        seconds = time.perf_counter() - t0
        after = set(cache.glob("*.cubin")) if cache.is_dir() else set()
        entry = {
            "source": Path(source).name,
            "arch": arch,
            "options": list(extra_options),
            "seconds": seconds,
            "compiled": bool(after - before),
        }
        log.append(entry)
        print(f"[cudnn] cubin {entry['source']} {entry['options']}: {seconds:.2f} s, compiled={entry['compiled']}")
        return cubin

    compiler.compile_cubin = counted
    return cache


def nvrtc_info() -> dict:
    info = {}
    try:
        from cuda.bindings import nvrtc

        err, major, minor = nvrtc.nvrtcVersion()
        info["version"] = f"{major}.{minor}" if int(err) == 0 else f"error {err}"
    except Exception as exc:  # noqa: BLE001
        info["version"] = f"unavailable ({type(exc).__name__})"
        info["error"] = str(exc)[:300]
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib

        info["library"] = load_nvidia_dynamic_lib("nvrtc").abs_path
    except Exception as exc:  # noqa: BLE001
        info["library"] = f"unknown: {type(exc).__name__}"
    return info


# -- the benchmark -----------------------------------------------------------------------------
class Bench:
    def __init__(self, args):
        self.args = args
        self.warmup, self.iters = (5, 20) if args.quick else (25, 100)
        self.device = torch.device("cuda", 0)
        self.start = time.perf_counter()
        self.results = {"meta": {}, "checks": [], "rows": [], "errors": []}
        self.cudnn, self.cudnn_reason = None, None
        self.plan = None if args.cudnn_plan == "auto" else args.cudnn_plan
        self.compiles = []
        self.cudnn_ok = {}  # regime -> passed the reference check (None: not checked)

    def elapsed(self):
        return time.perf_counter() - self.start

    def over_budget(self):
        return self.args.budget_s is not None and self.elapsed() > self.args.budget_s

    def error(self, message):
        print(f"[bench] {message}", flush=True)
        self.results["errors"].append(message)

    def time(self, fn):
        return time_cuda(fn, warmup=self.warmup, iters=self.iters)

    def time_graph(self, fn, what):
        """IQM ms of replaying one captured call of ``fn``, or None (reason recorded)."""
        try:
            graph = capture_graph(fn)
        except Exception as exc:  # noqa: BLE001
            torch.cuda.synchronize()
            self.error(f"{what}: CUDA-graph capture failed: {type(exc).__name__}: {str(exc)[:300]}")
            return None
        try:
            return self.time(graph.replay)
        finally:
            del graph

    def setup(self):
        args = self.args
        nvrtc = nvrtc_info()
        major = nvrtc.get("version", "").split(".")[0]
        headers = find_cuda_headers(args.cuda_headers, int(major) if major.isdigit() else None)
        print(f"[env] NVRTC {nvrtc.get('version')} ({nvrtc.get('library')}); CUDA headers for it: ", end="")
        print(f"{headers['chosen'] or 'NONE COMPLETE FOUND'} (CUDA_VERSION {headers['chosen_cuda']})")
        for t in headers["tried"]:
            state = "complete" if not t["missing"] else "lacks " + ", ".join(t["missing"])
            print(f"[env]   {t['root']}: CUDA_VERSION {t['cuda']}, {state}")
        self.cudnn, self.cudnn_reason = load_cudnn(args.cudnn_path)
        meta = self.results["meta"]
        props = torch.cuda.get_device_properties(self.device)
        import cula_aot

        meta.update(
            date_utc=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            command=" ".join(sys.argv),
            gpu=props.name,
            sm_count=props.multi_processor_count,
            torch=torch.__version__,
            cuda=torch.version.cuda,
            cula_aot=cula_aot.__version__,
            warmup=self.warmup,
            iters=self.iters,
            cudnn_plan=args.cudnn_plan,
            cuda_headers=headers,
            nvrtc=nvrtc,
            cudnn_compiles=self.compiles,
        )
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
        if self.cudnn is None:
            meta["cudnn_frontend"] = None
            self.error(self.cudnn_reason)
        else:
            meta["cudnn_frontend"] = getattr(self.cudnn, "__version__", "?")
            meta["cudnn_frontend_path"] = str(Path(self.cudnn.__file__).resolve().parent)
            try:
                meta["cudnn_backend"] = int(self.cudnn.backend_version())
            except Exception as exc:  # noqa: BLE001
                meta["cudnn_backend"] = f"unknown: {type(exc).__name__}: {str(exc)[:100]}"
            try:
                meta["cudnn_cubin_cache"] = str(instrument_compiles(self.compiles))
            except Exception as exc:  # noqa: BLE001
                self.error(f"cannot watch cuDNN's NVRTC compiles: {type(exc).__name__}: {exc}")
        print(
            f"[env] {props.name}, torch {torch.__version__}, cula_aot {cula_aot.__version__}, cuDNN frontend "
            f"{meta['cudnn_frontend'] or 'absent'} (backend {meta.get('cudnn_backend', '–')})",
            flush=True,
        )

    def cudnn_call(self, x, what):
        """The cuDNN runner for ``x`` after one checked first call: ``(runner, (o, final), seconds,
        variant, None)``; on failure of the public op, the direct launch of the same kernel
        (variant "direct"); ``(None, None, None, None, reason)`` if neither runs."""
        reasons = []
        for variant in ("op", "direct"):
            try:
                run = cudnn_runner(x, self.plan) if variant == "op" else cudnn_direct_runner(x)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = run()
                torch.cuda.synchronize()
                return run, out, time.perf_counter() - t0, variant, None
            except Exception as exc:  # noqa: BLE001
                torch.cuda.synchronize()
                reasons.append(f"{variant}: {type(exc).__name__}: {str(exc)[:400]}")
                self.error(f"cuDNN {what} ({variant}) failed: {reasons[-1]}")
                if variant == "op":
                    # The op caches a graph before pinning its plan: a failed pin would leave an
                    # unpinned graph that a later call of the same shape runs on another engine.
                    from cudnn.linear_attention.ops import kda as kda_ops

                    kda_ops.fprop_cache.clear()
        return None, None, None, None, "; ".join(reasons)

    def cudnn_engines_used(self):
        """Names of the engines behind every KDA graph cuDNN has planned in this process."""
        try:
            from cudnn.linear_attention.ops import kda as kda_ops

            names = set()
            for graph, _ in kda_ops.fprop_cache.values():
                engine = graph.selected_engine if getattr(graph, "_planning_done", False) else None
                names.add("backend or unplanned" if engine is None else engine.name)
            return sorted(names)
        except Exception as exc:  # noqa: BLE001
            return [f"unknown: {type(exc).__name__}: {str(exc)[:100]}"]

    def run_checks(self, regimes):
        for regime in regimes:
            for heads, lengths in CHECK_ROWS:
                row = {"regime": regime, "H": heads, "lengths": lengths}
                try:
                    self.check(row, draw_inputs(heads, lengths, regime, self.device, seed=7))
                except Exception as exc:  # noqa: BLE001 - keep the rest of the run
                    torch.cuda.synchronize()
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
                    self.error(f"check {regime} H{heads} {lengths}: {row['error']}")
                if "cudnn_ok" in row:
                    self.cudnn_ok[regime] = self.cudnn_ok.get(regime, True) and row["cudnn_ok"]
                self.results["checks"].append(row)
                print(f"[{self.elapsed():6.1f}s] check {_check_line(row)}", flush=True)
                torch.cuda.empty_cache()
                self.save()

    def check(self, row, x):
        """Relative RMSE of ours and of cuDNN against the float64 reference on ``x``."""
        ref_o, ref_s = reference_outputs(x)
        o, s = ours_runner(x)()
        row["ours_o"], row["ours_state"] = reference.rel_rmse(o, ref_o), reference.rel_rmse(s, ref_s)
        row["ours_ok"] = max(row["ours_o"], row["ours_state"]) <= CHECK_BOUND
        if self.args.truncated:
            o, s = ours_runner(x, "truncated")()
            row["truncated_o"], row["truncated_state"] = reference.rel_rmse(o, ref_o), reference.rel_rmse(s, ref_s)
        if self.cudnn is None:
            return
        _, out, seconds, variant, reason = self.cudnn_call(x, f"check {x['regime']} H{row['H']} {row['lengths']}")
        if out is None:
            row["cudnn_error"], row["cudnn_ok"] = reason, False
            return
        o, s = out
        row["cudnn_variant"], row["cudnn_first_call_s"] = variant, seconds
        row["cudnn_o"], row["cudnn_state"] = reference.rel_rmse(o, ref_o), reference.rel_rmse(s, ref_s)
        # Read as [K, V]: small here and large above means a state layout mismatch.
        row["cudnn_state_as_kv"] = reference.rel_rmse(s.transpose(-1, -2), ref_s)
        row["cudnn_ok"] = max(row["cudnn_o"], row["cudnn_state"]) <= CHECK_BOUND

    def run_rows(self, rows, regimes):
        for name in rows:
            heads, lengths = ROWS[name]
            for regime in regimes:
                row = {"row": name, "H": heads, "lengths": lengths, "T": sum(lengths), "N": len(lengths)}
                row["regime"] = regime
                if self.over_budget():
                    row["skipped"] = "time budget"
                    self.results["rows"].append(row)
                    continue
                try:
                    self.measure(row, draw_inputs(heads, lengths, regime, self.device, seed=0))
                except Exception as exc:  # noqa: BLE001 - keep the rest of the run
                    torch.cuda.synchronize()
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
                    self.error(f"{name} {regime}: {row['error']}")
                self.results["rows"].append(row)
                print(f"[{self.elapsed():6.1f}s] {_row_line(row)}", flush=True)
                torch.cuda.empty_cache()
                self.save()

    def measure(self, row, x):
        from cula_aot.ops.paths import planned_split

        what = f"{row['row']} {row['regime']}"
        ours = ours_runner(x)
        o_ours, s_ours = ours()
        row["auto_split"] = planned_split(x["lengths"], row["H"], self.device)
        if not self.args.no_eager:
            row["ours_eager_ms"] = self.time(ours)
        row["ours_graph_ms"] = self.time_graph(ours, f"ours {what}")
        if self.args.truncated:
            truncated = ours_runner(x, "truncated")
            try:
                o, s = truncated()
                row["truncated_agree_o"], row["truncated_agree_state"] = rel_rmse(o, o_ours), rel_rmse(s, s_ours)
                del o, s
                row["ours_truncated_graph_ms"] = self.time_graph(truncated, f"ours truncated {what}")
            except Exception as exc:  # noqa: BLE001 - a failing path is a result: recorded, the rest runs
                torch.cuda.synchronize()
                self.error(f"ours truncated {what} failed: {type(exc).__name__}: {str(exc)[:300]}")
        if self.cudnn is None:
            row["cudnn_error"] = self.cudnn_reason
            return
        run, out, seconds, variant, reason = self.cudnn_call(x, what)
        if run is None:
            row["cudnn_error"] = reason
            return
        row["cudnn_variant"], row["cudnn_first_call_s"] = variant, seconds
        row["agree_o"] = rel_rmse(out[0], o_ours)
        row["agree_state"] = rel_rmse(out[1], s_ours)
        del out, o_ours, s_ours
        key = "cudnn" if variant == "op" else "cudnn_direct"
        if not self.args.no_eager and variant == "op":
            row["cudnn_eager_ms"] = self.time(run)
        row[f"{key}_graph_ms"] = self.time_graph(run, f"cuDNN {what}")
        if variant == "op":
            fp32 = cudnn_runner(x, self.plan, fp32_gate=True)
            try:
                fp32()
                row["cudnn_fp32_graph_ms"] = self.time_graph(fp32, f"cuDNN fp32 gate {what}")
            except Exception as exc:  # noqa: BLE001
                torch.cuda.synchronize()
                self.error(f"cuDNN fp32 gate {what} failed: {type(exc).__name__}: {str(exc)[:300]}")

    def run(self, rows, regimes):
        self.setup()
        if not self.args.no_check:
            self.run_checks(regimes)
        self.run_rows(rows, regimes)
        meta = self.results["meta"]
        meta["elapsed_s"] = self.elapsed()
        meta["cudnn_reference_ok"] = self.cudnn_ok
        if self.cudnn is not None:
            meta["cudnn_engines_used"] = self.cudnn_engines_used()
            print(f"[cudnn] engines behind its KDA graphs: {meta['cudnn_engines_used']}")
        self.save()

    def save(self):
        self.results["meta"]["cudnn_reference_ok"] = self.cudnn_ok
        if self.args.json:
            Path(self.args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(self.args.json).write_text(json.dumps(self.results, indent=1))
        if self.args.markdown:
            Path(self.args.markdown).write_text(render_markdown(self.results))


# -- rendering ---------------------------------------------------------------------------------
def _f(v, digits=4):
    return "–" if v is None else f"{v:.{digits}f}"


def _e(v):
    return "–" if v is None else f"{v:.1e}"


def ratio(num, den):
    """``num / den`` or None when either is missing."""
    return None if num is None or den is None or den <= 0 else num / den


def _x(v):
    return "–" if v is None else f"{v:.2f}×"


def geomean(values):
    values = [v for v in values if v is not None and v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def _check_line(r):
    line = f"{r['regime']} H{r['H']} {lengths_label(r['lengths'])}: "
    line += f"ours o {_e(r.get('ours_o'))} state {_e(r.get('ours_state'))}"
    if r.get("error"):
        line += f"; error: {r['error'][:200]}"
    if "cudnn_o" in r:
        line += f"; cuDNN o {_e(r['cudnn_o'])} state {_e(r['cudnn_state'])} (as [K,V] {_e(r['cudnn_state_as_kv'])})"
    elif r.get("cudnn_error"):
        line += f"; cuDNN: {r['cudnn_error'][:200]}"
    return line


def _row_line(r):
    cells = [f"{r['row']} {r['regime']}:"]
    keys = ("ours_graph_ms", "ours_truncated_graph_ms", "cudnn_graph_ms", "cudnn_fp32_graph_ms", "ours_eager_ms")
    for key in (*keys, "cudnn_eager_ms"):
        cells.append(f"{key[:-3]}={_f(r.get(key))}")
    cells.append(f"cuDNN/ours graph={_x(ratio(_cudnn_graph(r), r.get('ours_graph_ms')))}")
    if r.get("cudnn_error"):
        cells.append(f"cuDNN error: {r['cudnn_error'][:200]}")
    return " ".join(cells)


def _cudnn_graph(r):
    """cuDNN's graph time of a row: the public op's, else the direct launch's."""
    return r.get("cudnn_graph_ms") if r.get("cudnn_graph_ms") is not None else r.get("cudnn_direct_graph_ms")


def _table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _row_note(r, regime_ok):
    notes = [f"error: {r['error'][:160]}"] if r.get("error") else []
    if regime_ok is False:
        notes.append("⚠ cuDNN failed the reference check in this regime")
    for key in ("agree_o", "agree_state"):
        if r.get(key) is not None and r[key] > AGREE_BOUND:
            notes.append(f"⚠ cuDNN {key[6:]} differs from ours by {r[key]:.1e}")
    if r.get("cudnn_variant") == "direct":
        notes.append("cuDNN op failed: direct kernel launch, fp32 gate")
    if r.get("cudnn_error") and r.get("cudnn_variant") is None:
        notes.append(f"cuDNN: {r['cudnn_error'][:160]}")
    return "; ".join(notes).replace("|", "/")


def render_markdown(res) -> str:
    meta = res.get("meta", {})
    out = ["# KDA prefill: cula_aot against cuDNN frontend's Hopper kernel, same process", ""]
    nvrtc = meta.get("nvrtc") or {}
    headers = (meta.get("cuda_headers") or {}).get("chosen")
    out.append(
        f"{meta.get('gpu', '?')} ({meta.get('sm_count', '?')} SMs), driver {meta.get('driver', '?')}, torch "
        f"{meta.get('torch', '?')} (CUDA {meta.get('cuda', '?')}), cula_aot {meta.get('cula_aot', '?')}, "
        f"nvidia-cudnn-frontend {meta.get('cudnn_frontend') or 'absent'} (cuDNN backend "
        f"{meta.get('cudnn_backend', '–')}, plan `{meta.get('cudnn_plan', '?')}`), NVRTC {nvrtc.get('version', '?')}, "
        f"CUDA headers {headers or '–'}; {meta.get('date_utc', '?')}; `{meta.get('command', '')}`."
    )
    if meta.get("cudnn_engines_used"):
        out.append(f"cuDNN engines behind its KDA graphs: {', '.join(meta['cudnn_engines_used'])}.")
    compiles = meta.get("cudnn_compiles") or []
    built = [c for c in compiles if c.get("compiled")]
    out.append(
        f"cuDNN cubin requests: {len(compiles)} ({len(built)} compiled by NVRTC, "
        f"{sum(c['seconds'] for c in built):.1f} s; the rest from its disk cache)."
    )
    out.append("")
    out.append(
        f"CUDA events, {meta.get('warmup', '?')} warm-up / {meta.get('iters', '?')} timed, interquartile mean, ms. "
        "Initial + final fp32 state [N, H, V, K] everywhere; safe gate, β logits, q/k L2 norm in the kernels. "
        "Graph = replay of one captured call; eager = the Python call (host work included). "
        'Ratios are cuDNN ÷ ours (> 1: ours faster). Ours: `kda_prefill(intracard_cp="auto")` (CP split '
        "in the table, 1 = serial). cuDNN: `kimi_delta_attention` with the same bf16 g and β (it converts them "
        "to fp32 in the call); 'fp32 gate' hands it fp32 g and β made outside the timing (its kernel alone). "
        "'vs ours' = rel-RMSE of cuDNN's o / final state against ours on that row."
    )
    out.append("")
    checks = res.get("checks") or []
    if checks:
        out += [f"## Against the float64 reference (rel-RMSE, bound {CHECK_BOUND:g})", ""]
        body = []
        for r in checks:
            cudnn_ok = r.get("cudnn_ok")
            verdict = "ok" if r.get("ours_ok") else "ours FAILS" if "ours_ok" in r else f"error: {r.get('error')}"
            if cudnn_ok is not None:
                verdict += ", cuDNN ok" if cudnn_ok else ", cuDNN FAILS"
            as_kv = r.get("cudnn_state_as_kv")
            if cudnn_ok is False and as_kv is not None and as_kv <= CHECK_BOUND:
                verdict += " (its state is [K, V])"
            if r.get("cudnn_error"):
                verdict += f" ({r['cudnn_error'][:120]})".replace("|", "/")
            body.append(
                [
                    r["regime"],
                    r["H"],
                    lengths_label(r["lengths"]),
                    _e(r.get("ours_o")),
                    _e(r.get("ours_state")),
                    _e(r.get("cudnn_o")),
                    _e(r.get("cudnn_state")),
                    _e(as_kv),
                    verdict,
                ]
            )
        header = ["regime", "H", "lengths", "ours o", "ours state", "cuDNN o", "cuDNN state", "cuDNN state as [K,V]"]
        out += [_table(header + ["verdict"], body), ""]
    rows = res.get("rows") or []
    ok = meta.get("cudnn_reference_ok") or {}
    for regime in REGIMES:
        mine = [r for r in rows if r.get("regime") == regime]
        if not mine:
            continue
        out += [f"## {regime} decay", ""]
        header = [
            "row",
            "H",
            "lengths",
            "CP split",
            "ours graph",
            "cuDNN graph",
            "cuDNN ÷ ours",
            "cuDNN fp32 gate graph",
            "÷ ours",
            "ours eager",
            "cuDNN eager",
            "÷ ours (eager)",
            "cuDNN 1st call s",
            "vs ours o / state",
            "note",
        ]
        body = []
        for r in mine:
            label = lengths_label(r["lengths"])
            if r.get("skipped"):
                body.append([r["row"], r["H"], label, f"skipped ({r['skipped']})"] + [""] * (len(header) - 4))
                continue
            cg = _cudnn_graph(r)
            agree = "–" if r.get("agree_o") is None else f"{r['agree_o']:.1e} / {r['agree_state']:.1e}"
            body.append(
                [
                    r["row"],
                    r["H"],
                    label,
                    r.get("auto_split", "–"),
                    _f(r.get("ours_graph_ms")),
                    _f(cg),
                    _x(ratio(cg, r.get("ours_graph_ms"))),
                    _f(r.get("cudnn_fp32_graph_ms")),
                    _x(ratio(r.get("cudnn_fp32_graph_ms"), r.get("ours_graph_ms"))),
                    _f(r.get("ours_eager_ms")),
                    _f(r.get("cudnn_eager_ms")),
                    _x(ratio(r.get("cudnn_eager_ms"), r.get("ours_eager_ms"))),
                    _f(r.get("cudnn_first_call_s"), 2),
                    agree,
                    _row_note(r, ok.get(regime)),
                ]
            )
        out += [_table(header, body), ""]
        graph_g = geomean([ratio(_cudnn_graph(r), r.get("ours_graph_ms")) for r in mine])
        fp32_g = geomean([ratio(r.get("cudnn_fp32_graph_ms"), r.get("ours_graph_ms")) for r in mine])
        out += [f"Geometric mean cuDNN ÷ ours, graph: {_x(graph_g)}; fp32 gate: {_x(fp32_g)}.", ""]
    if res.get("errors"):
        out += ["## Errors", ""] + [f"- {e}" for e in res["errors"]] + [""]
    return "\n".join(out)


# -- command line ------------------------------------------------------------------------------
def parse_list(text, known, what):
    """A comma list of names from ``known`` ("all": every one, in ``known``'s order)."""
    if text == "all":
        return list(known)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown {what} {unknown}; known: {', '.join(known)}")
    return names


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cudnn-path", default=os.environ.get(PATH_ENV), help=f"cuDNN frontend install dir (${PATH_ENV})")
    p.add_argument("--cudnn-plan", default=DEFAULT_PLAN, help='cuDNN engine to pin ("auto": its own routing)')
    p.add_argument("--cuda-headers", action="append", default=[], help="extra CUDA tree (with include/) for NVRTC")
    p.add_argument("--rows", default="all", help=f"comma list of rows or 'all': {', '.join(ROWS)}")
    p.add_argument("--regimes", default="all", help=f"comma list or 'all': {', '.join(REGIMES)}")
    p.add_argument("--budget-s", type=float, default=None, help="start no new row after this many seconds")
    p.add_argument("--json", default=str(DEFAULT_JSON), help="results file (markdown beside it, .md)")
    p.add_argument("--markdown", default=None, help="markdown file (default: the JSON path with .md)")
    p.add_argument("--quick", action="store_true", help="5 warm-up / 20 timed instead of 25 / 100")
    p.add_argument("--no-eager", action="store_true", help="graph replay only")
    p.add_argument("--truncated", action="store_true", help='also time intracard_cp="truncated" (pieces)')
    p.add_argument("--no-check", action="store_true", help="skip the float64 reference checks")
    p.add_argument("--dry-run", action="store_true", help="list what would run and exit")
    p.add_argument("--render", metavar="JSON", help="write the markdown of a results file and exit")
    args = p.parse_args(argv)
    args.row_names = parse_list(args.rows, ROWS, "rows")
    args.regime_names = parse_list(args.regimes, REGIMES, "regimes")
    source = args.render or args.json
    if args.markdown is None and source:
        args.markdown = str(Path(source).with_suffix(".md"))
    return args


def dry_run(args):
    print(f"checks ({len(CHECK_ROWS)} per regime): " + "; ".join(f"H{h} {lengths_label(n)}" for h, n in CHECK_ROWS))
    for name in args.row_names:
        heads, lengths = ROWS[name]
        print(f"{name}: H={heads} lengths {lengths_label(lengths)} × {', '.join(args.regime_names)}")


def main(argv=None):
    args = parse_args(argv)
    if args.render:
        text = render_markdown(json.loads(Path(args.render).read_text()))
        Path(args.markdown).write_text(text)
        print(text)
        return
    if args.dry_run:
        dry_run(args)
        return
    if not torch.cuda.is_available() or torch.cuda.get_device_capability(0) != (9, 0):
        raise SystemExit("needs an sm_90 (Hopper) GPU")
    bench = Bench(args)
    bench.run(args.row_names, args.regime_names)
    print(render_markdown(bench.results))


if __name__ == "__main__":
    main()
