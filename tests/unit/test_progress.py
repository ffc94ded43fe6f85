"""Long work shows progress on a terminal and stays quiet in logs: checkpoint saving, verifying and loading,
hetero-export, hetero-generate and hetero-tokenize draw a bar on stderr when it is a terminal (a pseudo-terminal
here) and print nothing of it into a pipe; every save says where it went on stdout (unless --quiet);
hetero-tokenize ends with a summary line either way."""

from __future__ import annotations

import io
import json
import re
import time

import numpy as np
import pytest
from helpers_progress import Terminal, bars, run

from harness import LAYOUTS
from hetero_llm import progress

BAR = re.compile(r"\r([^\r\n]+)")  # a line drawn over the previous one


def test_bar_redraws_one_line_on_a_terminal_and_erases_it():
    out = Terminal()
    bar = progress.Bar("copying", 4000, "B", stream=out)
    for _ in range(4):
        time.sleep(progress.INTERVAL)  # every update redraws
        bar.update(1000)
    bar.close("copied")
    text = out.getvalue()
    assert "\n" not in text[:-1] and text.endswith("\rcopied\n")
    drawn = [line.rstrip() for line in BAR.findall(text) if line.strip()][:-1]
    assert [re.match(r"copying: +(\d+)% ", line).group(1) for line in drawn] == ["25", "50", "75", "100"]
    assert all(" of 4.0 kB | " in line and re.search(r"\| ETA \d\d:\d\d:\d\d$", line) for line in drawn)
    assert drawn[-1].endswith("ETA 00:00:00")
    erase = text[: -len("\rcopied\n")].rsplit("\r", 1)[1]
    assert erase == " " * len(erase) and len(erase) >= max(map(len, drawn))  # the last bar blanked out


def test_bar_writes_only_its_summary_when_not_a_terminal():
    out = io.StringIO()
    with progress.Bar("copying", 10, stream=out) as bar:
        bar.update(10)
    assert out.getvalue() == ""
    bar = progress.Bar("copying", 10, stream=out)
    bar.update(5)
    bar.close("copied 5")
    assert out.getvalue() == "copied 5\n"


def test_a_long_bar_is_cut_to_the_terminal_width(monkeypatch):
    monkeypatch.setattr(progress, "_columns", lambda stream: 40)
    out = Terminal()
    bar = progress.Bar("verifying /a/very/long/path/to/a/checkpoint/step-000040", 10, stream=out)
    bar.update(10)  # done: drawn at once
    (line,) = BAR.findall(out.getvalue())
    assert len(line) == 39 and line.startswith("...")


@pytest.mark.parametrize("terminal", [True, False])
def test_tokenize_shows_total_and_eta_and_always_a_summary(terminal, tmp_path):
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(f'{{"text": "document {i} {"x" * (i % 50)}"}}\n' for i in range(3000)))
    out = tmp_path / "docs.bin"
    code, stdout, stderr = run(["hetero_llm.cli.tokenize", str(source), "-o", str(out)], terminal)
    assert code == 0, stderr
    count, size = len(np.fromfile(out, dtype="<u2")), source.stat().st_size
    assert stdout.startswith(f"wrote {count} tokens (uint16) to {out}")
    summary = re.compile(
        rf"tokenized {size / 1e3:.1f} kB into {count} tokens in \d\d:\d\d:\d\d \([\d.]+k? tokens/s\)\n"
    )
    if not terminal:
        assert summary.fullmatch(stderr), stderr  # nothing but the summary in a log
        return
    drawn = bars(stderr, f"tokenizing {source}:")
    assert drawn, stderr  # 3000 documents: batches of 256, each redrawn at most every INTERVAL
    for line in drawn:
        assert re.search(
            rf"\d+% [\d.]+ k?B of {size / 1e3:.1f} kB \| .* \| ETA \d\d:\d\d:\d\d \| [\d.]+k? tokens$", line
        ), line
    assert drawn[-1].startswith(f"tokenizing {source}: 100% ")
    assert summary.search(stderr.rsplit("\r", 1)[1]), stderr  # the bar erased, then the summary


@pytest.mark.parametrize("terminal", [True, False])
def test_planning_shows_plans_simulated_and_the_best_so_far_on_a_terminal_only(terminal):
    code, stdout, stderr = run(
        ["hetero_llm.cli.plan", str(LAYOUTS / "clusters" / "small_cpu.toml"), "--json"], terminal
    )
    assert code == 0, stderr
    evaluated = json.loads(stdout)["evaluated"]
    shown = bars(stderr, "planning")
    if not terminal:
        assert stderr == "" and shown == []
        return
    assert shown, stderr
    assert re.search(r"plans .*best [\d.e+-]+ s", shown[-1]), shown[-1]
    assert int(re.search(r"planning\D*(\d+)", shown[-1]).group(1)) <= evaluated
