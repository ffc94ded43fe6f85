"""Progress of long work on a terminal: one line on stderr, redrawn in place with ``\\r`` at most a few times a
second; nothing at all when stderr is not a terminal (a log file, a pipe, a batch job), so logs hold only the
lines a command prints anyway.

Checkpoint saving, loading and verification, ``hetero-export``, ``hetero-generate`` and ``hetero-tokenize``
share it; training's per-step lines are ``train.metrics.Progress``'s. Torch-free and imports nothing of hetero_llm.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO

INTERVAL = 0.2  # seconds between redraws


def is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


def _columns(stream: TextIO) -> int | None:
    """The width of the terminal ``stream`` writes to (None: unknown)."""
    try:
        return os.get_terminal_size(stream.fileno()).columns or None
    except (AttributeError, OSError, ValueError):
        return None


def clock(seconds: float) -> str:
    """``01:02:03`` (``--:--:--`` when unknown)."""
    if not 0 <= seconds < 100 * 3600:
        return "--:--:--"
    s = int(seconds)
    return f"{s // 3600:02d}:{s // 60 % 60:02d}:{s % 60:02d}"


def amount(n: float, unit: str) -> str:
    """``n`` of ``unit`` for people: bytes as kB/MB/GB (powers of 1000), other counts with k/M/G past 10000."""
    if unit == "B":
        for prefix, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
            if n >= scale:
                return f"{n / scale:.1f} {prefix}"
        return f"{n:.0f} B"
    for prefix, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= 10 * scale:
            return f"{n / scale:.1f}{prefix} {unit}".rstrip()
    return f"{n:.0f} {unit}".rstrip()


class Bar:
    """``desc: 42% 1.2/3.0 GB | 610.0 MB/s | ETA 00:00:03`` on a terminal, redrawn as ``update`` advances it.

    ``total``: the amount the work ends at (None: unknown, no percentage or ETA). ``enabled``: draw at all
    (default: ``stream`` is a terminal). ``close`` erases the line, then writes ``summary`` (if any) as a line
    of its own whether or not the stream is a terminal. Usable as a context manager (closes without a summary).
    """

    def __init__(
        self,
        desc: str,
        total: float | None = None,
        unit: str = "",
        *,
        stream: TextIO | None = None,
        enabled: bool | None = None,
    ):
        self.desc, self.total, self.unit = desc, total, unit
        self.stream = sys.stderr if stream is None else stream
        self.enabled = is_terminal(self.stream) if enabled is None else enabled
        self.done = 0.0
        self.note = ""
        self.started = time.monotonic()
        self._drawn_at: float | None = None
        self._width = 0  # of the line on screen, to blank what a shorter line leaves

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def update(self, n: float = 0, note: str | None = None) -> None:
        """Advance by ``n``; ``note`` replaces the text shown after the rate. Redraws at most every INTERVAL
        seconds (the first time INTERVAL after the start), and always when the work reaches its total."""
        self.done += n
        if note is not None:
            self.note = note
        if not self.enabled:
            return
        now = time.monotonic()
        finished = self.total is not None and self.done >= self.total
        last = self.started if self._drawn_at is None else self._drawn_at  # no rate (nor ETA) from a first instant
        if now - last < INTERVAL and not finished:
            return
        self._drawn_at = now
        self._show(self.line())

    def line(self) -> str:
        elapsed = self.elapsed
        rate = self.done / elapsed if elapsed > 0 else 0.0
        parts = [f"{self.desc}:"]
        if self.total:
            shown = min(self.done, self.total)
            parts.append(
                f"{100 * shown / self.total:3.0f}% {amount(shown, self.unit)} of {amount(self.total, self.unit)}"
            )
        else:
            parts.append(amount(self.done, self.unit))
        text = " ".join(parts) + f" | {amount(rate, self.unit)}/s"
        if self.total:
            left = (self.total - min(self.done, self.total)) / rate if rate > 0 else float("inf")
            text += f" | ETA {clock(left)}"
        return text + (f" | {self.note}" if self.note else "")

    def _show(self, text: str) -> None:
        columns = _columns(self.stream)
        if columns and len(text) >= columns:  # a wrapped line would not return under \r: cut its start (a path)
            text = "..." + text[len(text) - columns + 4 :]
        self.stream.write("\r" + text.ljust(self._width))
        self.stream.flush()
        self._width = max(self._width, len(text))  # what is on the line now, padding included

    def close(self, summary: str | None = None) -> None:
        if self.enabled and self._width:
            self.stream.write("\r" + " " * self._width + "\r")  # the terminal's line as it was before the bar
            self._width = 0
        if summary is not None:
            self.stream.write(summary + "\n")
        self.stream.flush()

    def __enter__(self) -> Bar:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
