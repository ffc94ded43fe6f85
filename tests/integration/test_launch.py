"""The launcher as a user meets it: failures named and prompt, no process left behind, per-rank launches."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers_launch import run_cli, start_server

from harness import LAYOUTS, common_sections, free_port, launch, sigint_as_in_a_terminal, write_layout

pytestmark = pytest.mark.multiprocess

COMMON = common_sections(LAYOUTS / "reference" / "reference.toml")
THREE_STAGES = [(12, 3, [(2, 1), (2, 1), (2, 1)])]


def _children_of(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def _rank_of(pid: int) -> int | None:
    """The rank a launcher's child runs: it names itself hl-rank<R> (``ps -o comm``)."""
    try:
        name = (Path("/proc") / str(pid) / "comm").read_text().strip()
    except OSError:
        return None
    return int(name.removeprefix("hl-rank")) if name.startswith("hl-rank") else None


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_gone(pids: list[int], timeout: float = 60) -> None:
    """Until none of ``pids`` is alive (a zombie is not), at most ``timeout`` s: ranks exit as soon as they see the
    launcher gone or get its SIGTERM, and a loaded machine only delays that, so the bound is a hang's, not a speed."""
    deadline = time.monotonic() + timeout
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)


def _communicate(proc: subprocess.Popen, timeout: float) -> str:
    """The stderr of ``proc`` once it exits; a job still running after ``timeout`` s is killed (with its ranks) and
    fails the test: these jobs train 100000 steps, so only the failure being tested ends them."""
    try:
        return proc.communicate(timeout=timeout)[1]
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"the job did not stop within {timeout:g} s:\n{out}\n{err}") from None


def _start(layout: Path, tmp_path: Path, *extra: str, env: dict | None = None) -> tuple[subprocess.Popen, Path]:
    metrics = tmp_path / "metrics.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "hetero_llm.cli",
        str(layout),
        "--quiet",
        "--metrics-jsonl",
        str(metrics),
        "--set",
        f"cluster.port={free_port()}",
        *extra,
    ]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, preexec_fn=sigint_as_in_a_terminal
    ), metrics


def _wait_for_steps(proc: subprocess.Popen, metrics: Path, steps: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    raise AssertionError(f"no {steps} steps within {timeout} s")


def test_killed_rank_takes_the_job_down_and_is_named(tmp_path):
    layout = write_layout(tmp_path / "l.toml", COMMON, THREE_STAGES)
    # cluster.timeout_s far above how long the job may take to stop: a job that stops at all was stopped by the
    # rank's exit (the line names its signal), not by its peers' heartbeats giving up after timeout_s
    timeout_s = 600
    proc, metrics = _start(layout, tmp_path, "--set", "train.steps=100000", "--set", f"cluster.timeout_s={timeout_s}")
    _wait_for_steps(proc, metrics, 2)
    children = _children_of(proc.pid)
    victim = next(pid for pid in children if _rank_of(pid) == 1)
    os.kill(victim, signal.SIGKILL)
    err = _communicate(proc, timeout_s / 3)  # on an idle machine: about a second
    assert proc.returncode == 1
    assert "rank 1 (n0:1, pipeline 0 stage 1) failed: killed by SIGKILL" in err, err
    assert "Traceback" not in err
    assert not [pid for pid in children if _alive(pid)], "ranks left running"


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(),
    reason="needs a host without CUDA to make a CUDA rank fail; runs on CPU-only machines (CI, developer machines)",
)
def test_rank_error_is_named_with_its_cause(tmp_path):
    layout = write_layout(tmp_path / "l.toml", COMMON, THREE_STAGES)
    text = layout.read_text().replace('devices = ["cpu", "cpu", "cpu"]', 'devices = ["cpu", "cpu", "cuda:0"]')
    layout.write_text(text)
    proc, _ = _start(layout, tmp_path)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith(
            "error: rank 2 (n0:2, pipeline 0 stage 2) failed: device cuda:0 requested but CUDA is not available on this host"
        )
    )


