"""Elastic runs (hetero_llm/launch/elastic.py): ``hetero-launch CLUSTER.toml --elastic`` under torchrun's agents.

In process: the planning of a round (deterministic, for the nodes present), the mapping of devices to layout
ranks, and every bad input as one line. In real processes: three emulated nodes on this machine, one torchrun
agent each; a node is killed mid-run (its agent's whole process group), the survivors re-plan and continue,
the node comes back and the plan grows back; the per-step losses equal the one-process run's.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import attrs
import pytest
from helpers_elastic import cluster_file

from bench.elastic import elastic_agents as agents_mod
from harness import LAYOUTS, assert_one_error_line, common_sections, free_port, invoke_cli, write_layout
from hetero_llm.errors import LayoutError
from hetero_llm.launch import elastic, elastic_worker
from hetero_llm.plan import compile_plan
from hetero_llm.planner import load_cluster

COMMON = common_sections(LAYOUTS / "reference" / "reference.toml")

# what a torchrun agent sets (the bench's agents drop the same from their own environment)
TORCHRUN_VARS = [v for v in os.environ if v.startswith(("TORCHELASTIC_", "SLURM_"))] + list(agents_mod.DROP)

NODES = {"n0": 2, "n1": 1, "n2": 1}  # devices per node (torchrun --nproc-per-node differs per agent)


@pytest.fixture
def clean_env(monkeypatch):
    for var in TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def _torchrun_env(monkeypatch, **extra: str) -> None:
    env = dict(
        RANK="0",
        WORLD_SIZE="4",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29999",
        TORCHELASTIC_RUN_ID="job",
        TORCHELASTIC_USE_AGENT_STORE="False",
        TORCHELASTIC_RESTART_COUNT="0",
    )
    for k, v in {**env, **extra}.items():
        monkeypatch.setenv(k, v)


def test_each_membership_is_planned_deterministically(tmp_path):
    cluster = load_cluster(cluster_file(tmp_path / "c.toml", 4))
    plans = {}
    for present in (["n0", "n1", "n2"], ["n0", "n1"], ["n1", "n2"]):
        first, again = (compile_plan(elastic.plan_for(cluster, present)) for _ in range(2))
        assert first.fingerprint() == again.fingerprint()  # every worker plans the same layout
        used = {r.node for r in first.ranks}
        assert used <= set(present) and used, used  # only the nodes present
        plans[tuple(present)] = first
        # the same global batch, data order and schedule of the lr: only the pipeline schedule is the plan's
        planned = first.layout.train
        assert planned == attrs.evolve(cluster.train, schedule=planned.schedule, chunks=planned.chunks)
    assert len({p.fingerprint() for p in plans.values()}) == 3
    full = plans[("n0", "n1", "n2")]
    # n0's two devices form a TP group: the hung-node test below runs TP under emulated slowdown (docs/elastic.md)
    assert sorted(len(s.devices) for p in full.layout.pipelines for s in p.stages) == [1, 1, 2]
    assert [elastic.layout_rank(full, r.node, int(r.device_id.split(":")[1])) for r in full.ranks] == list(
        range(full.world_size)
    )
    assert elastic.layout_rank(plans[("n1", "n2")], "n0", 0) is None  # absent: no rank


def test_present_nodes_in_cluster_order_and_a_node_claimed_twice(tmp_path):
    cluster = load_cluster(cluster_file(tmp_path / "c.toml", 4))
    assert elastic_worker.present_nodes(cluster, [("n2", 0), ("n0", 1), ("n0", 0)]) == ["n0", "n2"]
    with pytest.raises(LayoutError, match="two torchrun agents say they are node n1 .local rank 0 arrived twice"):
        elastic_worker.present_nodes(cluster, [("n1", 0), ("n0", 0), ("n0", 1), ("n1", 0)])


def test_elastic_outside_torchrun_is_one_line(tmp_path, clean_env):
    path = cluster_file(tmp_path / "c.toml", 4)
    assert_one_error_line(
        invoke_cli(str(path), "--elastic", "--checkpoint", str(tmp_path / "ck")),
        "environment: TORCHELASTIC_RUN_ID: not set: --elastic runs under torchrun's elastic agent (torchrun "
        "--nnodes MIN:MAX --nproc-per-node N --rdzv-backend c10d ... -m hetero_llm.cli CLUSTER.toml --elastic ...; "
        "docs/elastic.md)",
    )


@pytest.mark.parametrize(
    "args, message",
    [
        ((), "{path}: --checkpoint: --elastic needs --checkpoint DIR (where every start and restart resumes from)"),
        (
            ("--checkpoint", "ck", "--rank", "1"),
            "{path}: --rank: cannot be combined with --elastic (every round plans the layout and resumes from "
            "--checkpoint DIR; torchrun gives each worker its rank)",
        ),
        (
            ("--checkpoint", "ck", "--set", "train.steps=2"),
            "{path}: --set: cannot be combined with --elastic (every round plans the layout and resumes from "
            "--checkpoint DIR; torchrun gives each worker its rank)",
        ),
        (
            ("--checkpoint", "ck", "--resume", "auto"),
            "{path}: --resume: cannot be combined with --elastic (every round plans the layout and resumes from "
            "--checkpoint DIR; torchrun gives each worker its rank)",
        ),
    ],
)
def test_elastic_options_are_one_line(tmp_path, clean_env, args, message):
    path = cluster_file(tmp_path / "c.toml", 4)
    assert_one_error_line(invoke_cli(str(path), "--elastic", *args), message.format(path=path))


def test_snapshots_without_elastic_are_one_line(tmp_path, clean_env):
    path = write_layout(tmp_path / "l.toml", COMMON, [(12, 3, [(6, 1)])])
    assert_one_error_line(
        invoke_cli(str(path), "--snapshot-every", "2"),
        f"{path}: --snapshot-every: needs --elastic (snapshots are for restarts)",
    )


def test_snapshot_folder_is_one_per_checkpoint_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("HETERO_SHM_DIR", raising=False)
    a, b = elastic_worker.snapshot_folder(str(tmp_path / "a")), elastic_worker.snapshot_folder(str(tmp_path / "b"))
    assert a.parent == b.parent == Path("/dev/shm") and a != b
    assert elastic_worker.snapshot_folder(str(tmp_path / "a")) == a  # every worker of every round names the same one
    monkeypatch.setenv("HETERO_SHM_DIR", str(tmp_path))
    assert elastic_worker.snapshot_folder(str(tmp_path / "a")).parent == tmp_path


@pytest.mark.parametrize(
    "env, message",
    [
        (
            {"TORCHELASTIC_USE_AGENT_STORE": "True", "HETERO_NODE": "n0"},
            "environment: TORCHELASTIC_USE_AGENT_STORE: 'True': --elastic needs a fresh store every round "
            "(torchrun's shared store keeps the keys of earlier rounds and dies with the node of the first round's "
            "rank 0); start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment",
        ),
        (
            {"LOCAL_WORLD_SIZE": "x", "HETERO_NODE": "n0"},
            "environment: LOCAL_WORLD_SIZE: 'x' is not a number (torchrun sets it; run under torchrun)",
        ),
        ({"HETERO_NODE": "n9"}, "{path}: environment HETERO_NODE: 'n9' is not a node of [cluster] (nodes: n0, n1, n2)"),
        (
            {},
            "{path}: --node: several (n0, n1, n2) of the nodes' hosts is this machine: set HETERO_NODE=NAME in the "
            "agent's environment (or pass --node NAME) to say which node this agent is",
        ),
        (
            {"HETERO_NODE": "n1"},
            "{path}: cluster.nodes[1].devices: node n1 has 1 device(s) but torchrun started 2 worker(s) on it "
            "(LOCAL_WORLD_SIZE); start its agent with --nproc-per-node 1",
        ),
    ],
)
def test_elastic_environment_is_one_line(tmp_path, clean_env, env, message):
    path = cluster_file(tmp_path / "c.toml", 4)
    _torchrun_env(clean_env, **env)
    assert_one_error_line(
        invoke_cli(str(path), "--elastic", "--checkpoint", str(tmp_path / "ck")), message.format(path=path)
    )


# What the plain launcher checks before any rank starts, checked before the round's store (torchrun's rank 0 at
# MASTER_PORT 29999, which nothing serves here: a check made after it would end in the store's failure instead).
@pytest.mark.parametrize(
    "env, args, message",
    [
        (
            {"MASTER_PORT": "70000"},
            (),
            "environment: MASTER_PORT: '70000' is not a TCP port (1..65535) (torchrun sets it; run under torchrun)",
        ),
        (
            {"RANK": "3", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"},
            (),
            "environment: RANK: '3' is not a rank below WORLD_SIZE (1) (torchrun sets it; run under torchrun)",
        ),
        (
            {"LOCAL_RANK": "2"},
            (),
            "environment: LOCAL_RANK: '2' is not a rank below LOCAL_WORLD_SIZE (2) (torchrun sets it; run under "
            "torchrun)",
        ),
        (
            {"HETERO_DEBUG": "2"},
            (),
            "environment: HETERO_DEBUG: '2' is not 0 or 1 (1: a rank's unexpected error is raised with its traceback)",
        ),
        (
            {},
            ("--metrics-jsonl", "{tmp}/out", "--trace", "{tmp}/out"),
            "{tmp}/out: --trace: is also the path of --metrics-jsonl (give each output its own path)",
        ),
        (
            {},
            ("--metrics-jsonl", "{path}"),
            "{path}: --metrics-jsonl: would overwrite the cluster file '{path}', an input of this run (give another "
            "path)",
        ),
        (
            {"HETERO_SHM_DIR": "{path}/shm"},
            ("--snapshot-every", "1"),
            "environment: HETERO_SHM_DIR: '{path}/shm': --snapshot-every cannot write its snapshots there: '{path}' is "
            "a file, so no folder can be made under it (give a writable folder, or unset it for /dev/shm)",
        ),
    ],
)
def test_elastic_checks_come_before_the_store(tmp_path, clean_env, env, args, message):
    path = cluster_file(tmp_path / "c.toml", 4)
    values = {"path": path, "tmp": tmp_path}
    _torchrun_env(clean_env, HETERO_NODE="n0", **{k: v.format(**values) for k, v in env.items()})
    extra = [a.format(**values) for a in args]
    result = invoke_cli(str(path), "--elastic", "--checkpoint", str(tmp_path / "ck"), *extra)
    assert_one_error_line(result, message.format(**values))  # after the store, its 60 s wait would fail first


def test_a_round_store_that_never_answers_is_one_line(tmp_path, clean_env, capfd):
    """A worker whose round's store (torchrun's rank 0) never answers gives up after the round's wait (here
    cluster.timeout_s 2, the start's 60 s floor lowered) in one line: it probes with plain sockets, so torch's
    client never prints its C++ dump."""
    path = cluster_file(tmp_path / "c.toml", 4)
    path.write_text(path.read_text().replace("timeout_s = 10", "timeout_s = 2"))
    port = free_port()
    _torchrun_env(clean_env, HETERO_NODE="n0", RANK="1", MASTER_PORT=str(port))
    clean_env.setattr(elastic, "_START_S", 0.0)
    result = invoke_cli(str(path), "--elastic", "--checkpoint", str(tmp_path / "ck"))
    assert (result.exit_code, result.stdout) == (1, "")
    assert result.stderr == (
        f"error: elastic: worker 1 could not reach this round's store at 127.0.0.1:{port} within 2 s (last: "
        "Connection refused); is torchrun's rank 0 of this round started?\n"
    )
    assert capfd.readouterr().err == ""


@pytest.mark.skipif(
    os.geteuid() != 0,
    reason="making a folder another user's needs root: runs in CI and on the dev machines, which run as root",
)
@pytest.mark.parametrize(
    "plant, why",
    [
        (
            lambda f, d: f.symlink_to(d),
            "is a symbolic link to '{d}' (snapshots are never written through one: remove it",
        ),
        (
            lambda f, d: os.chown(f, 65534, 65534),
            "belongs to uid 65534, not to this user (uid 0): another user made it (remove it",
        ),
        (lambda f, d: os.chmod(f, 0o777), "is writable by group or others (mode 777; remove it"),
    ],
    ids=["symlink", "foreign", "0777"],
)
def test_a_snapshot_folder_another_user_controls_is_one_line(tmp_path, clean_env, plant, why):
    """Another local user can compute the folder's name from the --checkpoint path and make it first: refused
    before any worker reads or writes it (tests/unit/test_snapshot_trust.py: every case in process)."""
    path = cluster_file(tmp_path / "c.toml", 4)
    _torchrun_env(clean_env, HETERO_NODE="n0", HETERO_SHM_DIR=str(tmp_path / "shm"))
    folder = elastic_worker.snapshot_folder(str(tmp_path / "ck"))
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    folder.parent.mkdir()
    if "symbolic" not in why:
        folder.mkdir()
    plant(folder, theirs)
    assert_one_error_line(
        invoke_cli(str(path), "--elastic", "--checkpoint", str(tmp_path / "ck"), "--snapshot-every", "1"),
        f"{folder}: --snapshot-every: {why.format(d=theirs)}, or set HETERO_SHM_DIR to a folder of your own)",
    )
    assert list(theirs.iterdir()) == []


def _agent(cluster: Path, node: str, rdzv: int, workdir: Path) -> subprocess.Popen:
    """One node's torchrun agent (bench/elastic/elastic_agents.py), steps slowed down so that a kill lands mid-run."""
    return agents_mod.start_agent(cluster, node, NODES[node], rdzv, workdir, 12.0)
