"""Check a wheel's prebuilt kernels against a checkout's build.

    python .ci/check_wheel.py CHECKOUT_MANIFEST WHEEL

The wheel must hold ``cula_aot/_prebuilt/manifest.json`` and every cubin it names, each with the
sha256 its manifest records, and name the same kernels with the same sha256 as the checkout's
manifest (a rebuild from the same sources and toolchain gives identical cubins).  Exit 1 on any
difference, listing each.
"""

import hashlib
import json
import sys
import zipfile
from pathlib import Path

PREBUILT = "cula_aot/_prebuilt/"


def problems(checkout_manifest: Path, wheel: Path) -> list[str]:
    expected = json.loads(checkout_manifest.read_text())["kernels"]
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        if PREBUILT + "manifest.json" not in names:
            return [f"{wheel} has no {PREBUILT}manifest.json"]
        shipped = json.loads(zf.read(PREBUILT + "manifest.json"))["kernels"]
        found = []
        for name in sorted(set(expected) ^ set(shipped)):
            found.append(f"{name}: {'only in the checkout' if name in expected else 'only in the wheel'}")
        for name, record in sorted(shipped.items()):
            member = PREBUILT + record["cubin"]
            if member not in names:
                found.append(f"{name}: {member} missing from the wheel")
                continue
            digest = hashlib.sha256(zf.read(member)).hexdigest()
            if digest != record["sha256"]:
                found.append(f"{name}: sha256 {digest[:16]} differs from the wheel's manifest")
            if name in expected and digest != expected[name]["sha256"]:
                found.append(
                    f"{name}: sha256 {digest[:16]} differs from the checkout's {expected[name]['sha256'][:16]}"
                )
    return found


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    found = problems(Path(args[0]), Path(args[1]))
    for line in found:
        print(line, file=sys.stderr)
    if found:
        return 1
    count = len(json.loads(Path(args[0]).read_text())["kernels"])
    print(f"{args[1]}: manifest and {count} cubins, sha256-identical to {args[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
