"""Schedule files: user-written schedules as text or CSV, lowered or kept, and every error in them located."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hetero_llm.errors import ScheduleError
from hetero_llm.schedule import build, format_actions, interleaved_1f1b, load_schedule_file, lower, parse_actions

# --------------------------------------------------------------------------- schedule files


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_load_text_compute_only_is_lowered(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "sched.txt",
        """\
# 1F1B on two stages, three microbatches
F0 F1 B0 F2 B1 B2   # stage 0

F0 B0 F1 B1 F2 B2
""",
    )
    assert load_schedule_file(path, 2, 3) == build("1f1b", 2, 3)


def test_load_text_lowered_is_kept(tmp_path: Path) -> None:
    lowered = build("gpipe", 3, 2)
    text = "\n".join(format_actions(actions) for actions in lowered) + "\n"
    assert load_schedule_file(write(tmp_path, "lowered.sched", text), 3, 2) == lowered


def test_load_interleaved_text(tmp_path: Path) -> None:
    compute = interleaved_1f1b(2, 4, 2)
    text = "\n".join(format_actions(actions) for actions in compute)
    loaded = load_schedule_file(write(tmp_path, "interleaved.txt", text), 2, 4)
    assert loaded == build("interleaved", 2, 4, chunks=2)


def test_load_csv(tmp_path: Path) -> None:
    # Uneven columns: the grid format_grid prints, as CSV; a comment line in between.
    path = write(
        tmp_path,
        "sched.csv",
        """\
stage 0,stage 1
F0,F0
F1,B0
# the steady state
B0,F1
B1,B1
""",
    )
    assert load_schedule_file(path, 2, 2) == lower([parse_actions("F0 F1 B0 B1"), parse_actions("F0 B0 F1 B1")])
    uneven = write(tmp_path, "uneven.txt", "stage 0, stage 1\nF0,RECV_F0\nSEND_F0,F0\nRECV_B0,B0\nB0,SEND_B0\n")
    assert load_schedule_file(uneven, 2, 1) == build("gpipe", 2, 1)


@pytest.mark.parametrize(
    "name, text, stages, mbs, error",
    [
        ("a.txt", "F0 B0\nF0 X1 B0\n", 2, 1, r"^a.txt: line 2: stage 1 action 1: bad action 'X1': expected KIND"),
        (
            "a.txt",
            "# two lines for three stages\nF0 B0\n\nF0 B0\n",
            3,
            1,
            r"^a.txt: line 4: 2 stage lines, expected 3 \(one line of space-separated actions per stage\)",
        ),
        ("a.txt", "F0 B0\nF0 B0\nF0 B0\n", 2, 1, r"^a.txt: line 3: 3 stage lines, expected 2"),
        (
            "a.txt",
            "F0 F1 B0 B1\nF0 F1 B0\n",
            2,
            2,
            r"^a.txt: line 2: stage 1 is missing B1 \(every stage runs F and B \(or I and W\) exactly once",
        ),
        (
            "a.txt",
            "F0 B0\nF0 B0 F1 B1\n",
            2,
            1,
            r"^a.txt: line 2: stage 1 step 2: F1 names microbatch 1, but there are 1 \(0..0\)",
        ),
        (
            "a.txt",
            "F0 B0 B1 F1\nF0 B0 F1 B1\n",
            2,
            2,
            r"^a.txt: line 1: stage 0 step 2: B1 needs F1 first, but F1 comes later \(step 3\)",
        ),
        (
            "a.txt",
            "F0 SEND_F0 RECV_B0 B0\nF0 B0 SEND_B0\n",
            2,
            1,
            r"^a.txt: line 1: stage 0 step 1: SEND_F0 has no matching RECV_F0 on stage 1",
        ),
        (
            "dead.txt",
            "F0 RECV_B0 SEND_F0 B0\nRECV_F0 F0 B0 SEND_B0\n",
            2,
            1,
            r"^dead.txt: line 1: deadlock: stage 0 waits at RECV_B0 \(step 1\) for SEND_B0 on stage 1",
        ),
        ("empty.txt", "# nothing\n\n", 2, 1, r"^empty.txt: no actions \(expected one line per stage, 2 stages\)"),
        (
            "b.csv",
            "stage 0,stage 2\nF0,F0\n",
            2,
            1,
            r"^b.csv: line 1: header 'stage 0,stage 2', expected 'stage 0,stage 1' \(one column per stage\)",
        ),
        ("b.csv", "stage 0,stage 1\nF0,F0,F0\n", 2, 1, r"^b.csv: line 2: 3 cells, but the header has 2 stages"),
        ("b.csv", "stage 0,stage 1\nF0,F0\nB0,F1\n", 2, 1, r"^b.csv: line 3: stage 1 step 1: F1 names microbatch 1"),
        ("b.csv", "stage 0,stage 1\nF0,F0\nB0,\n", 2, 1, r"^b.csv: line 1: stage 1 is missing B0"),
        ("b.csv", "stage 0,stage 1\nF0,F0\nB0,B-1\n", 2, 1, r"^b.csv: line 3: stage 1: bad action 'B-1'"),
        (
            "b.csv",
            "stage 0,stage 1\nF0,B0\nB0,F0\n",
            2,
            1,
            r"^b.csv: line 2: stage 1 step 0: B0 needs F0 first, but F0 comes later \(step 1\)",
        ),
    ],
)
def test_load_schedule_file_errors(tmp_path: Path, name: str, text: str, stages: int, mbs: int, error: str) -> None:
    path = write(tmp_path, name, text)
    with pytest.raises(ScheduleError, match=error.replace("^", "^" + re.escape(str(tmp_path) + "/"), 1)):
        load_schedule_file(path, stages, mbs)


def test_load_schedule_file_error_keeps_the_grid(tmp_path: Path) -> None:
    path = write(tmp_path, "dead.txt", "F0 RECV_B0 SEND_F0 B0\nRECV_F0 F0 B0 SEND_B0\n")
    with pytest.raises(ScheduleError) as info:
        load_schedule_file(path, 2, 1)
    lines = str(info.value).splitlines()
    assert lines[1].split() == ["step", "stage", "0", "stage", "1"]
    assert "RECV_B0 <-- ERROR HERE" in lines[3]


def test_load_schedule_file_missing(tmp_path: Path) -> None:
    with pytest.raises(ScheduleError, match=r"nope.txt: cannot read schedule file: No such file"):
        load_schedule_file(tmp_path / "nope.txt", 2, 1)
