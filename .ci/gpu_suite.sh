#!/usr/bin/env bash
# The GPU half of the suite, for the lent H200 (not CI): tests, then timings; logs under $OUT.
# Needs artifacts/ and manifest.json carried with the working tree.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/cula_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, cuda.bindings; print('torch', torch.__version__, 'cuda-bindings', cuda.bindings.__version__)" | tee -a "$OUT/gpu.txt"
python3 -m pytest -q -rs -s "$@" 2>&1 | tee "$OUT/pytest.log" | grep -E "passed|failed|error|Error" | tail -40
python3 benchmarks/cold_start.py "$OUT/cold_start.json" 2>&1 | tee "$OUT/cold_start.log"
python3 benchmarks/bench_k1.py --json "$OUT/bench_k1.json" 2>&1 | tee "$OUT/bench_k1.log" | tail -7
python3 benchmarks/bench_prefill.py --json "$OUT/bench_prefill.json" 2>&1 | tee "$OUT/bench_prefill.log" | tail -18
