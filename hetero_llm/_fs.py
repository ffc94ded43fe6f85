"""Files written whole or not at all: a crash leaves the old file or the new one, never part of one."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

TMP = ".tmp"  # suffix of a file being written; a leftover one is garbage


def write_atomically(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Write ``path`` by ``write(binary file)`` (what it returns, e.g. a byte count, is ignored) into ``path.tmp``,
    fsync it, rename it over ``path``. Neither is followed if it is a symbolic link (the rename replaces a link at
    ``path`` rather than writing its target)."""
    tmp = path.with_name(path.name + TMP)
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o666), "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)  # the rename itself survives a power loss


def fsync_dir(folder: str | os.PathLike) -> None:
    """Make a rename in ``folder`` durable; a platform that cannot open folders is fine."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
