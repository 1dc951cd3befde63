#!/usr/bin/env python3
"""Cold start and K1 timing on the GPU: module-load cost per cubin and K1 throughput.

    python -m benchmarks.bench_k1            # prints a table; --json PATH also writes JSON

Cold start is measured in this fresh process: manifest discovery + sha256 checks + every
``cuModuleLoadData`` (``preload``), then the first K1 launch.  K1 is timed with CUDA events
(25 warm-up, 100 timed, interquartile mean) against the bytes it must move.
"""

import argparse
import json
import time
from pathlib import Path

t_import = time.perf_counter()
import torch

import cula_aot  # noqa: F401
from cula_aot import specs
from benchmarks.peers import copy_bandwidth
from benchmarks.timing import time_cuda
from cula_aot.layout import WORKSPACE_SLOT_BYTES
from cula_aot.ops.prepare import plan_slots, prepare, sm_count
from cula_aot.runtime.loader import default_loader
from cula_aot.testing import standard_inputs

t_import = time.perf_counter() - t_import


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", help="write results here")
    parser.add_argument(
        "--tile-caps",
        type=int,
        nargs="*",
        default=[],
        help="also time K1 with specs.K1_MAX_TILES_PER_CTA set to each of these",
    )
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    torch.zeros(1, device=device)  # CUDA context up before the clock starts
    loader = default_loader()
    t0 = time.perf_counter()
    n = loader.preload(device)
    t_preload = time.perf_counter() - t0
    results = {
        "import_s": t_import,
        "preload_s": t_preload,
        "kernels_loaded": n,
        "per_module_ms": 1e3 * t_preload / n,
        "copy_bandwidth_Bps": copy_bandwidth(device),
        "k1": [],
    }

    default_cap = specs.K1_MAX_TILES_PER_CTA
    cases = [(64, 1, 8192, None), (96, 1, 8192, None), (8, 1, 16384, None), (64, 8, 1024, None)]
    cases += [(h, b, t, cap) for cap in args.tile_caps for h, b, t in [(64, 1, 8192), (8, 1, 16384), (4, 1, 8192)]]
    for heads, batch, seq_len, cap in cases:
        specs.K1_MAX_TILES_PER_CTA = default_cap if cap is None else cap
        x = standard_inputs(batch, seq_len, heads, seed=0)  # drawn on the host (seeded), K1's inputs moved
        q, k, g, beta, a_log, dt_bias = (x[name].to(device) for name in ("q", "k", "g", "beta", "A_log", "dt_bias"))
        del x

        def run(q=q, k=k, g=g, beta=beta, a_log=a_log, dt_bias=dt_bias):
            prepare(q, k, g, beta, A_log=a_log, dt_bias=dt_bias, lower_bound=-5.0)

        t1 = time.perf_counter()
        run()
        torch.cuda.synchronize()
        first_ms = 1e3 * (time.perf_counter() - t1)
        ms = time_cuda(run)
        slots = heads * plan_slots(batch, seq_len, None)
        moved = 3 * q.numel() * 2 + beta.numel() * 2 + slots * sum(WORKSPACE_SLOT_BYTES.values())
        tiles_per_cta = specs.k1_grid(slots // heads, heads, sm_count(device))["tiles_per_cta"]
        results["k1"].append(
            {
                "heads": heads,
                "batch": batch,
                "seq_len": seq_len,
                "tiles_per_cta": tiles_per_cta,
                "ms": ms,
                "first_call_ms": first_ms,
                "GB": moved / 1e9,
                "TBps": moved / ms / 1e9,
                "of_copy": moved / ms * 1e3 / results["copy_bandwidth_Bps"],
            }
        )
    print(
        f"import cula_aot + torch: {t_import * 1e3:.1f} ms; preload {n} cubins: {t_preload * 1e3:.1f} ms "
        f"({results['per_module_ms']:.2f} ms per module)"
    )
    print(f"copy bandwidth (same run): {results['copy_bandwidth_Bps'] / 1e12:.2f} TB/s")
    print("| H | B | T | tiles/CTA | K1 ms | first call ms | GB moved | TB/s | of copy |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results["k1"]:
        print(
            f"| {r['heads']} | {r['batch']} | {r['seq_len']} | {r['tiles_per_cta']} | {r['ms']:.4f} | {r['first_call_ms']:.2f} | "
            f"{r['GB']:.3f} | {r['TBps']:.2f} | {r['of_copy']:.0%} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
