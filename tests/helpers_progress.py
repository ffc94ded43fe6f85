"""Helpers shared by tests/unit/test_progress.py and tests/integration/test_progress_processes.py; not a test module."""

from __future__ import annotations

import io
import os
import pty
import re
import subprocess
import sys
import threading
from pathlib import Path

from harness import ROOT

BAR = re.compile(r"\r([^\r\n]+)")  # a line drawn over the previous one


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def run(args: list[str], terminal: bool, cwd: Path | None = None) -> tuple[int, str, str]:
    """``python -m args`` with stderr on a pseudo-terminal (``terminal``) or a pipe: (exit code, stdout, stderr)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", *args]
    if not terminal:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=cwd)
        return proc.returncode, proc.stdout, proc.stderr
    leader, follower = pty.openpty()
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(leader, 1 << 16)
            except OSError:  # EIO: every holder of the terminal's other end has closed it
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain)
    reader.start()
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=follower, text=True, timeout=240, env=env, cwd=cwd)
    finally:
        os.close(follower)
        reader.join(timeout=10)
        os.close(leader)
    # the terminal turns each "\n" into "\r\n" (onlcr); the bars' own "\r" stay
    return proc.returncode, proc.stdout, b"".join(chunks).decode().replace("\r\n", "\n")


def bars(stderr: str, desc: str) -> list[str]:
    return [line.rstrip() for line in BAR.findall(stderr) if line.startswith(desc)]
