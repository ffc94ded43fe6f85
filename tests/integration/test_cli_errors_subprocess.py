"""The tests of tests/unit/test_cli_errors.py that start a Python subprocess (the integration tier).

Bad flags, bad output paths and bad data: one line, exit code 2, before any rank starts.

Layout-file errors are in test_layout_errors.py and its corpus. Here: what only the command line or a run
(not a dry run) can get wrong. None of these runs forks a rank: each error is raised before.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hetero_llm.data import text_cache

REPO = Path(__file__).resolve().parents[2]

QUICKSTART = REPO / "layouts" / "quickstart.toml"


def test_usage_error_in_a_real_process():
    proc = subprocess.run(
        [sys.executable, "-m", "hetero_llm.cli", str(QUICKSTART), "--dry-rn"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == (
        "error: No such option '--dry-rn'. Did you mean '--dry-run'? (see python -m hetero_llm.cli --help)\n"
    )


needs_mount = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="bind-mounts a read-only folder in a private mount namespace: needs root and "
    "unshare (runs as root in CI and on the dev VM)",
)


def _in_read_only_folder(folder: Path, command: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``command`` with ``folder`` bind-mounted read-only over itself, in a mount namespace of its own."""
    script = f"mount --bind {folder} {folder} && mount -o remount,bind,ro {folder} && {command}"
    return subprocess.run(
        ["unshare", "-m", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


@needs_mount
def test_outputs_on_a_read_only_mount_are_refused_before_anything_runs(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    cli = f"{sys.executable} -m hetero_llm.cli {QUICKSTART}"
    for flag, path in (("--checkpoint", ro / "ckpt"), ("--trace", ro / "trace"), ("--metrics-jsonl", ro / "m.jsonl")):
        proc = _in_read_only_folder(ro, f"{cli} --quiet {flag} {path}")
        assert (proc.returncode, proc.stdout) == (2, ""), proc.stderr
        assert proc.stderr == (
            f"error: {path}: {flag}: cannot write in '{ro}': Read-only file system (give a writable path)\n"
        )
    assert os.listdir(ro) == []


@needs_mount
def test_text_data_in_a_read_only_folder_caches_in_the_user_cache(tmp_path):
    data_dir, cache = tmp_path / "data", tmp_path / "xdg"
    data_dir.mkdir()
    (data_dir / "corpus.txt").write_text("hello " * 10)
    code = (
        "import json, sys; from hetero_llm.data import text_cache; "
        "s = text_cache.TokenFileSource.from_file(sys.argv[1], 'text'); "
        "print(json.dumps([s.num_tokens, text_cache.cache_path(sys.argv[1])]))"
    )
    env = {"XDG_CACHE_HOME": str(cache), text_cache.CACHE_ENV: ""}
    proc = _in_read_only_folder(data_dir, f'{sys.executable} -c "{code}" {data_dir / "corpus.txt"}', env)
    assert proc.returncode == 0, proc.stderr
    count, where = json.loads(proc.stdout)
    assert count == 60
    assert Path(where).parent == cache / "hetero_llm" and Path(where).exists()
    assert os.listdir(data_dir) == ["corpus.txt"]
