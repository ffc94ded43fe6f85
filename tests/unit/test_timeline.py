"""Timelines: rank trace files -> Chrome/Perfetto JSON and PNG; simulated timelines; the CLI."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner
from helpers_timeline import assert_png

from hetero_llm.cli.timeline import main
from hetero_llm.predict import trace as tracing
from hetero_llm.predict.simulate import CostModel, simulate
from hetero_llm.predict.timeline import plot_timeline
from hetero_llm.schedule import build

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def fake_rank_plans(num_ranks: int) -> list[SimpleNamespace]:
    """What the trace writers read of a RankPlan: the rank, the world size, its pipeline, stage and device."""
    return [
        SimpleNamespace(
            rank=rank, world_size=num_ranks, info=SimpleNamespace(pipeline=0, stage=rank, device_id=f"node0:{rank}")
        )
        for rank in range(num_ranks)
    ]


@pytest.fixture
def trace_dir(tmp_path: Path) -> Path:
    """Three ranks, two steps of 1F1B, timed by the simulator and shifted like perf_counter times."""
    directory = tmp_path / "trace"
    result = simulate(build("1f1b", 3, 4), CostModel.uniform(3, 0.001, 0.002, latency=0.0002))
    plans = fake_rank_plans(3)
    for rank, row in enumerate(result.rows()):
        events = []
        for step in range(2):
            offset = 1000.0 + step * (result.step_time + 0.005)
            events += [(action, offset + start, offset + end) for action, start, end in row]
        tracing.write_rank_trace(str(directory), plans[rank], events)  # type: ignore[arg-type]
    return directory


def test_chrome_trace_has_a_row_per_rank(trace_dir: Path) -> None:
    merged = tracing.chrome_trace(str(trace_dir))
    events = merged["traceEvents"]
    names = [e for e in events if e["ph"] == "M" and e["name"] == "thread_name"]
    assert [e["args"]["name"] for e in names] == [
        "rank 0 (node0:0, p0.s0)",
        "rank 1 (node0:1, p0.s1)",
        "rank 2 (node0:2, p0.s2)",
    ]
    assert sorted(e["tid"] for e in names) == [0, 1, 2]
    complete = [e for e in events if e["ph"] == "X"]
    per_rank = [len(actions) * 2 for actions in build("1f1b", 3, 4)]
    assert [sum(e["tid"] == tid for e in complete) for tid in range(3)] == per_rank
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in complete)
    assert min(e["ts"] for e in complete) == 0
    assert {e["cat"] for e in complete} == {"F", "B", "SEND_F", "RECV_F", "SEND_B", "RECV_B"}
    json.dumps(merged)  # serializable as is


def test_read_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no rank\\*.json trace files"):
        tracing.read_rank_traces(tmp_path)
    (tmp_path / "rank0.json").write_text("{not json")
    with pytest.raises(ValueError, match="rank0.json: not JSON"):
        tracing.read_rank_traces(tmp_path)
    (tmp_path / "rank0.json").write_text('{"rank": 0}')
    with pytest.raises(ValueError, match="needs the keys 'rank' and 'events'"):
        tracing.read_rank_traces(tmp_path)


def test_streamed_trace_reads_like_a_whole_one(tmp_path: Path, trace_dir: Path, monkeypatch) -> None:
    """``RankTraceWriter`` lines read back as the records ``write_rank_trace`` writes; a torn last line
    (a job killed mid-write) is dropped, a torn line elsewhere is an error."""
    monkeypatch.setattr(tracing, "FLUSH_S", 0.02)  # the fixture's steps are 0.05 s apart
    whole = tracing.read_rank_traces(trace_dir)
    streamed = tmp_path / "streamed"
    plans = fake_rank_plans(3)
    for record in whole:
        writer = tracing.RankTraceWriter(str(streamed), plans[record["rank"]])  # type: ignore[arg-type]
        for ev in record["events"]:
            writer.append((ev["action"], ev["start"], ev["end"]))
        writer.close()
    assert tracing.read_rank_traces(streamed) == whole
    assert sorted(p.name for p in streamed.iterdir()) == ["rank0.jsonl", "rank1.jsonl", "rank2.jsonl"]

    path = streamed / "rank0.jsonl"
    lines = path.read_text().splitlines()
    assert len(lines) > 2  # the header and more than one line of events: written as it went
    path.write_text("\n".join(lines) + '\n{"events": [["F0", 1.0')
    assert tracing.read_rank_traces(streamed) == whole
    path.write_text("\n".join([lines[0], '{"events": [', *lines[1:]]) + "\n")
    with pytest.raises(ValueError, match="rank0.jsonl: line 2 is not JSON"):
        tracing.read_rank_traces(streamed)


def test_trace_writer_removes_an_earlier_runs_files(tmp_path: Path, trace_dir: Path) -> None:
    """Rank 0 removes rank files past this run's world size; each rank its own old whole-run file."""
    for rp in fake_rank_plans(2):
        tracing.RankTraceWriter(str(trace_dir), rp).close()  # type: ignore[arg-type]
    assert sorted(p.name for p in trace_dir.iterdir()) == ["rank0.jsonl", "rank1.jsonl"]
    (trace_dir / "rank1.json").write_text('{"rank": 1, "events": []}')
    with pytest.raises(ValueError, match="two trace files of rank 1"):
        tracing.read_rank_traces(trace_dir)


