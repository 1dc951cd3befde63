"""The sharded GPU-suite runner (benchmarks/gpu_suite.py) on a throwaway suite of gpu-marked tests
that run on the CPU: its shards, its failure rerun and its exit status."""

import importlib
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(
    not (ROOT / "benchmarks" / "gpu_suite.py").exists(), reason="benchmarks/ is not part of the installed wheel"
)


@pytest.fixture(scope="module")
def gs():
    return importlib.import_module("benchmarks.gpu_suite")


def test_shards_are_contiguous_and_balanced(gs):
    ids = [f"t::{i}" for i in range(10)]
    parts = gs.shards(ids, 4)
    assert [len(p) for p in parts] == [3, 3, 2, 2] and [i for p in parts for i in p] == ids
    assert gs.shards(ids[:2], 4) == [["t::0"], ["t::1"]]
    assert gs.shards(ids, 1) == [ids]


def test_listed_ids_and_summary_from_pytest_output(gs):
    log = "x\nFAILED a.py::t[1] - assert\nERROR b.py::u\nFAILED a.py::t[1]\n==== 1 failed, 2 passed in 0.5s ====\n"
    assert gs.listed_ids(log, ["a.py::t[1]", "b.py::u"]) == ["a.py::t[1]", "b.py::u"]
    # A parameter id with a space, with and without a message; PASSED lines on request.
    spaced = ["a.py::t[x-fp32 pool]", "a.py::t[x-fp32 pool-2]"]
    lines = "FAILED a.py::t[x-fp32 pool] - KDAInputError: no\nPASSED a.py::t[x-fp32 pool-2]\n"
    assert gs.listed_ids(lines, spaced) == [spaced[0]]
    assert gs.listed_ids(lines, spaced, ("PASSED",)) == [spaced[1]]
    assert gs.summary_line(log) == "1 failed, 2 passed"
    assert gs.summary_line("3 skipped in 1.2s\n") == "3 skipped"


def write_suite(folder: Path, always_failing: bool):
    """Seven passing tests, one that fails on its first run only (as a test that breaks beside
    other processes would), and optionally one that always fails (its id holds a space)."""
    body = f"""
        import pytest
        from pathlib import Path
        pytestmark = pytest.mark.gpu
        MARK = Path({str(folder / "ran_once")!r})

        @pytest.mark.parametrize("i", range(7))
        def test_passes(i):
            pass

        def test_fails_first_time():
            first = not MARK.exists()
            MARK.touch()
            assert not first
    """
    if always_failing:
        body += """
        @pytest.mark.parametrize("pool", ["fp32 pool"])
        def test_always_fails(pool):
            assert False
        """
    (folder / "test_suite.py").write_text(textwrap.dedent(body))


@pytest.mark.parametrize("always_failing", [False, True])
def test_a_failure_is_rerun_alone_and_decides_the_status(gs, tmp_path, capsys, always_failing):
    suite = tmp_path / "suite"
    suite.mkdir()
    write_suite(suite, always_failing)
    status = gs.main([str(suite), "--shards", "3", "--out", str(tmp_path / "logs")])
    printed = capsys.readouterr().out
    assert f"{9 if always_failing else 8} tests in 3 shards" in printed
    assert "passed alone (failed beside other shards): test_suite.py::test_fails_first_time" in printed
    assert ("FAILED alone: test_suite.py::test_always_fails[fp32 pool]" in printed) == always_failing
    assert status == (1 if always_failing else 0)
    logs = {p.name for p in (tmp_path / "logs").iterdir()}
    assert logs == {"rerun.log", "shard_0.log", "shard_1.log", "shard_2.log"}
