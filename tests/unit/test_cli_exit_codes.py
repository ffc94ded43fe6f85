"""The one error-to-exit-code mapping every command line uses (``cli.common.one_line_errors``): bad input is one
line and exit code 2, a failed run its line and its own code, Ctrl-C a line and 130 where the command says what
stopping leaves; and no command of cli/ maps errors by hand. Torch-free."""

from __future__ import annotations

import ast
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from hetero_llm.cli.common import one_line_errors
from hetero_llm.errors import CheckpointError, Diverged, LayoutError, RankFailure, ScheduleError

CLI = Path(__file__).resolve().parents[2] / "hetero_llm" / "cli"


def command(error: BaseException, **mapping) -> click.Command:
    @click.command()
    def raising():
        click.echo("before")
        with one_line_errors(**mapping):
            raise error

    return raising


def run(error: BaseException, **mapping):
    return CliRunner().invoke(command(error, **mapping), [])


@pytest.mark.parametrize(
    "error, code, line",
    [
        (
            LayoutError("l.toml", "train.steps", "must be >= 1, got 0"),
            2,
            "error: l.toml: train.steps: must be >= 1, got 0",
        ),
        (CheckpointError("ckpt", "--resume", "no complete save"), 2, "error: ckpt: --resume: no complete save"),
        (RankFailure("rank 1 (n0:1) failed: boom"), 1, "error: rank 1 (n0:1) failed: boom"),
        (Diverged("training diverged at step 3"), 3, "error: training diverged at step 3"),
    ],
)
def test_library_errors_are_one_line_and_their_exit_code(error, code, line):
    result = run(error)
    assert result.exit_code == code
    assert result.stdout == "before\n"
    assert result.stderr == line + "\n"


def test_other_errors_pass_through_unless_named():
    assert isinstance(run(ValueError("no step 9")).exception, ValueError)
    named = CliRunner().invoke(_with_also(ValueError("no step 9")), [])
    assert (named.exit_code, named.stderr) == (2, "error: no step 9\n")
    schedule = CliRunner().invoke(_with_also(ScheduleError("deadlock")), [])
    assert (schedule.exit_code, schedule.stderr) == (2, "error: deadlock\n")


def _with_also(error: BaseException) -> click.Command:
    @click.command()
    def raising():
        with one_line_errors(ScheduleError, ValueError):
            raise error

    return raising


def test_a_describer_words_the_bad_input():
    @click.command()
    def raising():
        with one_line_errors(describe=lambda e: f"{e} (in the save)"):
            raise LayoutError("ckpt", "meta.json", "unreadable")

    result = CliRunner().invoke(raising, [])
    assert (result.exit_code, result.stderr) == (2, "error: ckpt: meta.json: unreadable (in the save)\n")


def test_ctrl_c_is_a_line_and_130_where_the_command_says_so():
    result = run(KeyboardInterrupt(), interrupted="interrupted: stopped every rank")
    assert (result.exit_code, result.stderr) == (130, "interrupted: stopped every rank\n")
    plain = run(KeyboardInterrupt())  # a command with nothing to say about stopping: click's own handling
    assert plain.exit_code == 1 and "interrupted" not in plain.stderr


def test_no_command_maps_errors_by_hand():
    """Every ``except LayoutError`` / ``RankFailure`` / ``KeyboardInterrupt`` of cli/ is the one in common.py."""
    by_hand = []
    for path in sorted(CLI.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ExceptHandler) and node.type is not None:
                names = {n.id for n in ast.walk(node.type) if isinstance(n, ast.Name)}
                if names & {"LayoutError", "RankFailure", "KeyboardInterrupt"} and path.name != "common.py":
                    by_hand.append(f"{path.name}:{node.lineno}")
    assert by_hand == []
