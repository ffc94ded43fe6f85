"""What an elastic worker guards against besides its round's work (``launch/elastic.py``): the traps a user hits.

- **A save already complete** (``finished``): a rejoining node's agent can start a round after the others trained
  every step; the round resumes at step N of N. It ends as done (exit 0, one line), rank 0 keeping the round's
  store up until every worker has read it.
- **An unshared checkpoint folder** (``check_shared``): every node writes a token file into ``--checkpoint DIR`` and
  says whose it sees; a node that does not see every other node's is refused in one line, before training.
- **A refusal no restart can fix** (``end_job_on_refusal``): a worker refused by bad input (the same
  ``HETERO_NODE`` twice, another cluster file on one node, any ``LayoutError``) stops its own torchrun agent on its
  way out, so the agent does not restart it until ``--max-restarts`` runs out.
- **An orphan** (``watch_agent``): a worker whose agent is gone (``kill -9`` of the agent) exits, naming the cause.

Torch-free.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from hetero_llm.errors import LayoutError

SHARED = ".hetero-shared."  # DIR/.hetero-shared.<round token>.<node>: the token files of check_shared
POLL_S = 0.2
AGENT_NAMES = ("torch.distributed.run", "torchrun")  # what a torchrun agent's command line holds
TRAINING = threading.Event()  # set once a worker's round starts training: a refusal after it is a rank's failure


# ------------------------------------------------------------------------------------------
# A round that starts on a complete save


def finished_line(start: int, steps: int, resume: str | None) -> str | None:
    """The line a round prints when its save ``resume`` (at step ``start``) has every step of ``train.steps``
    trained already (a node's agent started the round after the others finished); None: steps are left."""
    if resume is None or start < steps:
        return None
    return (
        f"elastic: the run was already complete ({resume} is at step {start} of train.steps {steps}): "
        "nothing left to train, this round ends as done"
    )


def end_finished_round(store, rank: int, world_size: int, timeout_s: float) -> None:
    """Every worker of a finished round says it read the round's store; rank 0 (whose process serves the store)
    returns once all did, or after ``timeout_s``: no worker loses the store before it read what it needs."""
    try:
        store.add("done-seen", 1)
        if rank != 0:
            return
        deadline = time.monotonic() + timeout_s
        while store.add("done-seen", 0) < world_size and time.monotonic() < deadline:
            time.sleep(POLL_S)
    except Exception:  # the store's process ended: the round is over either way
        return


# ------------------------------------------------------------------------------------------
# The checkpoint folder every node must share


def check_shared(store, rank: int, members: Sequence[tuple[str, int]], checkpoint: str) -> None:
    """Refuse (one ``LayoutError`` naming the nodes) a ``--checkpoint DIR`` that the round's nodes do not share:
    one worker per node (local rank 0) writes a token file into it and says through the round's store which nodes'
    token files it sees. Every worker raises the same line; the token files are removed once every node looked."""
    node, local = members[rank]
    nodes = list(dict.fromkeys(n for n, _ in members))
    if rank == 0:
        store.set("shared/token", secrets.token_hex(8))
    token = store.get("shared/token").decode()
    root = Path(checkpoint)
    mine = root / f"{SHARED}{token}.{node}"
    if local == 0:
        for stale in root.glob(f"{SHARED}*.{node}") if root.is_dir() else ():  # a killed round's, never this one's
            stale.unlink(missing_ok=True)
        try:
            root.mkdir(parents=True, exist_ok=True)
            mine.write_text(f"{node}\n")
        except OSError as e:  # the other nodes' workers then wait out the store's timeout
            why = e.strerror or type(e).__name__
            raise LayoutError(
                checkpoint,
                "--checkpoint",
                f"cannot be written on node {node} ({why}): give a writable folder, shared by every node",
            ) from None
        store.set(f"shared/written/{node}", "")
        for n in nodes:
            store.get(f"shared/written/{n}")  # waits (the store's timeout) until every node wrote its file
        seen = [n for n in nodes if (root / f"{SHARED}{token}.{n}").exists()]
        store.set(f"shared/seen/{node}", json.dumps(seen))
    seen_by = {n: json.loads(store.get(f"shared/seen/{n}")) for n in nodes}
    if local == 0:
        mine.unlink(missing_ok=True)  # every node has looked
    problem = unshared(seen_by)
    if problem:
        raise LayoutError(
            checkpoint,
            "--checkpoint",
            f"is not one folder shared by every node: {problem} (every round resumes from it: give every node's "
            "agent the same --checkpoint DIR, on storage all nodes mount at that path)",
        )


def unshared(seen_by: dict[str, list[str]]) -> str:
    """In words, which node does not see which other nodes' token files (``seen_by``: node -> the nodes whose
    files it saw), or "" when every node saw every file."""
    nodes = list(seen_by)
    lacks = {n: [m for m in nodes if m not in seen_by[n]] for n in nodes}
    parts = [f"node {n} does not see what {', '.join(missing)} wrote there" for n, missing in lacks.items() if missing]
    return "; ".join(parts)


# ------------------------------------------------------------------------------------------
# The worker and its torchrun agent


@contextlib.contextmanager
def refusal_ends_the_job() -> Iterator[None]:
    """Around an elastic worker's round: a ``LayoutError`` raised before the round trains (``TRAINING`` not set)
    is bad input no restart can fix, so this worker's agent is stopped once the error's line is out
    (``end_job_on_refusal``); the error goes on to the CLI's one line either way."""
    TRAINING.clear()
    try:
        yield
    except LayoutError:
        if not TRAINING.is_set():
            end_job_on_refusal()
        raise


def is_agent(pid: int) -> bool:
    """Whether process ``pid`` is a torchrun elastic agent (its command line runs ``torch.distributed.run``)."""
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(os.path.basename(w.decode(errors="replace")) in AGENT_NAMES for w in words)


def end_job_on_refusal(parent: int | None = None) -> bool:
    """A refusal no restart can fix: stop this worker's torchrun agent once this process has printed its line (at
    exit), so the agent ends (its other workers stopped, its exit non-zero) instead of restarting the round until
    ``--max-restarts`` runs out. True when the parent is an agent (``parent``: its pid; default this process's)."""
    agent = os.getppid() if parent is None else parent
    if not is_agent(agent):
        return False

    def stop() -> None:
        sys.stderr.flush()
        try:
            os.kill(agent, signal.SIGTERM)
        except OSError:
            pass

    atexit.register(stop)
    return True


def watch_agent(parent: int, poll_s: float = 0.5, on_exit: Callable[[str], None] | None = None) -> threading.Thread:
    """A daemon thread that ends this process (exit code 1) with one line once its parent ``parent`` (the
    torchrun agent) is gone: its pid is no longer this process's parent (a killed parent's children are
    re-parented). ``on_exit(line)`` runs first (the clean-up of the process); default: print the line."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        line = (
            f"error: elastic: this worker's torchrun agent (pid {parent}) is gone (killed?): ending this worker, "
            "which would otherwise train on alone"
        )
        if on_exit is not None:
            on_exit(line)
        else:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
        os._exit(1)

    thread = threading.Thread(target=watch, name="agent-watch", daemon=True)
    thread.start()
    return thread


def watch_my_agent(poll_s: float = 0.5) -> bool:
    """``watch_agent`` of this process's parent when it is a torchrun agent (True), with ``orphan_exit``."""
    parent = os.getppid()
    if not is_agent(parent):
        return False
    watch_agent(parent, poll_s, orphan_exit)
    return True


def orphan_exit(line: str) -> None:
    """What an orphaned worker does before it ends: its line, and the clean-ups its heartbeat would run."""
    from hetero_llm.comm import heartbeat  # torch: only when an agent is gone

    sys.stderr.write(line + "\n")
    heartbeat.run_before_exit()
