"""Long work shows progress on a terminal and stays quiet in logs: checkpoint saving, verifying and loading,
hetero-export, hetero-generate and hetero-tokenize draw a bar on stderr when it is a terminal (a pseudo-terminal
here) and print nothing of it into a pipe; every save says where it went on stdout (unless --quiet);
hetero-tokenize ends with a summary line either way."""

from __future__ import annotations

import io
import json
import os
import pty
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from harness import LAYOUTS, ROOT, common_sections, free_port, write_layout
from hetero_llm import progress
from hetero_llm.checkpoint import folders

BAR = re.compile(r"\r([^\r\n]+)")  # a line drawn over the previous one


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def run(args: list[str], terminal: bool, cwd: Path | None = None) -> tuple[int, str, str]:
    """``python -m args`` with stderr on a pseudo-terminal (``terminal``) or a pipe: (exit code, stdout, stderr)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", *args]
    if not terminal:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=cwd)
        return proc.returncode, proc.stdout, proc.stderr
    leader, follower = pty.openpty()
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(leader, 1 << 16)
            except OSError:  # EIO: every holder of the terminal's other end has closed it
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain)
    reader.start()
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=follower, text=True, timeout=240, env=env, cwd=cwd)
    finally:
        os.close(follower)
        reader.join(timeout=10)
        os.close(leader)
    # the terminal turns each "\n" into "\r\n" (onlcr); the bars' own "\r" stay
    return proc.returncode, proc.stdout, b"".join(chunks).decode().replace("\r\n", "\n")


def bars(stderr: str, desc: str) -> list[str]:
    return [line.rstrip() for line in BAR.findall(stderr) if line.startswith(desc)]


# ------------------------------------------------------------------------------------------
# The bar itself


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


# ------------------------------------------------------------------------------------------
# hetero-tokenize: a bar with the input's size and an ETA on a terminal, a summary line either way


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


# ------------------------------------------------------------------------------------------
# Training: every save says where it went; on a terminal, saving, verifying and loading show bars


ONE_RANK = common_sections(LAYOUTS / "reference" / "reference.toml").replace("steps = 3", "steps = 4")


def launch_args(layout: Path, *extra: str) -> list[str]:
    return ["hetero_llm.cli", str(layout), "--set", f"cluster.port={free_port()}", *extra]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, Path, str, str]:
    """A 4-step one-rank run saving at steps 2 and 4, its stderr on a terminal: (layout, checkpoint, stdout, stderr)."""
    d = tmp_path_factory.mktemp("saves")
    layout = write_layout(d / "layout.toml", ONE_RANK, [(12, 3, [(6, 1)])])
    code, stdout, stderr = run(launch_args(layout, "--checkpoint", str(d / "ckpt"), "--checkpoint-every", "2"), True)
    assert code == 0, stdout + stderr
    return layout, d / "ckpt", stdout, stderr


def megabytes(folder: Path) -> str:
    size = sum(f.stat().st_size for f in folder.glob("rank*.pt"))
    assert 1e6 <= size < 1e9  # the reference model's save: its AdamW moments and parameters
    return f"{size / 1e6:.1f} MB"


@pytest.mark.multiprocess
def test_every_save_prints_its_folder_and_shows_a_bar_on_a_terminal(saved):
    layout, ckpt, stdout, stderr = saved
    said = [line for line in stdout.splitlines() if line.startswith("saved ")]
    assert said == [f"saved {folders.step_folder(ckpt, n)} (step {n} of 4)" for n in (2, 4)]
    for n in (2, 4):  # each line names a complete save of that step
        assert folders.find(folders.step_folder(ckpt, n)).step == n
        drawn = bars(stderr, f"saving {folders.step_folder(ckpt, n)}:")
        assert drawn and drawn[-1].startswith(f"saving {folders.step_folder(ckpt, n)}: 100% "), stderr


@pytest.mark.multiprocess
def test_resuming_shows_verifying_and_loading_on_a_terminal(saved, tmp_path):
    layout, ckpt, _, _ = saved
    step2 = folders.step_folder(ckpt, 2)
    code, stdout, stderr = run(launch_args(layout, "--resume", str(step2), "--checkpoint", str(tmp_path)), True)
    assert code == 0, stdout + stderr
    for desc in (f"verifying {step2}:", f"loading {step2}:"):  # every byte of the save checked, every file read
        drawn = bars(stderr, desc)
        assert drawn and drawn[-1].startswith(f"{desc} 100% {megabytes(step2)} of {megabytes(step2)} |"), stderr
    assert bars(stderr, f"saving {folders.step_folder(tmp_path, 4)}: 100% "), stderr


@pytest.mark.multiprocess
def test_a_log_gets_the_save_lines_and_no_bars(saved, tmp_path):
    layout, ckpt, _, _ = saved
    code, stdout, stderr = run(
        launch_args(
            layout,
            "--resume",
            str(folders.step_folder(ckpt, 2)),
            "--checkpoint",
            str(tmp_path),
            "--checkpoint-every",
            "1",
        ),
        False,
    )
    assert code == 0 and stderr == "", stderr  # verifying, loading and two saves: none drawn
    assert [line for line in stdout.splitlines() if line.startswith("saved ")] == [
        f"saved {folders.step_folder(tmp_path, n)} (step {n} of 4)" for n in (3, 4)
    ]


@pytest.mark.multiprocess
def test_quiet_shows_no_bars_and_no_save_lines_even_on_a_terminal(saved, tmp_path):
    layout, ckpt, _, _ = saved
    code, stdout, stderr = run(
        launch_args(layout, "--resume", str(folders.step_folder(ckpt, 2)), "--checkpoint", str(tmp_path), "--quiet"),
        True,
    )
    assert (code, stdout, stderr) == (0, "", ""), stdout + stderr
    assert folders.find(tmp_path).step == 4


# ------------------------------------------------------------------------------------------
# hetero-generate and hetero-export (in this process, stderr a terminal or a log)


def command(main, args: list[str], stderr: io.StringIO, monkeypatch, capsys) -> str:
    """Run a click command in this process with ``stderr`` as sys.stderr; return what it printed on stdout."""
    monkeypatch.setattr(sys, "stderr", stderr)
    main.main(args, standalone_mode=False)
    return capsys.readouterr().out


@pytest.mark.multiprocess
def test_generate_shows_tokens_generated_on_a_terminal_only(saved, monkeypatch, capsys):
    from hetero_llm.cli import generate

    ckpt = saved[1]
    args = [str(ckpt), "--prompt", "1 2 3", "--max-new-tokens", "8"]
    terminal = Terminal()
    stdout = command(generate.main, args, terminal, monkeypatch, capsys)
    assert len(stdout.split()) == 3 + 8  # the grammar's ids: the prompt and 8 new ones
    drawn = bars(terminal.getvalue(), "generating:")
    assert drawn and re.match(r"generating: 100% 8 tok of 8 tok \| ", drawn[-1]), terminal.getvalue()
    assert bars(terminal.getvalue(), f"loading {folders.find(ckpt).path}: 100% "), terminal.getvalue()
    log = io.StringIO()
    assert command(generate.main, args, log, monkeypatch, capsys) == stdout and log.getvalue() == ""


@pytest.mark.multiprocess
def test_export_shows_loading_on_a_terminal_only(saved, tmp_path, monkeypatch, capsys):
    pytest.importorskip("safetensors", reason="the 'hf' extra installs safetensors")
    from hetero_llm.cli import export

    ckpt = saved[1]
    terminal = Terminal()
    assert command(export.main, [str(ckpt), "--hf", str(tmp_path / "a")], terminal, monkeypatch, capsys).startswith(
        f"wrote {tmp_path / 'a'}"
    )
    assert bars(terminal.getvalue(), f"loading {folders.find(ckpt).path}: 100% "), terminal.getvalue()
    log = io.StringIO()
    command(export.main, [str(ckpt), "--hf", str(tmp_path / "b")], log, monkeypatch, capsys)
    assert log.getvalue() == "" and (tmp_path / "b" / "config.json").exists()


# ------------------------------------------------------------------------------------------
# hetero-plan: the plans simulated of the work budget, and the best so far


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
