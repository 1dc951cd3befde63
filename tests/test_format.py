"""The tree stays as ``ruff format`` (pyproject's settings: 120 columns) leaves it."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not (ROOT / "pyproject.toml").is_file(), reason="runs in the source checkout only")
@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is not installed (pip install -e '.[test]')")
def test_tree_is_ruff_formatted():
    result = subprocess.run(["ruff", "format", "--check", "."], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, f"run `ruff format .`:\n{result.stdout}{result.stderr}"