def test_ctrl_c_leaves_no_process_behind(tmp_path):
    layout = write_layout(tmp_path / "l.toml", COMMON, THREE_STAGES)
    proc, metrics = _start(layout, tmp_path, "--set", "train.steps=100000")
    _wait_for_steps(proc, metrics, 1)
    children = _children_of(proc.pid)
    assert sorted(_rank_of(pid) for pid in children) == [0, 1, 2]  # one forked child per rank, each named
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:  # it did not stop: do not leave a 100000-step job running (its ranks die with it)
            proc.kill()
    assert proc.returncode == 130, err
    _wait_gone(children)
    assert not [pid for pid in children if _alive(pid)]


def test_every_rank_as_its_own_process_equals_one_launch(tmp_path):
    """``hetero-launch L --rank R`` per process (uneven nodes) trains exactly what one launch trains."""
    layout = write_layout(tmp_path / "l.toml", COMMON, [(8, 4, [(3, 1), (3, 2)]), (4, 2, [(6, 1)])])
    whole = launch(layout, tmp_path / "whole")
    port = free_port()
    metrics = tmp_path / "per_rank.jsonl"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "hetero_llm.cli",
                str(layout),
                "--rank",
                str(r),
                "--quiet",
                "--set",
                f"cluster.port={port}",
                "--metrics-jsonl",
                str(metrics),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for r in (3, 1, 0, 2)
    ]  # arrival order does not matter
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert losses == whole.losses


def test_rank_that_never_arrives_is_named(tmp_path):
    """Ranks 0 and 1 of 3 start side by side, each its own ``--rank`` launch, forked from one warm interpreter
    (tests/helpers_launch.py): with torch imported, both reach the rendezvous within moments of each other, well
    inside cluster.timeout_s on a loaded machine too (two fresh interpreters importing torch side by side drift
    apart by seconds there, and rank 0 would name rank 1 as well)."""
    layout = write_layout(tmp_path / "l.toml", COMMON, THREE_STAGES)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    start_server(env)
    sets = ["--quiet", "--set", f"cluster.port={port}", "--set", "cluster.timeout_s=3"]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda r: run_cli([str(layout), "--rank", str(r), *sets], env, 300), (0, 1)))
    assert results[0].returncode == 1
    assert results[0].stderr.strip() == "error: rendezvous timed out after 3 s: never arrived: rank 2 (n0:2)"
    assert results[1].returncode == 1
    assert "rank 1" in results[1].stderr and "rendezvous" in results[1].stderr


def test_rank_started_with_a_different_layout_is_named(tmp_path):
    layout = write_layout(tmp_path / "l.toml", COMMON, [(12, 3, [(3, 1), (3, 1)])])
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "hetero_llm.cli",
                str(layout),
                "--rank",
                str(r),
                "--quiet",
                "--set",
                f"cluster.port={port}",
                "--set",
                "cluster.timeout_s=20",
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r, extra in ((0, []), (1, ["--set", "train.lr=0.5"]))
    ]
    results = [p.communicate(timeout=300) for p in procs]
    assert procs[0].returncode == 1 and procs[1].returncode == 1
    err = results[0][1].strip().splitlines()[-1]
    assert re.fullmatch(
        r"error: ranks compiled different plans: rank 0: [0-9a-f]{12}; rank 1 \(n0:1\): [0-9a-f]{12} "
        r"\(start every rank with the same layout, the same --set overrides and the same --resume\)",
        err,
    ), err
    assert "rank 1: rank 0 found ranks with a different plan" in results[1][1]


