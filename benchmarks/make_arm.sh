#!/usr/bin/env bash
# An A/B arm for ab_prefill: this checkout's HEAD with patches applied (in order), its cubins
# built beside it, in .ab/NAME (git ignores .ab; carry it to the device with artifacts and
# manifest.json).  Runs on the build machine (CuTeDSL), ~6 min per arm on 2 cores.
#
#   bash benchmarks/make_arm.sh NAME [PATCH ...]      # BUILD=0: the tree only
#
# Then on the device, e.g.:
#   python3 -m benchmarks.ab_prefill --arm main=. --arm NAME=.ab/NAME@.ab/NAME -- --only checkpoints --no-fla --quick
#   (cd .ab/NAME && CULA_AOT_ARTIFACTS=$PWD python3 -m benchmarks.checkpoint_kernels --quick --tag NAME)
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ $# -lt 1 ]]; then
    echo "usage: bash benchmarks/make_arm.sh NAME [PATCH ...]" >&2
    exit 2
fi
name=$1
shift
dest=.ab/$name
rm -rf "$dest"
mkdir -p "$dest"
git archive HEAD | tar -x -C "$dest"
for patch_file in "$@"; do
    patch --quiet --batch -p1 -d "$dest" < "$patch_file"
    echo "applied $patch_file"
done
if [[ "${BUILD:-1}" != 0 ]]; then
    (cd "$dest" && python3 build_kernels.py --out .)
fi
echo "arm $name: $dest"
