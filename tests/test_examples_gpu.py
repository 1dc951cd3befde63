"""The runnable examples under examples/ run (and check themselves) on the GPU."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("script", sorted(p.name for p in EXAMPLES.glob("*.py")) if EXAMPLES.is_dir() else [])
def test_example_runs(script):
    # The package as this test session imports it (a checkout or an installed wheel).
    import cula_aot

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(cula_aot.__file__).parent.parent), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script)], capture_output=True, text=True, timeout=300, env=env
    )
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith("ok")
