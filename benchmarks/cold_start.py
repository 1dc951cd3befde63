#!/usr/bin/env python3
"""Cold start in fresh processes: what a serving process pays before its first prefill.

    python -m benchmarks.cold_start [JSON]

Child 1 (lazy): import torch + CUDA init (not counted), then ``import cula_aot`` and a first
prefill (H=8, T=1024) including loading its two cubins.  Child 2 (eager): ``import cula_aot``,
``preload()`` (every cubin: each serves any head count), then the first prefill.
Wall-clock times, synchronised.  The children find ``cula_aot`` through ``PYTHONPATH`` (this
checkout first), as a GPU machine runs it from the checkout without installing.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, time
import torch
torch.cuda.init(); torch.zeros(1, device="cuda"); torch.cuda.synchronize()
x = [torch.randn(1, 1024, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
beta = torch.randn(1, 1024, 8, device="cuda", dtype=torch.bfloat16)
a_log, dt_bias = torch.zeros(8, device="cuda"), torch.zeros(8, 128, device="cuda")
t0 = time.perf_counter()
import cula_aot
t1 = time.perf_counter()
loaded = cula_aot.preload() if {eager} else 0
t2 = time.perf_counter()
cula_aot.kda_prefill(*x, beta, A_log=a_log, dt_bias=dt_bias, lower_bound=-5.0)
torch.cuda.synchronize()
t3 = time.perf_counter()
print(json.dumps({{"import_ms": 1e3 * (t1 - t0), "preload_ms": 1e3 * (t2 - t1), "cubins_preloaded": loaded,
                  "first_prefill_ms": 1e3 * (t3 - t2), "total_ms": 1e3 * (t3 - t0)}}))
"""


def main():
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    results = {}
    for mode, eager in (("lazy", False), ("preload", True)):
        out = subprocess.run(
            [sys.executable, "-c", CHILD.format(eager=eager)], check=True, env=env, capture_output=True, text=True
        ).stdout
        results[mode] = json.loads(out.strip().splitlines()[-1])
    for mode, r in results.items():
        print(
            f"{mode:8s} import {r['import_ms']:.1f} ms + preload {r['preload_ms']:.1f} ms "
            f"({r['cubins_preloaded']} cubins) + first prefill {r['first_prefill_ms']:.1f} ms "
            f"= {r['total_ms']:.1f} ms"
        )
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
