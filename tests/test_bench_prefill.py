"""The prefill benchmark's planning and rendering (CPU): the sections it lists and the tables it
writes from a results file, so a device call is never spent on a script that cannot report."""

import importlib
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_prefill.py"
pytestmark = pytest.mark.skipif(not SCRIPT.exists(), reason="benchmarks/ is not part of the installed wheel")


def _load_script(path: Path):
    """A benchmark script imported as ``benchmarks.<name>``, as ``python -m`` runs it (the
    repository root is importable, as it is for the tests); checked to be this checkout's file."""
    module = importlib.import_module(f"benchmarks.{path.stem}")
    assert Path(module.__file__).resolve() == path.resolve(), module.__file__
    return module


@pytest.fixture(scope="module")
def bench():
    return _load_script(SCRIPT)


def test_lengths_label_run_length_encodes(bench):
    assert bench.lengths_label([8192]) == "8192"
    assert bench.lengths_label([131072] + [1024] * 5) == "131072 + 5×1024"
    assert bench.lengths_label([2048] * 4 + [128] * 16) == "4×2048 + 16×128"


def test_every_section_is_runnable_and_listed(bench, capsys):
    assert all(hasattr(bench.Bench, f"run_{section}") for section in bench.SECTIONS)
    bench.dry_run(list(bench.SECTIONS))
    listed = capsys.readouterr().out
    assert all(f"{section}:" in listed for section in ("spec", "serving", "cp", "cp_long", "cp_sweep"))


def test_split_tables_render_from_results(bench):
    rows = [
        {
            "H": 8,
            "lengths": [4096],
            "GB": 0.05,
            "serial_graph_ms": 0.16,
            "auto_split": 8,
            **{f"cp_{s}_graph_ms": 0.1 + 0.01 * i for i, s in enumerate(bench.CP_SWEEP_SPLITS)},
        }
    ]
    res = {
        "meta": {"copy_bandwidth_Bps": 4e12},
        "errors": [],
        "cp_sweep": rows,
        "cp_long": [{**rows[0], "lengths": [131072] + [1024] * 5}],
    }
    text = bench.render_markdown(json.loads(json.dumps(res)))
    assert "## Planner sweep" in text and "## Long contexts" in text and "131072 + 5×1024" in text
    sweep_line = next(line for line in text.splitlines() if line.startswith("| 8 | 4096 |"))
    # serial ÷ best CP = 0.16 / 0.10; auto (the last split) ÷ best = 0.15 / 0.10.
    assert "1.60x" in sweep_line and "1.50x" in sweep_line


AB_SCRIPT = ROOT / "benchmarks" / "ab_prefill.py"


@pytest.fixture(scope="module")
def ab():
    return _load_script(AB_SCRIPT)


def test_ab_arm_syntax(ab):
    assert ab.parse_arm("main=../wt") == ("main", "../wt", None)
    assert ab.parse_arm("new=.@/tmp/ab_new") == ("new", ".", "/tmp/ab_new")
    with pytest.raises(Exception, match="NAME=TREE"):
        ab.parse_arm("justapath")


def test_ab_runs_each_arm_per_round_and_compares_graph_times(ab, tmp_path):
    # Two fake trees whose "benchmark" writes a cp row with a known graph time and records the
    # order it ran in and the artifacts it was pointed at; run as ``-m benchmarks.bench_prefill``
    # in either layout: a package (b) or a plain folder of scripts, as older trees have (a).
    log = tmp_path / "order.txt"
    for name, ms in (("a", 0.2), ("b", 0.1)):
        script = tmp_path / name / "benchmarks" / "bench_prefill.py"
        script.parent.mkdir(parents=True)
        if name == "b":
            (script.parent / "__init__.py").write_text("")
        script.write_text(
            "import json, os, sys\n"
            f"open({str(log)!r}, 'a').write({name!r} + ':' + os.environ.get('CULA_AOT_ARTIFACTS', '-') + '\\n')\n"
            "path = sys.argv[sys.argv.index('--json') + 1]\n"
            f"json.dump({{'cp': [{{'H': 4, 'lengths': [8192], 'cp_auto_graph_ms': {ms}, 'cp_4_ms': 1.0}}]}},"
            " open(path, 'w'))\n"
        )
    out = tmp_path / "out"
    ab.main(
        [
            "--arm",
            f"a={tmp_path / 'a'}",
            "--arm",
            f"b={tmp_path / 'b'}@{tmp_path}",
            "--rounds",
            "2",
            "--out",
            str(out),
            "--",
            "--only",
            "cp",
        ]
    )
    ran = log.read_text().split()
    assert [r.split(":")[0] for r in ran] == ["a", "b", "a", "b"]  # alternated
    assert ran[0].endswith(":-") and ran[1].endswith(f":{tmp_path}")
    assert sorted(p.name for p in out.iterdir()) == ["a.json", "b.json", "summary.md"]
    assert [r["cp"][0]["cp_auto_graph_ms"] for r in json.loads((out / "b.json").read_text())["rounds"]] == [0.1, 0.1]
    row = next(line for line in (out / "summary.md").read_text().splitlines() if "cp_auto_graph_ms" in line)
    assert "0.2000" in row and "0.1000" in row and "0.500" in row  # b ÷ a; eager cp_4_ms is not listed


