"""hetero-sweep: sweep files read strictly (exact one-line errors), the points of grid, zipped, conditional and drawn
axes, predict-only sweeps (invalid points, resume, shards and their merge, the report), and, with processes, a
sweep killed with SIGKILL mid-run and resumed without redoing a point, a failing point recorded as such."""

from __future__ import annotations

import random
from pathlib import Path

import attrs
import pytest
from click.testing import CliRunner
from helpers_sweep import spec

import hetero_llm as hl
from harness import LAYOUTS, ROOT, SWEEP_FILES
from hetero_llm import sweep
from hetero_llm.cli.sweep import merge_command, sweep_command
from hetero_llm.sweep import report, results
from hetero_llm.sweep.points import points
from hetero_llm.sweep.spec import AXIS_KEYS, SweepTable

QUICKSTART = LAYOUTS / "quickstart.toml"

AXES = """
[[axes]]
name = "schedule"
key = "train.schedule"
values = ["1f1b", "gpipe"]

[[axes]]
key = "pipelines[0].microbatches"
values = [2, 3, 4]
"""


def quiet(_line: str) -> None:
    pass


def test_every_shipped_sweep_file_reads_and_predicts():
    assert SWEEP_FILES
    for path in SWEEP_FILES:
        s = sweep.sweep(path, "unused", dry_run=True, say=quiet)
        assert s.checked and all(c.layout is not None for c in s.checked), path
    quick = sweep.sweep(LAYOUTS / "sweeps" / "quickstart.toml", "unused", dry_run=True, say=quiet)
    assert len(quick.checked) == 12 and len({c.hash for c in quick.checked}) == 12
    assert not Path("unused").exists()


@pytest.mark.parametrize(
    ("text", "where", "message"),
    [
        ('mode = "predict"\nmodee = 1', "sweep.modee", "unknown key 'modee' (did you mean 'mode'?)"),
        ('mode = "guess"', "sweep.mode", "unknown value 'guess' (choose one of: predict, run, both)"),
        (
            'metric = "speed"',
            "sweep.metric",
            "unknown metric 'speed' (one of step_time, tokens_per_s, loss, valid_loss, peak_memory)",
        ),
        ("timeout_s = 0", "sweep.timeout_s", "must be > 0 seconds, got 0"),
        (
            '[[axes]]\nname = "x"\nkey = "train.lr"',
            "axes[0]",
            "give exactly one of values = [...], uniform = [low, high], log_uniform = [...]",
        ),
        (
            '[[axes]]\nkey = "train.lr"\nvalues = [1, 2]\nstep = 1',
            "axes[0].step",
            "unknown key 'step' (known: name, key, values, sets, zip, when, uniform, log_uniform)",
        ),
        (
            '[[axes]]\nkey = "train.lr"\nuniform = [0.1, 0.2]',
            "axes[0]",
            "a continuous axis is drawn: set sweep.random = N points",
        ),
        (
            '[[axes]]\nkey = "a.b"\nvalues = [1, 2]\nzip = "z"\n[[axes]]\nkey = "c.d"\nvalues = [1]\nzip = "z"',
            "axes[1].values",
            "zip 'z': 1 values, but its other axes have 2",
        ),
        (
            '[[axes]]\nkey = "a.b"\nvalues = [1]\nwhen = {nope = [1]}',
            "axes[0].when.nope",
            "not another axis (axes: a.b)",
        ),
    ],
)
def test_bad_sweep_files_are_one_line(tmp_path, text, where, message):
    table, _, axes = text.partition("[[axes]]")
    path = spec(tmp_path, "[[axes]]" + axes if axes else "", table.strip() or 'mode = "predict"')
    result = CliRunner().invoke(sweep_command, [str(path), "--dry-run"])
    assert (result.exit_code, result.output) == (2, f"error: {path}: {where}: {message}\n")


def test_bad_shard_and_missing_layout(tmp_path):
    path = spec(tmp_path, AXES)
    result = CliRunner().invoke(sweep_command, [str(path), "--dry-run", "--shard", "3/3"])
    assert result.output == f"error: {path}: --shard: expected I/N with 0 <= I < N (e.g. 0/4), got '3/3'\n"
    bad = tmp_path / "b.toml"
    bad.write_text('[sweep]\nlayout = "nope.toml"\n')
    result = CliRunner().invoke(sweep_command, [str(bad)])
    assert (result.exit_code, result.output) == (
        2,
        f"error: {bad}: sweep.layout: no such file '{tmp_path / 'nope.toml'}' (paths are relative to the sweep file)\n",
    )


