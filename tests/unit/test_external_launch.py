"""Ranks started by torchrun or srun (hetero_llm/launch/external.py), and ``--resume auto`` with torchrun's restarts.

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

from harness import LAYOUTS, assert_one_error_line, common_sections, free_port, invoke_cli, launch, write_layout
from hetero_llm import layout as layout_mod
from hetero_llm.launch import external

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


@pytest.fixture
def clean_env(monkeypatch):
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def _hetero_launch() -> list[str]:
    """The console script torchrun users pass (``$(which hetero-launch)``), else the same CLI as a module."""
    script = Path(sys.executable).with_name("hetero-launch")
    return [str(script)] if script.exists() else ["-m", "hetero_llm.cli"]


def _losses(metrics: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


# --------------------------------------------------------------------------- the environment (in process)


def test_which_variables_give_a_rank():
    assert external.assigned({}) is None
    assert external.assigned({"RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"}) == external.Assigned(
        1, 2, "torchrun", "RANK", "WORLD_SIZE"
    )
    slurm = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "0"}
    assert external.assigned(slurm) == external.Assigned(3, 4, "srun", "SLURM_PROCID", "SLURM_NTASKS")
    assert external.assigned({**slurm, "RANK": "0", "WORLD_SIZE": "4"}).launcher == "torchrun"  # torchrun in srun
    assert external.assigned({k: v for k, v in slurm.items() if k != "SLURM_STEP_ID"}) is None  # the batch script
    assert external.assigned({**slurm, "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) is None  # an interactive step


def test_world_size_mismatch_is_one_line(tmp_path, clean_env):
    path = write_layout(tmp_path / "l.toml", COMMON, TWO_STAGES)
    clean_env.setenv("RANK", "0")
    clean_env.setenv("WORLD_SIZE", "8")
    assert_one_error_line(
        invoke_cli(path, "--dry-run"),
        f"{path}: pipelines: torchrun started 8 processes "
        "(WORLD_SIZE=8) but the layout has 2 ranks; start 2 (--dry-run lists them by node)",
    )


def test_rank_on_another_host_is_one_line(tmp_path, clean_env):
    path = write_layout(tmp_path / "l.toml", COMMON, [(6, 2, [(6, 1)]), (6, 2, [(6, 1)])])
    path.write_text(path.read_text().replace('name = "n1"', 'name = "n1"\nhost = "192.0.2.7"'))
    clean_env.setenv("SLURM_PROCID", "1")
    clean_env.setenv("SLURM_NTASKS", "2")
    clean_env.setenv("SLURM_STEP_ID", "0")
    import socket

    assert_one_error_line(
        invoke_cli(path, "--dry-run"),
        f"{path}: cluster.nodes[1].host: srun started rank 1 "
        f"(SLURM_PROCID) on {socket.gethostname()}, but the layout puts it (n1:0) on node n1, host "
        "'192.0.2.7', which is not this machine; give each node its machine's host, and start ranks "
        "so that each machine gets its nodes' ranks (--dry-run lists them)",
    )
    clean_env.setenv("SLURM_PROCID", "0")  # rank 0's node n0 is 127.0.0.1: fine
    assert invoke_cli(path, "--dry-run").exit_code == 0


def test_bad_rank_variable_is_one_line(tmp_path, clean_env):
    path = write_layout(tmp_path / "l.toml", COMMON, TWO_STAGES)
    clean_env.setenv("RANK", "one")
    clean_env.setenv("WORLD_SIZE", "2")
    assert_one_error_line(
        invoke_cli(path, "--dry-run"),
        "environment: RANK: 'one' is not a number (torchrun sets it; "
        "unset it, or pass --rank R / --node NAME to choose what to start)",
    )


def test_explicit_rank_or_node_wins_over_the_environment(tmp_path, clean_env):
    path = write_layout(tmp_path / "l.toml", COMMON, TWO_STAGES)
    clean_env.setenv("RANK", "0")
    clean_env.setenv("WORLD_SIZE", "8")  # wrong: would be refused if read
    assert invoke_cli(path, "--dry-run", "--node", "n0").exit_code == 0
    assert invoke_cli(path, "--dry-run", "--rank", "1").exit_code == 0


def test_resume_auto_finds_the_newest_complete_save_or_none(tmp_path):
    lay = layout_mod.load(write_layout(tmp_path / "l.toml", COMMON, TWO_STAGES))
    ckpt = tmp_path / "ckpt"
    assert external.resume_auto(str(ckpt), lay) is None  # no folder yet
    (ckpt / "step-000002").mkdir(parents=True)  # an interrupted save only
    assert external.resume_auto(str(ckpt), lay) is None
    with pytest.raises(
        layout_mod.LayoutError,
        match=r": --resume: auto needs --checkpoint DIR \(the folder it "
        r"resumes from and saves into\)$",
    ):
        external.resume_auto(None, lay)


def test_resume_auto_without_checkpoint_is_one_line(tmp_path, clean_env):
    path = write_layout(tmp_path / "l.toml", COMMON, TWO_STAGES)
    assert_one_error_line(
        invoke_cli(path, "--dry-run", "--resume", "auto"),
        f"{path}: --resume: auto needs --checkpoint DIR (the folder it resumes from and saves into)",
    )


# --------------------------------------------------------------------------- real launches (processes)


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
        timeout=180,
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
        deadline = time.monotonic() + 120
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.05)
        os.kill(_workers(proc.pid)[1], signal.SIGKILL)
        killed_after = len(metrics.read_text().splitlines())
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert killed_after < steps, "the kill came after training ended"
    assert "resuming from" in out and f"{ckpt}/step-00000" in out, out
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))  # each step once (numbered from 1, like the console)
    assert [r["loss"] for r in rows] == ref.losses