def test_split_steps() -> None:
    row = [("F0", 0, 1), ("B0", 1, 2), ("F0", 5, 6), ("B0", 6, 7), ("F0", 9, 9.5)]
    assert tracing.split_steps(row) == [row[:2], row[2:4], row[4:]]
    assert tracing.split_steps([]) == []
    # a later stage: each receive recorded when posted and when waited for; they open the step they feed
    step = [
        ("RECV_F0", 0, 1),
        ("RECV_F0", 1, 2),
        ("F0", 2, 3),
        ("RECV_F1", 3, 4),
        ("RECV_B0", 4, 5),
        ("RECV_F1", 5, 6),
        ("F1", 6, 7),
        ("B0", 7, 8),
    ]
    later = [(a, s + 10, e + 10) for a, s, e in step]
    assert tracing.split_steps(step + later) == [step, later]
    assert tracing.action_kind("SEND_F3.1") == "SEND_F"
    assert tracing.action_kind("W12") == "W"


def test_plot_measured_and_simulated(tmp_path: Path, trace_dir: Path) -> None:
    labels, rows = tracing.rank_rows(tracing.read_rank_traces(trace_dir))
    assert_png(plot_timeline(rows, tmp_path / "measured.png", "measured", labels=labels))
    result = simulate(build("interleaved", 4, 8, chunks=2), CostModel.uniform(4, 0.001, 0.002))
    assert_png(plot_timeline(result.rows(), tmp_path / "sub" / "simulated.png", "simulated"))
    with pytest.raises(ValueError, match="2 labels for 4 rows"):
        plot_timeline(result.rows(), tmp_path / "x.png", labels=["a", "b"])


def test_cli_trace_dir(tmp_path: Path, trace_dir: Path) -> None:
    out, chrome = tmp_path / "timeline.png", tmp_path / "trace.json"
    result = CliRunner().invoke(main, [str(trace_dir), "--out", str(out), "--chrome", str(chrome)])
    assert result.exit_code == 0, result.output
    assert f"wrote {chrome}" in result.output and f"wrote {out}" in result.output
    assert_png(out)
    merged = json.loads(chrome.read_text())
    assert sum(e["name"] == "thread_name" for e in merged["traceEvents"]) == 3
    assert all(e["dur"] >= 0 for e in merged["traceEvents"] if e["ph"] == "X")

    last = tmp_path / "last.png"
    result = CliRunner().invoke(main, [str(trace_dir), "--step", "-1", "--out", str(last)])
    assert result.exit_code == 0, result.output
    assert_png(last)
    result = CliRunner().invoke(main, [str(trace_dir), "--step", "5", "--out", str(last)])
    assert result.exit_code == 2
    assert "error: rank 0 (node0:0, p0.s0): no step 5 (the trace has 2 steps)" in result.output