def test_ab_labels_the_gate_and_checkpoint_rows(ab):
    result = {
        "gates": [
            {"H": 12, "workload": "1x8192", "gate": g, "ours_graph_ms": ms}
            for g, ms in (("safe", 0.2), ("softplus", 0.21))
        ],
        "checkpoints": [
            {
                "source": "serving",
                "H": 16,
                "workload": "8x1024",
                "plain_graph_ms": 0.1,
                "checkpoint_1024_graph_ms": 0.105,
                "checkpoint_1024_ratio": 1.05,
            }
        ],
    }
    timings = ab.graph_timings(result)
    assert timings[("gates", "workload=1x8192 H=12 gate=softplus", "ours_graph_ms")] == 0.21
    assert timings[("checkpoints", "source=serving workload=8x1024 H=16", "checkpoint_1024_graph_ms")] == 0.105
    assert len(timings) == 4  # graph times only: the ratio is derived


def test_checkpoint_kernel_cases_share_one_schedule(bench):
    ck = _load_script(ROOT / "benchmarks" / "checkpoint_kernels.py")
    x = bench.make_inputs(2, 2, None, 2048, "cpu")
    plain, written, skipped = ck.cases(x, 1024).values()
    assert plain == {} and written["checkpoint_every"] == skipped["checkpoint_every"] == 1024
    assert written["checkpoint_indices"].tolist() == [[0, 1], [2, 3]]  # two per sequence, own slots
    assert (skipped["checkpoint_indices"] == -1).all() and skipped["checkpoint_pool"] is written["checkpoint_pool"]
    assert any(fused for *_, fused, _ in ck.ROWS) and not all(fused for *_, fused, _ in ck.ROWS)
    # The serial K2 rows come as both cubins: fixed-length and varlen (the benchmark's serving rows).
    fixed = {(h, b, n) for h, b, n, fused, varlen in ck.ROWS if not fused and not varlen}
    varlen = {(h, b, n) for h, b, n, fused, varlen in ck.ROWS if not fused and varlen}
    assert fixed & varlen


def test_shards_only_keeps_the_production_shards_first(bench, capsys):
    shards = bench.gate_workloads(True)
    assert [(h, label) for h, label, _ in shards] == [
        (12, "1x2048"),
        (12, "1x8192"),
        (16, "1x8192"),
        (24, "1x8192"),
        (32, "1x8192"),
        (16, "8x2048"),
    ]
    assert bench.gate_workloads(False)[: len(shards)] == shards
    args = bench.parse_args(["--only", "gates", "--shards-only", "--dry-run"])
    bench.dry_run(args.sections, args.shards_only)
    assert capsys.readouterr().out.count("gates: ") == len(shards)


def test_gates_table_shows_the_best_forced_split(bench):
    row = {
        "H": 12,
        "workload": "1x2048",
        "gate": "safe",
        "ours_graph_ms": 0.09,
        "cp_auto_graph_ms": 0.09,
        "auto_split": 1,
        "fla_graph_ms": 0.15,
        "cp_2_graph_ms": 0.07,
        "cp_4_graph_ms": 0.06,
        "cp_8_graph_ms": 0.065,
    }
    text = bench.render_markdown({"meta": {"copy_bandwidth_Bps": 4e12}, "errors": [], "gates": [row]})
    line = next(line for line in text.splitlines() if line.startswith("| 12 | 1x2048"))
    assert "0.0600 (s=4)" in line and "0.60x" in line  # forced splits are data, not the auto pick


def test_cp_fit_reads_the_planner_data_and_restores_the_constants():
    fit = _load_script(ROOT / "benchmarks" / "fit_cp_plan.py")
    sweep = json.loads((ROOT / "docs" / "bench" / "cp_sweep.json").read_text())
    gates = {
        "gates": [
            {"H": 12, "lengths": [2048], "ours_graph_ms": 0.09, "cp_2_graph_ms": 0.08, "cp_4_graph_ms": 0.06},
            {"H": 12, "lengths": [2048], "ours_graph_ms": 0.09},
        ]
    }
    rows = fit.measured_rows([sweep, gates])
    assert len(rows) == len(sweep["cp_sweep"]) + 1  # a gates row gives its forced splits only
    assert rows[-1] == (12, [2048], {2: 0.08, 4: 0.06})
    worst, _, _ = fit.score(rows[:-1])
    assert worst < 1.01  # the shipped constants pick the fastest split on their own sweep
    before = fit.cp_plan.OVERHEAD
    with fit.constants(OVERHEAD=1.0):
        assert fit.cp_plan.OVERHEAD == 1.0
        assert fit.picks(rows[-1:])[0][2] > 1  # no fixed cost: the short prompt splits
    assert fit.cp_plan.OVERHEAD == before
