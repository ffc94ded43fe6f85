"""Suite hygiene: test runs leave nothing behind in /tmp, and never touch another run's files there.

Failure tests make ranks fail on purpose, and the launcher keeps a failed job's report folder
(``$TMPDIR/hetero_llm_errors_*``, named in the job's error line) for its user; torchrun keeps a log folder
(``torchelastic_*``) per run. The suite gives itself a private ``$TMPDIR`` (every process it starts
inherits it) and removes that folder at the end. Removing matching folders from the shared /tmp instead
would delete the live report folder of a job that another suite (or a user) runs on the same machine.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path


_SUITE_TMP = Path(tempfile.mkdtemp(prefix="hl-suite-"))
os.environ["TMPDIR"] = str(_SUITE_TMP)
tempfile.tempdir = None  # recomputed from $TMPDIR on next use
# At interpreter exit rather than in a session fixture: a run that only collects (--collect-only), or that
# stops at a collection error, never runs session fixtures.
atexit.register(shutil.rmtree, _SUITE_TMP, True)
