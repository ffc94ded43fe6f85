"""Files written whole or not at all: a crash leaves the old file or the new one, never part of one; what a
full disk is, where it is, and how much room it has left; and reading what a user gives without hanging on it
(a named pipe where a file should be) or crashing on it (JSON nested deeper than Python's recursion limit)."""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

TMP = ".tmp"  # suffix of a file being written; a leftover one is garbage


def write_atomically(path: Path, write: Callable[[BinaryIO], object], mode: int = 0o666) -> None:
    """Write ``path`` by ``write(binary file)`` (what it returns, e.g. a byte count, is ignored) into ``path.tmp``,
    fsync it, rename it over ``path``. Neither is followed if it is a symbolic link (the rename replaces a link at
    ``path`` rather than writing its target). ``mode``: the new file's permissions (less the umask)."""
    tmp = path.with_name(path.name + TMP)
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode), "wb") as f:
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


def no_space(e: BaseException | None) -> bool:
    """Whether ``e``, or an exception it was raised from or while handling, is a full disk or quota (ENOSPC,
    EDQUOT): torch.save, for one, reports a failed write as a RuntimeError raised while handling the OSError."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        e = e.__cause__ or e.__context__
    return False


def free_bytes(path: str | os.PathLike) -> int:
    """Bytes an unprivileged writer may still use on the filesystem of ``path`` (or of its nearest existing
    folder)."""
    folder = Path(path).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


def device_of(path: str | os.PathLike) -> str:
    """The filesystem ``path`` is on, for messages: ``SOURCE at MOUNTPOINT`` (``/dev/sda1 at /data``, ``tmpfs at
    /scratch``), or the mount point alone where /proc/self/mounts does not say."""
    folder = Path(os.path.realpath(path))
    while not os.path.ismount(folder) and folder != folder.parent:
        folder = folder.parent
    source = ""
    try:
        with open("/proc/self/mounts") as f:
            for line in f:  # the last mount on a point is the one in effect
                fields = line.split()
                if len(fields) > 1 and _unescape(fields[1]) == str(folder):
                    source = _unescape(fields[0])
    except OSError:
        pass
    return f"{source} at {folder}" if source else str(folder)


def _unescape(field: str) -> str:
    """A /proc/self/mounts field: space, tab, newline and backslash are written as octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def not_regular(path: str | os.PathLike) -> str | None:
    """What ``path`` is when it exists but is not a regular file (its link followed), e.g. "a named pipe (FIFO)";
    None for a regular file or a missing one. Checked before opening a file of a save: opening a FIFO blocks
    until something writes into it, which would hang the run that reads it."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode):
        return None
    kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"))
    return next((what for test, what in kinds if test(mode)), "a device file")


def loads_json(text: str | bytes) -> Any:
    """``json.loads``, where nesting too deep for Python's parser (100,000 ``[``) is a ``json.JSONDecodeError``
    like any other malformed JSON, not a RecursionError."""
    try:
        return json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply to read", text if isinstance(text, str) else "", 0) from None
