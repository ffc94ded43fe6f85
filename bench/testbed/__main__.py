"""``python -m bench.testbed ...`` (from the repository root): the testbed's command line (cli.py)."""

import sys

import click

from bench.testbed.cli import main
from bench.testbed.spec import TestbedError

if __name__ == "__main__":
    try:
        main()
    except TestbedError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
