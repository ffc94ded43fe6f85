"""Suite hygiene: test runs leave nothing behind in /tmp, and never touch another run's files there.

Failure tests make ranks fail on purpose, and the launcher keeps a failed job's report folder
(``$TMPDIR/hetero_llm_errors_*``, named in the job's error line) for its user; torchrun keeps a log folder
(``torchelastic_*``) per run. The suite gives itself a private ``$TMPDIR`` (every process it starts
inherits it) and removes that folder at the end. Removing matching folders from the shared /tmp instead
would delete the live report folder of a job that another suite (or a user) runs on the same machine.
"""

from __future__ import annotations

import atexit
import compileall
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path

import pytest

# The suite's bytecode: with PYTHONDONTWRITEBYTECODE set (as on the CI machine) every process the suite starts, ranks
# and agents included, would compile the package's modules again (about 1 s of CPU each). They are compiled once here
# (up-to-date files are only stat'ed), into the __pycache__ folders git ignores, and read by every later process.
if sys.dont_write_bytecode:
    _ROOT = Path(__file__).resolve().parent.parent
    for _folder in ("hetero_llm", "bench", "tests"):
        compileall.compile_dir(_ROOT / _folder, quiet=2, workers=1)
    sys.dont_write_bytecode = False  # pytest's rewritten test modules are cached too

_SUITE_TMP = Path(tempfile.mkdtemp(prefix="hl-suite-"))
os.environ["TMPDIR"] = str(_SUITE_TMP)
tempfile.tempdir = None  # recomputed from $TMPDIR on next use
# At interpreter exit rather than in a session fixture: a run that only collects (--collect-only), or that
# stops at a collection error, never runs session fixtures.
atexit.register(shutil.rmtree, _SUITE_TMP, True)


# The two tiers (CONTRIBUTING.md) are the two folders: tests/unit/ (torch-free and one-process tests, the fast loop:
# `pytest tests/unit`) and tests/integration/ (every test that starts OS processes, trains for real or runs for seconds
# of CPU: a whole search, an exhaustive enumeration). A test's tier
# follows from its folder: each test under tests/integration/ is marked `integration` here, so `-m "not integration"`
# selects the unit tier too. A test marked multiprocess, netns or gpu belongs under tests/integration/.
INTEGRATION = Path(__file__).resolve().parent / "integration"
PROCESS_MARKS = ("multiprocess", "netns", "gpu")


@pytest.hookimpl(tryfirst=True)  # before xdist's worker reads the xdist_group marks added here
def pytest_collection_modifyitems(config, items):
    misplaced = []
    for item in items:
        if INTEGRATION in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.integration)
        elif any(item.get_closest_marker(m) for m in PROCESS_MARKS):
            misplaced.append(item.nodeid)
        if _uses_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(Path(item.path).name))
    if misplaced:
        raise pytest.UsageError(
            f"{len(misplaced)} test(s) marked {'/'.join(PROCESS_MARKS)} outside tests/integration/ "
            f"(move them there): {', '.join(misplaced[:5])}"
        )


def _uses_a_module_fixture(item) -> bool:
    """Whether ``item`` uses a fixture shared by a module or class (the trainings several tests read). Under
    pytest-xdist (``-n 2 --dist loadgroup``, the README's command) such a module's tests stay on one worker, so
    the shared runs happen once, not once per worker; the other tests go to whichever worker is free."""
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.values() if info is not None else ()
    return any(d.scope in ("module", "class", "package") for fixturedefs in defs for d in fixturedefs)


@pytest.fixture(scope="session")
def shared_launch(tmp_path_factory):
    """``harness.launch(layout, workdir, *extra)`` run once per (layout, extra) in the whole session: the reference
    runs that several modules compare against (the one-process reference.toml) train once, not once per module.
    Its results are only read (RunResult is frozen; no test writes into a shared run's folder)."""
    from harness import launch

    runs: dict = {}

    def get(layout: Path, *extra: str):
        key = (str(layout), extra)
        if key not in runs:
            runs[key] = launch(layout, tmp_path_factory.mktemp(f"shared_{Path(layout).stem}"), *extra)
        return runs[key]

    return get


DEFAULT_PORT = 29511  # cluster.port's default (layout/cluster_schema.py)


@pytest.fixture(scope="session", autouse=True)
def default_port_taken():
    """The whole suite runs with the default rendezvous port held, as it is while another run on the machine uses
    it: a test that starts ranks takes its own port (``harness.free_port()``), and every refusal of what a user gave
    comes before the port's (launch/preflight.py, node.run_ranks). Where another program (or the other xdist worker)
    already holds it, the tests run just the same."""
    sock = socket.socket()
    try:
        sock.bind(("0.0.0.0", DEFAULT_PORT))
        sock.listen()
    except OSError:
        sock.close()
        yield
        return
    with sock:
        yield
