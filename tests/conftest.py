"""Suite hygiene: test runs leave nothing behind in /tmp.

Failure tests make ranks fail on purpose, and the launcher keeps a failed job's report folder
(``$TMPDIR/hetero_llm_errors_*``, named in the job's error line) for its user; torchrun keeps a log folder
(``torchelastic_*``) per run. The suite removes the ones it made.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

LEFT_BY_DESIGN = ("hetero_llm_errors_*", "torchelastic_*")


def _folders(tmp: Path) -> set[Path]:
    return {p for pattern in LEFT_BY_DESIGN for p in tmp.glob(pattern)}


@pytest.fixture(scope="session", autouse=True)
def _remove_what_the_suite_left_in_tmp():
    tmp = Path(tempfile.gettempdir())
    before = _folders(tmp)
    yield
    for folder in _folders(tmp) - before:
        shutil.rmtree(folder, ignore_errors=True)