def test_bad_sections_out_and_slices(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text(f'[sweep]\nlayout = "{QUICKSTART}"\n[[axis]]\nkey = "train.lr"\n')
    result = CliRunner().invoke(sweep_command, [str(path)])
    assert result.output == f"error: {path}: axis: unknown section 'axis' (did you mean 'axes'?)\n"
    path.write_text("[[axes]]\nkey = 'train.lr'\nvalues = [1]\n")
    result = CliRunner().invoke(sweep_command, [str(path)])
    assert result.output == f"error: {path}: sweep: missing section (add [sweep] with layout = 'your-layout.toml')\n"
    good, file = spec(tmp_path, AXES), tmp_path / "a-file"
    file.write_text("")
    result = CliRunner().invoke(sweep_command, [str(good), "-o", str(file)])
    assert (result.exit_code, result.output) == (
        2,
        f"error: {file}: --out: is a file (name a folder for the results)\n",
    )
    result = CliRunner().invoke(merge_command, [str(good), str(tmp_path), "-o", str(tmp_path / "m")])
    assert result.output == (
        f"error: {tmp_path}: results.jsonl: no results here (pass the --out folder of a sweep or of a --shard slice)\n"
    )


def test_points_of_grid_zip_when_and_draws(tmp_path):
    grid = sweep.read_spec(spec(tmp_path, AXES))
    assert [p.values for p in points(grid)][:2] == [
        (("schedule", "1f1b"), ("pipelines[0].microbatches", 2)),
        (("schedule", "1f1b"), ("pipelines[0].microbatches", 3)),
    ]
    assert len(points(grid)) == 6
    zipped = sweep.read_spec(
        spec(
            tmp_path,
            AXES.replace("values = [2, 3, 4]", 'values = [2, 4]\nzip = "z"').replace(
                'values = ["1f1b", "gpipe"]', 'values = ["1f1b", "gpipe"]\nzip = "z"'
            ),
        )
    )
    assert [dict(p.values) for p in points(zipped)] == [
        {"schedule": "1f1b", "pipelines[0].microbatches": 2},
        {"schedule": "gpipe", "pipelines[0].microbatches": 4},
    ]
    when = sweep.read_spec(spec(tmp_path, AXES + 'when = {schedule = ["gpipe"]}'))  # microbatches vary under gpipe
    assert [dict(p.values)["pipelines[0].microbatches"] for p in points(when)] == [2, 2, 3, 4]
    drawn = spec(
        tmp_path,
        AXES + '\n[[axes]]\nkey = "train.lr"\nlog_uniform = [1e-4, 1e-2]',
        'mode = "predict"\nrandom = 5\nseed = 3',
    )
    first, again = points(sweep.read_spec(drawn)), points(sweep.read_spec(drawn))
    assert first == again and len(first) == 5
    assert all(1e-4 <= dict(p.values)["train.lr"] <= 1e-2 for p in first)
    assert all(p.sets[-1] == f"train.lr={dict(p.values)['train.lr']}" for p in first)


def test_predict_sweep_records_resumes_and_reports(tmp_path):
    """microbatches = 3 does not divide the batch: listed with its reason, recorded invalid; the others predicted,
    equal to hl.evaluate; a second call does nothing again; the best layout is the best point's."""
    path, out, lines = spec(tmp_path, AXES, 'mode = "predict"\nmetric = "step_time"'), tmp_path / "out", []
    s = sweep.sweep(path, out, say=lines.append)
    reason = "pipelines[0].microbatches: 3 microbatches do not divide the pipeline's batch 16 (use a divisor of 16)"
    assert [ln for ln in lines if ln.startswith("invalid:")] == [
        f"invalid: point {i} (schedule={sched} pipelines[0].microbatches=3): {QUICKSTART}: {reason}"
        for i, sched in ((1, "1f1b"), (4, "gpipe"))
    ]
    records = results.read(out / results.RESULTS)
    assert [(r["point"], r["status"]) for r in records] == [
        (0, "predicted"),
        (1, "invalid"),
        (2, "predicted"),
        (3, "predicted"),
        (4, "invalid"),
        (5, "predicted"),
    ]
    for r in records:
        if r["status"] == "predicted":
            pred = hl.evaluate(hl.load(QUICKSTART, r["sets"]))
            assert r["predicted"]["step_time_s"] == pred.step_time_s and r["predicted"]["memory_gb"] == list(
                pred.memory_gb
            )
            assert r["hash"] == hl.layout_hash(hl.load(QUICKSTART, r["sets"])) and r["version"] == sweep.version()
    best = min((r for r in records if r["status"] == "predicted"), key=lambda r: r["predicted"]["step_time_s"])
    assert s.best is not None and hl.layout_hash(hl.load(s.best)) == best["hash"]
    csv_rows = (out / results.CSV).read_text().splitlines()
    assert csv_rows[0].startswith("schedule,pipelines[0].microbatches,point,status,hash,") and len(csv_rows) == 7
    assert "| point | schedule | pipelines[0].microbatches |" in (out / "report.md").read_text()
    before = (out / results.RESULTS).read_bytes()
    again = sweep.sweep(path, out, say=quiet)
    assert (again.ran, again.skipped) == (0, 6) and (out / results.RESULTS).read_bytes() == before
    refuse = spec(tmp_path, AXES, 'mode = "predict"\ninvalid = "refuse"')
    result = CliRunner().invoke(sweep_command, [str(refuse), "-o", str(tmp_path / "r")])
    assert result.exit_code == 2 and result.output.splitlines()[-1] == (
        f"error: {refuse}: sweep.invalid: 2 of 6 points are invalid (first: point 1: {QUICKSTART}: {reason}); "
        "fix the axes or set invalid = 'skip'"
    )
    assert not (tmp_path / "r").exists()


def test_a_cluster_file_is_planned_first(tmp_path):
    """The base is hetero-plan's layout for the cluster file (what layouts/planned/ holds), priced on its kinds;
    a schedule the cost model does not price is recorded as such, with the reason."""
    path = tmp_path / "c.toml"
    path.write_text(
        f'[sweep]\nlayout = "{LAYOUTS / "clusters" / "small_cpu.toml"}"\nmode = "predict"\n\n'
        '[[axes]]\nkey = "train.schedule"\nvalues = ["zbh1", "dynamic"]\n'
    )
    s = sweep.sweep(path, tmp_path / "out", say=quiet)
    planned = hl.load(LAYOUTS / "planned" / "small_cpu.toml")
    assert hl.layout_hash(hl.load(tmp_path / "out" / "base.toml")) == hl.layout_hash(planned)
    zbh1, dynamic = s.records
    assert zbh1["status"] == "predicted" and zbh1["hash"] == hl.layout_hash(planned)
    assert zbh1["predicted"]["step_time_s"] == hl.evaluate(planned, LAYOUTS / "clusters" / "small_cpu.toml").step_time_s
    assert dynamic["status"] == "unpriced" and dynamic["error"].endswith(
        "train.schedule: 'dynamic' is not priced by the cost model (it prices gpipe, 1f1b, interleaved, zbh1; "
        "evaluate the layout with one of those)"
    )


def test_shards_merge_into_the_whole_sweep(tmp_path):
    path = spec(tmp_path, AXES)
    whole = sweep.sweep(path, tmp_path / "whole", say=quiet)
    for i in range(3):
        part = sweep.sweep(path, tmp_path / "all" / f"shard-{i}-of-3", shard_spec=f"{i}/3", say=quiet)
        assert [c.point.index for c in part.checked] == [i, i + 3]
    result = CliRunner().invoke(merge_command, [str(path), "-o", str(tmp_path / "all")])
    assert result.exit_code == 0, result.output
    assert results.read(tmp_path / "all" / results.RESULTS) == list(whole.records)
    assert (tmp_path / "all" / "best.toml").read_text() == (tmp_path / "whole" / "best.toml").read_text()
    result = CliRunner().invoke(merge_command, [str(path), "-o", str(tmp_path / "none")])
    assert (
        result.output == f"error: {tmp_path / 'none'}: merge: name the slices' output folders to join "
        "(hetero-sweep merge OUT A B ...)\n"
    )


def test_a_line_cut_by_a_kill_is_dropped(tmp_path):
    path = tmp_path / results.RESULTS
    results.append(path, {"point": 0})
    with open(path, "a") as f:
        f.write('{"point": 1, "sta')
    assert results.read(path) == [{"point": 0}]
    results.append(path, {"point": 2})
    assert results.read(path) == [{"point": 0}, {"point": 2}]


def test_kendall_tau_is_scipys():
    stats = pytest.importorskip("scipy.stats")
    rng = random.Random(0)
    for n in (2, 5, 30):
        xs = [rng.choice([1.0, 2.0, 3.0, rng.random()]) for _ in range(n)]
        ys = [rng.choice([1.0, rng.random()]) for _ in range(n)]
        assert report.kendall_tau(xs, ys) == pytest.approx(stats.kendalltau(xs, ys).statistic)


def test_the_console_script_and_its_merge(capsys):
    assert 'hetero-sweep = "hetero_llm.cli.sweep:main"' in (ROOT / "pyproject.toml").read_text()
    from hetero_llm.cli.sweep import main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"hetero-sweep {hl.__version__}\n"
    with pytest.raises(SystemExit) as e:
        main(["merge", "--help"])
    assert (
        e.value.code == 0 and "Usage: hetero-sweep merge [OPTIONS] SPEC.toml [SLICE_DIR]..." in capsys.readouterr().out
    )


def test_docs_name_every_key_of_a_sweep_file():
    text = (ROOT / "docs" / "api.md").read_text()
    assert all(f"`sweep.{f.name}`" in text for f in attrs.fields(SweepTable))
    assert all(f"axes[].{key}" in text or f"`{key}`" in text for key in AXIS_KEYS)
