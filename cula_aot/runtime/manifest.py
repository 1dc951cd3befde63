"""Find, read and verify ``manifest.json`` (pure Python: no cutlass, no GPU).

Discovery order, first hit wins:
1. ``$CULA_AOT_ARTIFACTS``: a directory holding ``manifest.json`` (an explicit choice: if it has
   no manifest that is an error, never a silent fallback);
2. the package's bundled data, ``cula_aot/_prebuilt/manifest.json`` (wheels);
3. the source checkout root, ``<repo>/manifest.json`` (``python build_kernels.py``).
"""

import hashlib
import json
import os
from pathlib import Path

# 3: every parameter record says whether a call supplies it (``per_call``).
SCHEMA_VERSION = 3
MANIFEST_NAME = "manifest.json"
ENV_ARTIFACTS = "CULA_AOT_ARTIFACTS"
BUILD_HINT = "python build_kernels.py"

_PACKAGE_DIR = Path(__file__).resolve().parent.parent
_REQUIRED_KEYS = ("schema_version", "arch", "cutedsl_version", "kernels")


class ArtifactError(RuntimeError):
    """A manifest or cubin is missing, foreign, stale or tampered with; the message says the fix."""


def candidate_dirs() -> list[tuple[str, Path]]:
    env = os.environ.get(ENV_ARTIFACTS)
    if env:
        return [(f"${ENV_ARTIFACTS}", Path(env))]
    return [("package data", _PACKAGE_DIR / "_prebuilt"), ("source checkout", _PACKAGE_DIR.parent)]


def find_manifest() -> Path:
    tried = []
    for origin, directory in candidate_dirs():
        path = directory / MANIFEST_NAME
        if path.is_file():
            return path
        tried.append(f"{origin}: {path}")
    raise ArtifactError(
        "no cula-aot manifest found (tried " + "; ".join(tried) + "). Build the kernels with "
        f"`{BUILD_HINT}` or point ${ENV_ARTIFACTS} at a directory holding manifest.json."
    )


class Manifest:
    """A parsed, schema-checked manifest; cubin paths resolve relative to its directory."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.root = self.path.parent
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError) as exc:
            raise ArtifactError(f"cannot read manifest {self.path}: {exc}. Rebuild with `{BUILD_HINT}`.") from exc
        missing = [k for k in _REQUIRED_KEYS if k not in data]
        if missing:
            raise ArtifactError(f"manifest {self.path} lacks {missing}. Rebuild with `{BUILD_HINT}`.")
        if data["schema_version"] != SCHEMA_VERSION:
            raise ArtifactError(
                f"manifest {self.path} has schema {data['schema_version']}, this cula_aot reads schema "
                f"{SCHEMA_VERSION}. Rebuild the kernels with this version: `{BUILD_HINT}`."
            )
        from .._version import __version__
        from ..specs import CUTEDSL_VERSION

        built_by = data.get("package_version")
        if built_by != __version__:
            raise ArtifactError(
                f"manifest {self.path} was built by cula-aot {built_by}, this is cula-aot {__version__}: kernel "
                f"parameter ABIs may differ. Rebuild the kernels with this version: `{BUILD_HINT}`."
            )
        if data["cutedsl_version"] != CUTEDSL_VERSION:
            raise ArtifactError(
                f"manifest {self.path} was compiled with CuTeDSL {data['cutedsl_version']}, but cula-aot "
                f"{__version__} is keyed on CuTeDSL {CUTEDSL_VERSION}. Rebuild with the pinned compiler: "
                f"`pip install -e '.[build]' && {BUILD_HINT}`."
            )
        expected_dir = ("artifacts", data["cutedsl_version"], data["arch"])
        foreign = [n for n, r in data["kernels"].items() if Path(r["cubin"]).parts[:3] != expected_dir]
        if foreign:
            raise ArtifactError(
                f"manifest {self.path} (CuTeDSL {data['cutedsl_version']}, {data['arch']}) names cubins outside "
                f"{'/'.join(expected_dir)}/, e.g. {data['kernels'][foreign[0]]['cubin']}: it mixes builds. "
                f"Rebuild with `{BUILD_HINT}`."
            )
        self.data = data
        self.arch = data["arch"]
        self.kernels = data["kernels"]

    @classmethod
    def discover(cls) -> "Manifest":
        return cls(find_manifest())

    def record(self, spec) -> tuple[str, dict]:
        """The (name, record) of a specialization (``cula_aot.specs``); a clear error if not built."""
        rec = self.kernels.get(spec.name)
        if rec is not None:
            return spec.name, rec
        raise ArtifactError(
            f"no {spec.kernel} specialization for {spec.args} in {self.path}. Rebuild with `{BUILD_HINT}`."
        )

    def check_arch(self, device_arch: str) -> None:
        if device_arch != self.arch:
            raise ArtifactError(
                f"cula_aot kernels in {self.path} are built for {self.arch}, but the tensor's device is "
                f"{device_arch}. cula_aot supports Hopper (sm_90a: H100/H200) only."
            )

    def read_cubin(self, record: dict) -> bytes:
        """The cubin bytes of ``record``, verified against the manifest's size and sha256."""
        path = self.root / record["cubin"]
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ArtifactError(f"cubin {path} is missing ({exc}). Rebuild with `{BUILD_HINT}`.") from exc
        digest = hashlib.sha256(data).hexdigest()
        if len(data) != record["size"] or digest != record["sha256"]:
            raise ArtifactError(
                f"cubin {path} does not match the manifest (sha256 {digest[:16]}…, {len(data)} B; expected "
                f"{record['sha256'][:16]}…, {record['size']} B): it was modified or truncated. Refusing to "
                f"load it. Rebuild with `{BUILD_HINT}` or reinstall the wheel."
            )
        return data