def test_trace_of_a_killed_job_is_readable(tmp_path):
    """--trace streams every rank's events as it runs: a job killed without warning leaves a trace the
    timeline reads (every line but a torn last one)."""
    from hetero_llm.predict import trace as tracing

    layout = write_layout(tmp_path / "l.toml", COMMON, THREE_STAGES)
    trace = tmp_path / "trace"
    proc, metrics = _start(layout, tmp_path, "--set", "train.steps=100000", "--trace", str(trace))
    _wait_for_steps(proc, metrics, 2)
    deadline = time.monotonic() + 300
    while (
        not all(len(p.read_text().splitlines()) >= 3 for p in trace.glob("rank*.jsonl"))
        or len(list(trace.glob("rank*.jsonl"))) < 3
    ):
        assert time.monotonic() < deadline, "no trace lines within 300 s"
        time.sleep(0.1)
    children = _children_of(proc.pid)
    proc.kill()  # no finally block of the launcher runs; its ranks get SIGTERM (they die with it)
    proc.communicate(timeout=300)
    _wait_gone(children)
    records = tracing.read_rank_traces(trace)
    assert [r["rank"] for r in records] == [0, 1, 2]
    for record in records:  # each of the 2+ lines of events it had written when it was killed
        lines = (trace / f"rank{record['rank']}.jsonl").read_text().splitlines()[1:]
        assert len(record["events"]) >= len(lines) >= 2
        assert {ev["action"] for ev in record["events"]} & {"F0", "B0"}
    done = subprocess.run(
        [sys.executable, "-m", "hetero_llm.timeline", str(trace), "--chrome", str(tmp_path / "t.json")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"wrote {tmp_path / 't.json'}")


def test_a_diverging_run_stops_every_rank_at_that_step_and_saves_nothing_after(tmp_path):
    """lr = 1e30: the loss is finite at step 0 and NaN soon after. Every rank sees the all-reduced NaN at the
    same step and stops before its optimizer step: exit code 3, one line naming the step, the last save good."""
    layout = write_layout(tmp_path / "l.toml", COMMON, [(12, 3, [(3, 1), (3, 1)])])
    ckpt = tmp_path / "ckpt"
    proc, metrics = _start(
        layout,
        tmp_path,
        "--set",
        "train.lr=1e30",
        "--set",
        "train.min_lr=0",
        "--set",
        "train.steps=8",
        "--checkpoint",
        str(ckpt),
        "--checkpoint-every",
        "1",
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )  # the failure reports' folder stays here
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 3, err
    match = re.fullmatch(
        r"error: training diverged at step (\d+) \(counting from 1, as the console and --metrics-jsonl "
        r"do\): loss "
        r"nan, gradient norm nan; every rank stopped before its optimizer step, the last save is "
        r"(\S+) \(lower train.lr, or raise train.warmup_steps\)\n",
        err,
    )
    assert match, err
    step = int(match[1])  # the step that diverged: steps 1 .. step - 1 were taken and saved
    assert 1 < step <= 8 and match[2] == str(ckpt / f"step-{step - 1:06d}")
    assert (ckpt / "latest").read_text() == f"step-{step - 1:06d}\n"
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", *(f"step-{s:06d}" for s in range(1, step))]
    assert len(metrics.read_text().splitlines()) == step - 1  # the diverged step is not recorded
    reports = list(tmp_path.glob("hetero_llm_errors_*/rank*.err"))
    assert reports and all(p.read_text() == err.removeprefix("error: ") for p in reports)  # every rank, one cause


def test_a_launch_leaves_nothing_behind_in_tmp_or_the_checkpoint(tmp_path):
    """No empty /tmp/hetero_llm_errors_* per launch; the .tmp files of a killed save go at the next save."""
    ckpt, tmp = tmp_path / "ckpt", tmp_path / "tmp"
    tmp.mkdir()
    (ckpt / "step-000002").mkdir(parents=True)
    leftovers = [ckpt / "step-000002" / "rank0.pt.tmp", ckpt / "latest.tmp"]
    for path in leftovers:
        path.write_bytes(b"half written")
    cmd = [
        sys.executable,
        "-m",
        "hetero_llm.cli",
        str(LAYOUTS / "reference" / "reference.toml"),
        "--quiet",
        "--checkpoint",
        str(ckpt),
        "--set",
        f"cluster.port={free_port()}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "TMPDIR": str(tmp)})
    assert proc.returncode == 0, proc.stderr
    assert list(tmp.iterdir()) == []
    assert not [p for p in leftovers if p.exists()]


def test_a_launcher_killed_by_sigkill_leaves_no_error_folder(tmp_path):
    """SIGKILL runs no clean-up in the launcher: its failure-report folder is only made by the first rank that
    reports, so a launcher killed while its ranks train leaves nothing in $TMPDIR (its ranks die with it)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    layout = write_layout(tmp_path / "l.toml", COMMON, THREE_STAGES)
    proc, metrics = _start(layout, tmp_path, "--set", "train.steps=100000", env={**os.environ, "TMPDIR": str(tmp)})
    _wait_for_steps(proc, metrics, 1)
    children = _children_of(proc.pid)
    proc.kill()
    proc.communicate(timeout=300)
    _wait_gone(children)
    assert not [pid for pid in children if _alive(pid)], "ranks left running"
    assert list(tmp.iterdir()) == []


@pytest.mark.parametrize("victim", [1, 0])  # rank 0 also serves the store: its silence names it too
def test_stopped_rank_is_named_not_the_ranks_waiting_for_it(tmp_path, victim):
    layout = write_layout(tmp_path / "l.toml", COMMON, THREE_STAGES)
    proc, metrics = _start(layout, tmp_path, "--set", "train.steps=100000", "--set", "cluster.timeout_s=4")
    _wait_for_steps(proc, metrics, 2)
    children = _children_of(proc.pid)
    os.kill(next(pid for pid in children if _rank_of(pid) == victim), signal.SIGSTOP)
    # Nothing but the watchdogs ends this job (a stopped process neither exits nor closes its sockets): that it
    # stops is the claim, and the line below says which watchdog stopped it, after how long (within
    # cluster.timeout_s on an idle machine, the launcher's at twice it). The bound is a hang's.
    err = _communicate(proc, 300)
    assert proc.returncode == 1
    # named by its peers' heartbeat watchdogs, or by the launcher that sees its process stopped: whichever is first
    assert re.fullmatch(
        rf"error: rank {victim} \(n0:{victim}\) stopped responding: ((no heartbeat|the rendezvous store "
        r"it serves stopped answering) for \d+ s \(cluster.timeout_s 4; a stopped or hung process\); "
        r"rank \d gave up waiting for it(; 1 other rank\(s\) gave up too)?|its process has been stopped "
        r"\(SIGSTOP\) for \d+ s \(twice cluster.timeout_s 4\)); stopped the other ranks",
        err.strip(),
    ), err
    _wait_gone(children)
    assert not [pid for pid in children if _alive(pid)], "ranks left running (the stopped one included)"


def test_forked_ranks_run_from_the_launchers_plan(tmp_path):
    """The launcher hands its compiled plan to the ranks it forks: they neither read the layout file again (here
    it is gone before they start) nor go through the command line."""
    path = write_layout(tmp_path / "l.toml", COMMON, [(12, 3, [(3, 1), (3, 1)])])
    metrics = tmp_path / "metrics.jsonl"
    code = (
        "import os, sys; from hetero_llm import layout; from hetero_llm.launch import node; "
        "from hetero_llm.plan import compile_plan; "
        f"plan = compile_plan(layout.load({str(path)!r}, ['train.steps=2', 'cluster.port={free_port()}'])); "
        f"os.remove({str(path)!r}); "
        f"node.run_ranks(plan, [0, 1], node.RunOptions(metrics_jsonl={str(metrics)!r}, quiet=True)); "
        "print('hetero_llm.cli' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2]
