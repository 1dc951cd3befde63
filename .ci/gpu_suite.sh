#!/usr/bin/env bash
# The GPU half of the suite, for the lent H200 (not CI): tests, then timings; logs under $OUT.
# Needs artifacts/ and manifest.json carried with the working tree; flash-linear-attention
# (fla-core, pure Python over Triton) is benchmarked beside ours when importable (PYTHONPATH).
# At most 7 files under $OUT (the device tool brings back 8).  Arguments go to pytest.  Optional bounds, so one bounded device call always reaches the
# benchmark: TEST_TIMEOUT_S (kill pytest after this), BENCH_BUDGET_S (bench_prefill starts no
# workload after this many seconds), BENCH_TIMEOUT_S (kill bench_prefill after this), BENCH_ARGS
# (more bench_prefill options).  fla's first call per (H, fixed/varlen) costs ~2 min of Triton JIT on
# a fresh machine, ~14 min for every section: inside one 10-minute call use e.g.
# BENCH_ARGS="--fla-heads 64" or "--no-fla" (fla's JIT cost as measured 2026-11-29).
# SHARDS=n runs the gpu-marked tests as n concurrent pytest processes on the one GPU
# (benchmarks/gpu_suite.py; arguments are then test paths), the shard logs appended to pytest.log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/cula_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
TEST_TIMEOUT_S=${TEST_TIMEOUT_S:-3600}
BENCH_TIMEOUT_S=${BENCH_TIMEOUT_S:-3600}
budget=()
if [[ -n "${BENCH_BUDGET_S:-}" ]]; then budget=(--budget-s "$BENCH_BUDGET_S"); fi
read -r -a bench_args <<< "${BENCH_ARGS:-}"
t0=$SECONDS
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, cuda.bindings; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda-bindings', cuda.bindings.__version__)" | tee -a "$OUT/gpu.txt"
python3 -c "import fla; print('fla', fla.__version__)" 2>&1 | tail -1 | tee -a "$OUT/gpu.txt"
if [[ "${SHARDS:-1}" -gt 1 ]]; then
    rm -rf /tmp/gpu_suite_logs
    python3 -m benchmarks.gpu_suite --shards "$SHARDS" --timeout "$TEST_TIMEOUT_S" --out /tmp/gpu_suite_logs "$@" \
        > "$OUT/pytest.log" 2>&1
    status=$?
    cat "$OUT/pytest.log"
    cat /tmp/gpu_suite_logs/*.log >> "$OUT/pytest.log"
else
    timeout "$TEST_TIMEOUT_S" python3 -m pytest -q -rs "$@" > "$OUT/pytest.log" 2>&1
    status=$?
fi
echo "pytest exit $status after $((SECONDS - t0)) s"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.log" | tail -40
python3 -m benchmarks.cold_start "$OUT/cold_start.json" 2>&1
python3 -m benchmarks.bench_k1 --json "$OUT/bench_k1.json" 2>&1 | tail -7
echo "benchmarks start after $((SECONDS - t0)) s"
timeout "$BENCH_TIMEOUT_S" python3 -m benchmarks.bench_prefill "${budget[@]}" "${bench_args[@]}" --json "$OUT/bench_prefill.json" \
    --markdown "$OUT/bench_prefill.md" > "$OUT/bench_prefill.log" 2>&1
echo "bench_prefill exit $? after $((SECONDS - t0)) s"
grep -E "^\[|copy bandwidth|Error|error" "$OUT/bench_prefill.log" | tail -60
