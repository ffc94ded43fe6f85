"""Ranks started by torchrun or srun (hetero_llm/launch/external.py), and ``--resume auto`` with torchrun's restarts.

torchrun and srun start one process per rank and say which in the environment; each process runs that
rank. The world size and each rank's host are checked against the layout; ``--rank``/``--node`` win.
Under ``torchrun --max-restarts 1 ... --resume auto`` a killed rank makes torchrun restart the group,
which continues from the last save: the whole run's per-step losses equal an uninterrupted run's.
"""

from __future__ import annotations

import pytest

from harness import LAYOUTS, assert_one_error_line, common_sections, invoke_cli, write_layout
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
