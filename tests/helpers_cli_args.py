"""Helpers shared by tests/unit/test_cli_args.py and tests/integration/test_cli_args_trained.py; not a test module."""

from __future__ import annotations

import inspect

import click
from click.testing import CliRunner

from harness import LAYOUTS

QUICKSTART = LAYOUTS / "quickstart.toml"


def invoke(command: click.Command, *args):
    """``command ARGS`` in this process, stdout and stderr apart (as harness.invoke_cli for hetero-launch)."""
    if "mix_stderr" in inspect.signature(CliRunner.__init__).parameters:
        runner = CliRunner(mix_stderr=False)
    else:
        runner = CliRunner()
    return runner.invoke(command, [str(a) for a in args])
