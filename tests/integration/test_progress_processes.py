"""The tests of tests/unit/test_progress.py that start processes or train for real (the integration tier).

Long work shows progress on a terminal and stays quiet in logs: checkpoint saving, verifying and loading,
hetero-export, hetero-generate and hetero-tokenize draw a bar on stderr when it is a terminal (a pseudo-terminal
here) and print nothing of it into a pipe; every save says where it went on stdout (unless --quiet);
hetero-tokenize ends with a summary line either way."""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path

import pytest
from helpers_progress import Terminal, bars, run

from harness import LAYOUTS, common_sections, free_port, write_layout
from hetero_llm.checkpoint import folders

BAR = re.compile(r"\r([^\r\n]+)")  # a line drawn over the previous one

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
