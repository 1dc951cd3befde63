#!/usr/bin/env bash
# Run a command with flash-linear-attention importable on a GPU machine that has no network, and
# with fla's Triton autotune results kept from one bounded device call to the next.
#
#   # on the build machine, once (gitignored; carry .whl, and .fla_cache.tgz when you have one):
#   pip download --no-deps -d .whl fla-core==0.6.0 flash-linear-attention==0.6.0 einops
#   # on the device:
#   bash benchmarks/with_fla.sh python3 -m benchmarks.bench_prefill --only gates --fla-heads 12,16,24,32 \
#       --budget-s 480 --json "$OUT/gates.json" --markdown "$OUT/gates.md"
#
# The wheels go to a private --target directory put on PYTHONPATH (the machine's own torch and
# triton stay).  fla turns on Triton's ``cache_results``: the first call per (H, fixed/varlen)
# family autotunes for ~100 s and records the winners as ``*.autotune.json`` in TRITON_CACHE_DIR.
# That directory starts from .fla_cache.tgz when carried and goes back as $OUT/fla_cache.tgz
# (the autotune records only, a few KB: compiling the chosen configurations again is quick), so
# a later call that carries it as .fla_cache.tgz skips the tuning already done.
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ $# -lt 1 ]]; then
    echo "usage: bash benchmarks/with_fla.sh COMMAND [ARG ...]" >&2
    exit 2
fi
OUT=${OUT:-/tmp/cula_out}
mkdir -p "$OUT"
site=${FLA_SITE:-/tmp/fla_site}
if ! compgen -G ".whl/*.whl" > /dev/null; then
    echo "with_fla: no wheels in .whl/ (see the header of $0)" >&2
    exit 2
fi
pip install -q --no-deps --target "$site" .whl/*.whl || exit 2
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/fla_triton_cache}
mkdir -p "$TRITON_CACHE_DIR"
if [[ -f .fla_cache.tgz ]]; then
    tar xzf .fla_cache.tgz -C "$TRITON_CACHE_DIR"
fi
echo "with_fla: $(python3 -c 'import fla; print("fla", fla.__version__)' 2>&1 | tail -1);" \
     "$(find "$TRITON_CACHE_DIR" -name '*.autotune.json' | wc -l) autotune records carried in"
"$@"
status=$?
(cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | tar czf "$OUT/fla_cache.tgz" -T -)
echo "with_fla: $(tar tzf "$OUT/fla_cache.tgz" | wc -l) autotune records in \$OUT/fla_cache.tgz"
exit $status
