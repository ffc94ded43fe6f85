"""``hetero-launch ARGS`` run to completion without a fresh interpreter per run: the CLI forked from a warm one.

Most of a tiny test launch is starting Python and importing torch (about 2 s of CPU each, on a 2-core machine
that runs ~100 launches per suite). ``run_cli`` forks the launch from a fork server (``multiprocessing``'s
``forkserver``) that has imported torch and the launcher and run no torch op, the state the launcher itself is
in when it forks its ranks (hetero_llm/launch/node.py). The forked process then does what ``python -m
hetero_llm.cli ARGS`` does: click's command line, the layout, the launcher forking the ranks, the exit code;
with the caller's environment, working directory and its own stdout and stderr.

What a fresh interpreter would do differently is read the environment at import: a launch whose environment
differs from the server's in a variable read then (torch's, OpenMP's, Python's, ``HETERO_DEBUG``) runs as a real
subprocess instead. ``HL_TEST_FRESH_LAUNCH=1`` runs every launch as a subprocess (to compare: the same layout
trains bitwise the same losses, gradient norms and parameters either way). The tests of the command line itself
(exit codes, error lines, signals, per-rank launches) start real subprocesses of their own. As with any
``multiprocessing`` start method but fork, a script that calls ``run_cli`` needs the ``if __name__ ==
"__main__":`` guard (``python -m pytest`` needs nothing).
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile
import traceback

# Read when Python, torch or OpenMP start, or when the CLI decides how loud torch's C++ logging is.
IMPORT_TIME = ("TORCH_", "PYTORCH_", "OMP_", "KMP_", "GOMP_", "MKL_", "CUDA_", "LD_", "PYTHON", "HETERO_DEBUG")
# What the launcher holds when it forks its ranks (node.run_ranks): torch imported, no torch op run.
PRELOAD = [
    "torch",
    "torch.distributed",
    "hetero_llm.cli.launch",
    "hetero_llm.launch.node",
    "hetero_llm.comm.shm",
    "hetero_llm.train.rank",
]

_server_env: dict[str, str] | None = None


def _import_time(env: dict[str, str]) -> dict[str, str]:
    env = dict(env)
    if env.get("HETERO_DEBUG", "0") in ("", "0"):
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # as launch.node.quiet_cpp_warnings sets it before the import
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME)}


def _context(env: dict[str, str]):
    """The fork server's context, started on first use with ``env``'s import-time variables."""
    global _server_env
    ctx = multiprocessing.get_context("forkserver")
    if _server_env is None:
        ctx.set_forkserver_preload(PRELOAD)
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update({k: v for k, v in saved.items() if not k.startswith(IMPORT_TIME)} | _import_time(env))
        try:
            from multiprocessing import forkserver

            forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        _server_env = _import_time(env)
    return ctx


def start_server(env: dict[str, str]) -> None:
    """Start the fork server now, with ``env``'s import-time variables: before threads call ``run_cli`` side by
    side (starting it swaps this process's environment for a moment, which another thread could read)."""
    _context(env)


def spawn_warm(fn, args: tuple, nprocs: int) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)`` with each process forked from the warm fork server
    instead of started fresh (a fresh one imports torch: ~2 s of CPU each). For tests that start their own
    process groups; the processes start in the server's state (torch imported, no torch op run)."""
    import torch.multiprocessing as mp

    start_server(dict(os.environ))  # running, with its preload, before torch asks for one
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def _child(args: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    """In the forked process: ``python -m hetero_llm.cli ARGS`` from here on, stdout and stderr into files."""
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    code = 1
    try:
        from hetero_llm.cli.launch import main

        sys.argv = [main.name, *args]
        main.main(args=args, prog_name=main.name)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # as the interpreter would: the traceback, exit code 1
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_cli(args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """``python -m hetero_llm.cli ARGS`` with ``env``: forked from the warm server, or a subprocess (module doc)."""
    cmd = [sys.executable, "-m", "hetero_llm.cli", *args]
    fresh = os.environ.get("HL_TEST_FRESH_LAUNCH", "0") not in ("", "0")
    if fresh or (_server_env is not None and _import_time(env) != _server_env):
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    ctx = _context(env)
    with tempfile.TemporaryDirectory(prefix="hl-launch-") as d:
        out, err = os.path.join(d, "stdout"), os.path.join(d, "stderr")
        proc = ctx.Process(target=_child, args=(args, env, os.getcwd(), out, err), name="hetero-launch")
        proc.start()
        proc.join(timeout)
        if proc.exitcode is None:
            proc.kill()  # its ranks die with it (PR_SET_PDEATHSIG)
            proc.join()
            raise subprocess.TimeoutExpired(cmd, timeout)
        with open(out) as o, open(err) as e:
            return subprocess.CompletedProcess(cmd, proc.exitcode, o.read(), e.read())
