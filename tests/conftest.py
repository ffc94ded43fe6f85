"""Suite hygiene. Failure tests make ranks fail on purpose, and the launcher keeps a failed job's report
folder (``$TMPDIR/hetero_llm_errors_*``, named in the job's error line) for its user: the suite removes the
ones it made, so test runs leave nothing behind in /tmp."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def _remove_failure_reports_made_by_the_suite():
    tmp = Path(tempfile.gettempdir())
    before = set(tmp.glob("hetero_llm_errors_*"))
    yield
    for folder in set(tmp.glob("hetero_llm_errors_*")) - before:
        shutil.rmtree(folder, ignore_errors=True)
