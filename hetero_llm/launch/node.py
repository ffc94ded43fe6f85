"""Start a node's ranks (or one rank), watch them, and take the job down when any rank fails.

Each rank is its own OS process running what ``hetero-launch LAYOUT --rank R`` runs (``run_rank``, which
the CLI's ``--rank`` path, torchrun's and srun's ranks and elastic rounds call too; the rank itself is built and
run by its composition root, ``train/rank.py``), so one launch and the per-process launches of nodes with uneven GPU
counts are the same code path. A forked rank runs from the plan the launcher compiled (fork hands it
over); it does not load the layout again. The launcher imports torch once and forks the ranks from it,
rather than starting a fresh interpreter per rank: importing torch costs each process about 2 s of CPU, which a node with
more ranks than cores pays many times over before any rank trains; so does importing the rank's own code
(``train/rank.py`` and what it imports: about 1 s more), which the launcher imports once too. The launcher runs no torch op
before forking (no OpenMP or CUDA state to inherit). A rank names itself ``hl-rank<R>`` (``ps -o
comm``). Children die with the launcher (PR_SET_PDEATHSIG), so Ctrl-C or a killed launcher leaves no
process behind. A failed rank leaves its one line where ``RunOptions.error_dir`` says (the launcher names the
folder, its first report creates it); the launcher prints the root cause.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import NoReturn

import attrs

from hetero_llm.errors import Diverged, LayoutError, RankFailure
from hetero_llm.launch import hosts
from hetero_llm.plan import Plan
from hetero_llm.train.options import RunOptions, failure_file, traceback_file


def quiet_cpp_warnings() -> None:
    """Before torch is imported (its C++ logging reads the level then): no C++ warnings, which a rank whose peer died
    gets from every store or gloo operation, each with a page of C++ frames, before the line that names the cause.
    Errors still show; TORCH_CPP_LOG_LEVEL, or HETERO_DEBUG=1, keeps them all."""
    if os.environ.get("HETERO_DEBUG", "0") in ("", "0"):
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def local_ranks(plan: Plan, node: str | None) -> list[int]:
    lay = plan.layout
    if node is not None:
        names = [n.name for n in lay.cluster.nodes]
        if node not in names:
            raise LayoutError(lay.file, "--node", f"'{node}' is not a node of [cluster] (nodes: {', '.join(names)})")
        nodes = {node}
    else:
        here = hosts.local_hosts([n.host for n in lay.cluster.nodes], lay.file)  # all at once, a bounded wait
        nodes = {n.name for n, local in zip(lay.cluster.nodes, here) if local}
        if not nodes:
            raise LayoutError(
                lay.file,
                "cluster.nodes",
                "no node's host is an address of this machine "
                "(pass --node NAME or --rank R to choose what to start here)",
            )
    return [r.rank for r in plan.ranks if r.node in nodes]


def check_rank(plan: Plan, rank: int) -> None:
    if not 0 <= rank < plan.world_size:
        raise LayoutError(
            plan.layout.file, "--rank", f"rank {rank} is not in this layout (ranks 0..{plan.world_size - 1})"
        )


def _die_with_parent() -> None:  # runs in the forked child
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@attrs.define
class _Child:
    """One forked rank process: its pid and, once reaped, its exit code (negative: killed by that signal)."""

    pid: int
    returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def stopped(self) -> bool:
        """Stopped by a signal (state T; not 't', a debugger's tracing stop)."""
        try:
            return Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
        except (OSError, IndexError):
            return False

    def signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass


def node_threads(ranks_here: int) -> int:
    """CPU threads per rank when ``ranks_here`` ranks share this host's cores (OMP_NUM_THREADS overrides)."""
    return max(1, (os.cpu_count() or 1) // max(1, ranks_here))


def run_ranks(plan: Plan, ranks: list[int], options: RunOptions, grace_s: float = 3.0) -> None:
    """Start ``ranks`` as child processes; return when all succeed, raise RankFailure on the first failure."""
    import torch  # noqa: F401  (once, here: every forked rank starts with it loaded)

    import hetero_llm.train.rank  # noqa: F401  (likewise: ~1 s of CPU per rank, paid before its first step)
    from hetero_llm.comm import rendezvous, shm

    shm.check_space(plan, ranks)  # before any rank starts: a node's /dev/shm too small for p2p = 'shm'
    # last, after every check of what the user gave (preflight, the data): the server rank's port taken here
    rendezvous.check_port_free(plan, ranks)
    errdir = _error_dir_name()  # made by the first rank that reports: a launcher SIGKILLed leaves nothing
    threads = int(os.environ.get("OMP_NUM_THREADS") or node_threads(len(ranks)))
    procs: dict[int, _Child] = {}
    stopped_since: dict[int, float] = {}  # rank -> when its process was first seen stopped
    try:
        for r in ranks:
            sys.stdout.flush()
            sys.stderr.flush()  # else the child would print the parent's buffered output again
            pid = os.fork()
            if pid == 0:
                _rank_child(plan, r, attrs.evolve(options, error_dir=str(errdir)), threads)  # never returns
            procs[r] = _Child(pid)
        while procs:
            failed = {r: code for r, p in procs.items() if (code := p.poll()) is not None and code != 0}
            for r in [r for r, p in procs.items() if p.returncode == 0]:
                del procs[r]
            if failed:
                # A dead rank makes its peers fail with connection errors moments later: give them a
                # moment to report, then blame the root cause rather than the first rank polled.
                time.sleep(0.3)
                failed.update({r: code for r, p in procs.items() if (code := p.poll()) is not None and code != 0})
                raise _failure(plan, failed, errdir)
            _check_stopped(plan, procs, stopped_since)
            time.sleep(0.05)
    finally:
        _terminate(list(procs.values()), grace_s)
        if errdir.is_dir() and not any(errdir.iterdir()):  # kept only when it holds a failure report (named)
            errdir.rmdir()


def _error_dir_name() -> Path:  # a fresh, not yet existing $TMPDIR/hetero_llm_errors_* for failure reports
    return Path(tempfile.gettempdir(), f"hetero_llm_errors_{os.getpid()}_{os.urandom(6).hex()}")


def _check_stopped(plan: Plan, procs: dict[int, _Child], since: dict[int, float]) -> None:
    """A rank whose process stays stopped (SIGSTOP) for twice ``cluster.timeout_s`` fails the job, naming it.
    Its peers give up on it after ``cluster.timeout_s`` (heartbeat.py), but nothing else would ever end the
    launch of the node it runs on; twice, so that the peers (on other nodes too) name it first, rather than
    see their connections to it reset when this launcher kills it."""
    now = time.monotonic()
    for r, p in procs.items():
        if p.stopped():
            since.setdefault(r, now)
        else:
            since.pop(r, None)
    limit = plan.layout.cluster.timeout_s
    late = sorted(r for r, t in since.items() if now - t > 2 * limit)
    if late:
        info = plan.ranks[late[0]]
        raise RankFailure(
            f"rank {late[0]} ({info.device_id}) stopped responding: its process has been stopped "
            f"(SIGSTOP) for {now - since[late[0]]:.0f} s (twice cluster.timeout_s {limit:g}); "
            "stopped the other ranks"
        )


def _rank_child(plan: Plan, rank: int, options: RunOptions, threads: int) -> NoReturn:
    """In a forked child: become rank ``rank`` (what ``hetero-launch LAYOUT --rank R`` runs) and exit."""
    code = 1
    try:
        _die_with_parent()
        _name_process(f"hl-rank{rank}")
        # The OpenMP runtime read OMP_NUM_THREADS when the launcher imported torch: set the count directly.
        os.environ.update(OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
        import torch

        torch.set_num_threads(threads)
        code = _exit_code(plan, rank, options)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # not expected (HETERO_DEBUG=1 lets a rank's error through with its traceback)
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)  # never back into the launcher's frames, its finally blocks or atexit handlers


def _exit_code(plan: Plan, rank: int, options: RunOptions) -> int:
    """Run the rank; the code ``hetero-launch LAYOUT --rank R`` exits with under a launcher, which prints the
    failure itself (the rank wrote it into the launcher's error folder)."""
    try:
        run_rank(plan, rank, options)
    except LayoutError:  # e.g. a damaged save a rank finds
        return 2
    except RankFailure as e:
        return e.exit_code
    except KeyboardInterrupt:
        sys.stderr.write(f"{INTERRUPTED}\n")
        return 130
    return 0


def _name_process(name: str) -> None:
    """The name ``ps -o comm`` and ``top`` show (15 bytes at most)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except OSError:
        pass


_SECONDARY = ("connection", "closed by peer", "broken pipe", "timed out", "gloo", "nccl", "rendezvous aborted")


def _cause(rank: int, code: int, errdir: Path) -> str:
    err = failure_file(errdir, rank)
    if err.exists() and err.read_text().strip():
        return err.read_text().strip().splitlines()[0]
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _failure(plan: Plan, failed: dict[int, int], errdir: Path) -> RankFailure:
    causes = {r: _cause(r, code, errdir) for r, code in failed.items()}
    # Root cause first: a signal or an error of the rank's own before another rank's connection errors.
    order = sorted(causes, key=lambda r: (any(w in causes[r].lower() for w in _SECONDARY), r))
    first = order[0]
    if failed[first] == Diverged.exit_code:  # every rank stopped at the same step: no rank to blame
        return Diverged(causes[first])
    if " stopped responding: " in causes[first]:  # the peers' heartbeats named the rank they all waited for
        others = f"; {len(order) - 1} other rank(s) gave up too" if len(order) > 1 else ""
        return RankFailure(f"{causes[first]}{others}; stopped the other ranks")
    info = plan.ranks[first]
    tb = traceback_file(errdir, first)
    more = f" (traceback: {tb})" if tb.exists() else ""
    others = f"; {len(order) - 1} other rank(s) failed after it" if len(order) > 1 else ""
    return RankFailure(
        f"rank {first} ({info.device_id}, pipeline {info.pipeline} stage {info.stage}) failed: "
        f"{causes[first]}{more}{others}; stopped the other ranks"
    )


def _terminate(procs: list[_Child], grace_s: float) -> None:
    for p in procs:
        p.signal(signal.SIGTERM)
        p.signal(signal.SIGCONT)  # a stopped rank (SIGSTOP, Ctrl-Z) takes its SIGTERM only once continued
    deadline = time.monotonic() + grace_s
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.02)
    for p in procs:
        if p.poll() is None:
            p.signal(signal.SIGKILL)
            os.waitpid(p.pid, 0)


INTERRUPTED = "interrupted: stopped every rank"


def run_rank(plan: Plan, rank: int, options: RunOptions) -> None:
    """Run rank ``rank`` in this process: what ``hetero-launch LAYOUT --rank R``, every forked rank, torchrun's
    and srun's ranks and an elastic round's run. Its composition root is ``train.rank.run``; an unexpected error is
    made one ``RankFailure`` line naming the rank (HETERO_DEBUG=1: raised as it is, with its traceback)."""
    try:
        _run(plan, rank, options)
    except (LayoutError, RankFailure, KeyboardInterrupt):
        raise
    except Exception as e:  # one line on the console; the launcher has the traceback file
        if os.environ.get("HETERO_DEBUG", "0") not in ("", "0"):
            raise
        info = plan.ranks[rank]
        raise RankFailure(
            f"rank {rank} ({info.device_id}) failed: {type(e).__name__}: {e} "
            f"(HETERO_DEBUG=1 shows the traceback)".splitlines()[0]
        ) from None


def _run(plan: Plan, rank: int, options: RunOptions) -> None:
    """The rank's share of the plan handed to its composition root (``train/rank.py``)."""
    import torch  # torch-free until here: --dry-run and planning never import it

    from hetero_llm.comm import shm
    from hetero_llm.train import rank as rank_root

    check_rank(plan, rank)
    if not options.error_dir:  # started on its own, not forked by run_ranks (which checked)
        shm.check_space(plan, [rank])
        if not os.environ.get("OMP_NUM_THREADS"):
            # As run_ranks does for the ranks it starts: this node's ranks share its cores. (Besides not
            # oversubscribing the host, this keeps the arithmetic that of a one-command launch: CPU kernels
            # may sum in another order with another thread count, which changes a run's last bits.)
            node = plan.ranks[rank].node
            torch.set_num_threads(node_threads(len([r for r in plan.ranks if r.node == node])))
    rank_root.run(plan.rank_plan(rank), options, shm.rank_rings(plan, rank), _switcher(plan, rank))


def _switcher(plan: Plan, rank: int):
    """What makes ``rank``'s hot-switching ``Switcher`` (its bucket plans come compiled with ``plan``), or None."""
    if not plan.layout.buckets:
        return None
    from hetero_llm.switching.switcher import Switcher

    return functools.partial(Switcher, plan, rank)
