"""What every command shares: usage errors as one line, ``error: ...``, exit code 2."""

from __future__ import annotations

import click


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