def test_cli_simulate(tmp_path: Path) -> None:
    out, chrome = tmp_path / "sim.png", tmp_path / "sim.json"
    args = [
        "--simulate",
        "--stages",
        "4",
        "--microbatches",
        "8",
        "--schedule",
        "1f1b",
        "--out",
        str(out),
        "--chrome",
        str(chrome),
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert result.output.startswith("step time 33.000 ms, mean bubble 27.3%")
    assert_png(out)
    assert sum(e["name"] == "thread_name" for e in json.loads(chrome.read_text())["traceEvents"]) == 4


def test_cli_simulate_zero_bubble(tmp_path: Path) -> None:
    out = tmp_path / "zb.png"
    args = ["--simulate", "--stages", "4", "--microbatches", "8", "--schedule", "zbh1", "--out", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    # F = 1, I = W = 1 ms (half the backward): 3M + S - 1, against 1F1B's 3(M + S - 1) = 33 ms above
    assert result.output.startswith("step time 27.000 ms, mean bubble 11.1%")
    assert_png(out)


def test_cli_simulate_schedule_file(tmp_path: Path) -> None:
    path = tmp_path / "mine.txt"
    path.write_text("F0 F1 B0 F2 B1 B2\nF0 B0 F1 B1 F2 B2\n")
    out = tmp_path / "mine.png"
    args = ["--simulate", "--stages", "2", "--microbatches", "3", "--schedule-file", str(path), "--out", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert result.output.startswith("step time 12.000 ms")  # (M + S - 1)(1 ms + 2 ms)
    assert_png(out)


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["--simulate"], 2, "nothing to write"),
        (["--out", "x.png"], 2, "give either TRACE_DIR or --simulate"),
        (["missing_dir", "--out", "x.png"], 2, "error: missing_dir: no rank*.json trace files"),
        (
            ["--simulate", "--schedule", "interleaved", "--microbatches", "6", "--out", "x.png"],
            2,
            "error: interleaved 1F1B needs num_microbatches to be a multiple of num_stages",
        ),
        (
            ["--simulate", "--schedule", "zbh1", "--weight-ms", "5", "--out", "x.png"],
            2,
            "error: CostModel.weight[0] = 0.005 s exceeds backward[0] = 0.002 s",
        ),
        (
            [
                "--simulate",
                "--stages",
                "2",
                "--microbatches",
                "3",
                "--schedule-file",
                "order.txt",
                "--chrome",
                "order.txt",
            ],
            2,
            "error: order.txt: --chrome: would overwrite --schedule-file 'order.txt', an input of "
            "this run (give another path)\n",
        ),
        (
            ["--simulate", "--out", "order.txt/x.png"],
            2,
            "error: order.txt/x.png: --out: '{cwd}/order.txt' is a file, so no folder can be made under it "
            "(give another path)\n",
        ),
        (
            ["--simulate", "--stages", "two", "--out", "x.png"],
            2,
            "error: Invalid value for '--stages': 'two' is not a valid integer (see python -m hetero_llm.timeline --help)\n",
        ),
    ],
)
def test_cli_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], code: int, message: str) -> None:
    monkeypatch.chdir(tmp_path)  # relative paths (x.png, missing_dir) land in the test's own folder
    (tmp_path / "order.txt").write_text("F0 F1 F2 B0 B1 B2\nF0 B0 F1 B1 F2 B2\n")
    result = CliRunner().invoke(main, args)
    assert result.exit_code == code
    message = message.replace("{cwd}", str(tmp_path))
    assert result.output == message if message.endswith("\n") else message in result.output
    assert (tmp_path / "order.txt").read_text() == "F0 F1 F2 B0 B1 B2\nF0 B0 F1 B1 F2 B2\n"


def test_hot_switches_have_their_own_colour() -> None:
    from hetero_llm.predict.timeline import COLORS, _category

    assert _category("SWITCH>b1") == ("SWITCH", None, 0) and _category("SWITCH>home")[0] == "SWITCH"
    assert COLORS["SWITCH"] not in {c for k, c in COLORS.items() if k != "SWITCH"}
