import json
import shutil
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def _has_sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)


def pytest_configure(config):
    # Registered here as well as in pyproject.toml: CI also runs this suite outside the checkout.
    config.addinivalue_line("markers", "gpu: needs an sm_90a GPU and built kernels (skipped without CUDA)")
    config.addinivalue_line(
        "markers", "integration: needs the integration extra (flash-linear-attention, transformers)"
    )


def pytest_collection_modifyitems(config, items):
    if _has_sm90():
        return
    skip = pytest.mark.skip(reason="needs an sm_90a (Hopper) GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def manifest_path():
    from cula_aot.runtime.manifest import find_manifest

    return find_manifest()


@pytest.fixture(scope="session")
def manifest(manifest_path):
    return json.loads(manifest_path.read_text())


@pytest.fixture
def artifact_copy(tmp_path, manifest_path):
    """A private copy of manifest + the cubins it names, to tamper with."""
    data = json.loads(manifest_path.read_text())
    for record in data["kernels"].values():
        dst = tmp_path / record["cubin"]
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(manifest_path.parent / record["cubin"], dst)
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    return tmp_path
