"""Wheel packaging: ship the prebuilt cubins and manifest inside the package.

``build_py`` copies ``manifest.json`` and every cubin it names into ``cula_aot/_prebuilt/``
(where the runtime looks for package data), building them first with ``build_kernels.py``'s
builder when the checkout has none (that needs the ``build`` extra: nvidia-cutlass-dsl).
Metadata lives in pyproject.toml; the version is read from ``cula_aot/_version.py``.
"""

import json
import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithCubins(build_py):
    def run(self):
        super().run()
        manifest_path = ROOT / "manifest.json"
        if not manifest_path.is_file():
            # This tree's kernels, not an installed (e.g. editable) cula_aot elsewhere.
            sys.path.insert(0, str(ROOT))
            from cula_aot.compiler.builder import build

            build(ROOT)  # every specialization, all cores; writes ROOT/manifest.json last
        manifest = json.loads(manifest_path.read_text())
        target = Path(self.build_lib) / "cula_aot" / "_prebuilt"
        if target.exists():
            shutil.rmtree(target)
        for record in manifest["kernels"].values():
            dst = target / record["cubin"]
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ROOT / record["cubin"], dst)
        # Written last, like the build does: a manifest never names a cubin that is not there.
        shutil.copyfile(manifest_path, target / "manifest.json")


setup(cmdclass={"build_py": BuildPyWithCubins})
