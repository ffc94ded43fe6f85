"""The tests of tests/unit/test_external_launch.py that start processes or train for real (the integration tier).

Ranks started by torchrun or srun (hetero_llm/launch/external.py), and ``--resume auto`` with torchrun's restarts.

torchrun and srun start one process per rank and say which in the environment; each process runs that
rank. The world size and each rank's host are checked against the layout; ``--rank``/``--node`` win.
Under ``torchrun --max-restarts 1 ... --resume auto`` a killed rank makes torchrun restart the group,
which continues from the last save: the whole run's per-step losses equal an uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import LAYOUTS, common_sections, free_port, launch, write_layout

COMMON = common_sections(LAYOUTS / "reference" / "reference.toml")

TWO_STAGES = [(12, 3, [(3, 1), (3, 1)])]  # node n0: ranks 0 and 1

LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_STEP_ID",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_RESTART_COUNT",
)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def _hetero_launch() -> list[str]:
    """The console script torchrun users pass (``$(which hetero-launch)``), else the same CLI as a module."""
    script = Path(sys.executable).with_name("hetero-launch")
    return [str(script)] if script.exists() else ["-m", "hetero_llm.cli"]


def _losses(metrics: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref")
    path = write_layout(d / "l.toml", COMMON, TWO_STAGES)
    return path, launch(path, d, "--set", "train.steps=8")


@pytest.mark.multiprocess
def test_srun_variables_set_by_hand_run_one_rank_each(reference, tmp_path):
    path, ref = reference
    metrics, port = tmp_path / "m.jsonl", free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "hetero_llm.cli",
                str(path),
                "--quiet",
                "--metrics-jsonl",
                str(metrics),
                "--set",
                "train.steps=8",
            ],
            stderr=subprocess.PIPE,
            text=True,
            env=_env(SLURM_PROCID=str(r), SLURM_NTASKS="2", SLURM_STEP_ID="0", MASTER_PORT=str(port)),
        )
        for r in (1, 0)
    ]
    for p in procs:
        assert p.wait(120) == 0, p.stderr.read()
    assert _losses(metrics) == ref.losses


@pytest.mark.multiprocess
def test_torchrun_with_two_processes(reference, tmp_path):
    path, ref = reference
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "1",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(free_port()),
            *_hetero_launch(),
            str(path),
            "--quiet",
            "--metrics-jsonl",
            str(metrics),
            "--set",
            "train.steps=8",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=_env(),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _losses(metrics) == ref.losses


def _workers(parent: int) -> dict[int, int]:
    """rank -> pid of the torchrun workers (children of ``parent``) of its first attempt."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) != parent:
                continue
            env = dict(v.split("=", 1) for v in (entry / "environ").read_text().split("\0") if "=" in v)
        except (OSError, ValueError):
            continue
        if env.get("TORCHELASTIC_RESTART_COUNT") == "0" and "RANK" in env:
            found[int(env["RANK"])] = int(entry.name)
    return found


@pytest.mark.multiprocess
def test_torchrun_restarts_a_killed_rank_and_training_continues_from_the_last_save(reference, tmp_path):
    path, ref = reference  # 8 steps uninterrupted
    steps = 8
    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    # emulated slower compute (sleeps only: the numbers do not change) so the kill lands mid-run: each forward and
    # backward lasts 60 ms (~0.5 s a step). Fixed durations rather than HETERO_EMULATE_SLOWDOWN, which also
    # multiplies each start's slow first step (lazy set-up): that was half of this test's time.
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "1",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--master-port",
            str(free_port()),
            *_hetero_launch(),
            str(path),
            "--metrics-jsonl",
            str(metrics),
            "--checkpoint",
            str(ckpt),
            "--checkpoint-every",
            "2",
            "--resume",
            "auto",
            "--set",
            f"train.steps={steps}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(HETERO_EMULATE_ACTION_S="*:F=0.06;B=0.06"),
    )
    try:
        deadline = time.monotonic() + 300  # a hang's bound: a loaded machine only delays the steps
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.05)
        os.kill(_workers(proc.pid)[1], signal.SIGKILL)
        killed_after = len(metrics.read_text().splitlines())
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert killed_after < steps, "the kill came after training ended"
    assert "resuming from" in out and f"{ckpt}/step-00000" in out, out
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))  # each step once (numbered from 1, like the console)
    assert [r["loss"] for r in rows] == ref.losses
