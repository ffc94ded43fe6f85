"""What every command shares: usage errors as one line, ``error: ...``, exit code 2; the one mapping of library
errors to that line and an exit code (``one_line_errors``)."""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable, Iterator
from typing import Any

import click

from hetero_llm.errors import LayoutError, RankFailure


class _UsageLine(click.ClickException):
    exit_code = 2

    def show(self, file=None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)


class OneLineCommand(click.Command):
    """A command whose usage errors (unknown flag, bad flag value, missing argument) are one line,
    ``error: ...`` with exit code 2, like every other bad input: no usage text."""

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.UsageError as e:
            command = e.ctx.command_path if e.ctx is not None else info_name
            raise _UsageLine(f"{e.format_message().rstrip('.')} (see {command} --help)") from None


@contextlib.contextmanager
def one_line_errors(
    *also: type[Exception], interrupted: str | None = None, describe: Callable[[Any], object] = str
) -> Iterator[None]:
    """Every command's error-to-exit-code mapping: bad input (a ``LayoutError``, and the types ``also``) is one line
    ``error: ...`` (``describe`` words it) and exit code 2; a failed run (``RankFailure``) its line and its own
    code (1, Diverged 3); Ctrl-C, where the command says what stopping leaves (``interrupted``), that line and 130."""
    bad_input: tuple[type[Exception], ...] = (LayoutError, *also)
    try:
        yield
    except bad_input as e:
        click.echo(f"error: {describe(e)}", err=True)
        sys.exit(2)
    except RankFailure as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        if interrupted is None:
            raise
        click.echo(interrupted, err=True)
        sys.exit(130)


def version_option(command: str):
    """``--version``: print ``<command> <version>``, the package metadata's version (hetero_llm.__version__)."""
    import hetero_llm

    return click.version_option(
        hetero_llm.__version__,
        "--version",
        prog_name=command,
        message="%(prog)s %(version)s",
        help="Print the command's name and hetero_llm's version, and exit.",
    )


class WholeRange(click.IntRange):
    """``click.IntRange`` whose error for a word says "is not a valid integer", as ``type=int`` does."""

    name = "integer"


class FiniteFloatRange(click.FloatRange):
    """``click.FloatRange`` that also refuses nan and inf (which compare False with every bound, so pass it)."""

    def convert(self, value, param, ctx):
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return rv
