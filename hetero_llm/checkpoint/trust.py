"""Which snapshots in node memory a run trusts: its own, vouched for by a secret kept in its ``--checkpoint DIR``.

A node's snapshot folder (``launch.elastic_worker.snapshot_folder``) is named after the ``--checkpoint`` path, a name
any local user can compute from the run's command line. So:

- the folder is private: created 0700 (the folders in it 0700, its files 0600: ``checkpoint.snapshots``), and
  refused in one line when it is a symbolic link, belongs to another user, or is writable by group or others
  (``private_folder``);
- every record (``ROUND/step-NNNNNN/rankR.json``) carries an HMAC-SHA256 of its content and its place in the
  folder, keyed by the run's secret ``DIR/snapshots.key`` (``run_key``: 32 random bytes in hex, created 0600 and
  atomically by the first worker of the first round; every node reads the same file from the shared
  ``--checkpoint DIR``, which is what makes the key the run's). A record the key does not verify (written by
  another user, or by a run of another ``--checkpoint DIR``) is never resumed (``holders.held`` removes it).

Torch-free.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import stat
from pathlib import Path

from hetero_llm._fs import TMP, fsync_dir
from hetero_llm.checkpoint import folders
from hetero_llm.errors import CheckpointError

KEY = "snapshots.key"  # the run's secret, in --checkpoint DIR
FILE_MODE = 0o600  # a snapshot file, the key
FOLDER_MODE = 0o700  # the snapshot folder and every folder in it
OPTION = "--snapshot-every"  # what the one-line refusals name
_KEY_BYTES = 32


def private_folder(path: Path) -> Path:
    """The snapshot folder ``path``, made 0700 if absent (its parents as any folder); refused (``CheckpointError``)
    when it is a symbolic link, not a folder, another user's, or writable by group or others. A folder of this
    user's that others may only read (made by an earlier hetero_llm) is made 0700."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, FOLDER_MODE)
    st = os.lstat(path)
    me = os.geteuid()
    if stat.S_ISLNK(st.st_mode):
        problem = f"is a symbolic link to '{os.readlink(path)}' (snapshots are never written through one: remove it"
    elif not stat.S_ISDIR(st.st_mode):
        problem = "is not a folder (remove it"
    elif st.st_uid != me:
        problem = f"belongs to uid {st.st_uid}, not to this user (uid {me}): another user made it (remove it"
    elif st.st_mode & 0o022:
        problem = f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}; remove it"
    else:
        if st.st_mode & 0o077:
            os.chmod(path, FOLDER_MODE)
        return path
    raise CheckpointError(str(path), OPTION, f"{problem}, or set HETERO_SHM_DIR to a folder of your own)")


def run_key(checkpoint: str | os.PathLike) -> bytes:
    """The run's snapshot key, ``checkpoint/snapshots.key``: read, or made by the first worker that finds none
    (written 0600 under a temporary name, then linked to its name: of workers racing, one key wins and every
    worker reads it). Refused (``CheckpointError``) when it is a link, another user's, readable or writable by
    group or others, or not a key."""
    root = Path(checkpoint)
    if root.is_symlink():
        raise CheckpointError(
            str(root),
            "--checkpoint",
            f"is a symbolic link to '{os.readlink(root)}' (writes never follow one: give the path it points to)",
        )
    root.mkdir(parents=True, exist_ok=True)
    path = root / KEY
    if not os.path.lexists(path):
        tmp = root / f"{KEY}.{secrets.token_hex(8)}{TMP}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_hex(_KEY_BYTES).encode() + b"\n")
                f.flush()
                os.fsync(f.fileno())
            with contextlib.suppress(FileExistsError):  # another worker's key won
                os.link(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        fsync_dir(root)
    return _read_key(path)


def _read_key(path: Path) -> bytes:
    def refused(problem: str) -> CheckpointError:
        return CheckpointError(
            str(path),
            OPTION,
            f"{problem}: it is this run's snapshot key, which only this user may read (delete it: a new one "
            "is made, and the snapshots in memory are not resumed)",
        )

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise refused("is a symbolic link" if os.path.islink(path) else f"cannot be read ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise refused("is not a file")
        if st.st_uid != os.geteuid():
            raise refused(f"belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})")
        if st.st_mode & 0o077:
            raise refused(f"is readable or writable by group or others (mode {stat.S_IMODE(st.st_mode):o})")
        text = f.read(4 * _KEY_BYTES)
    try:
        key = bytes.fromhex(text.decode().strip())
    except ValueError:
        key = b""
    if len(key) != _KEY_BYTES:
        raise refused(f"is not a key ({2 * _KEY_BYTES} hex digits)")
    return key


def place(round_: str, step: int, rank: int) -> str:
    """Where a rank's snapshot file is in a node's snapshot folder, as its record's MAC names it."""
    return f"{round_}/{folders.step_folder('', step).name}/rank{rank}"


def sign(key: bytes, record: dict, where: str) -> str:
    """The MAC of a snapshot record (without its ``mac``) at ``where`` (``ROUND/step-NNNNNN/rankR``: a record
    vouches only for the file at its own place)."""
    text = json.dumps({"where": where, "record": record}, sort_keys=True)
    return hmac.new(key, text.encode(), hashlib.sha256).hexdigest()


def vouched(key: bytes, record: dict, where: str) -> bool:
    """Whether ``record`` (a ``rankR.json`` as read) carries the MAC ``sign`` gives it with ``key``."""
    mac = record.get("mac")
    body = {k: v for k, v in record.items() if k != "mac"}
    return isinstance(mac, str) and hmac.compare_digest(mac, sign(key, body, where))
