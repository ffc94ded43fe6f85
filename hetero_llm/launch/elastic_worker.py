"""What an elastic worker is told and checks before its round's store: torchrun's variables (``Worker``), the
options ``--elastic`` takes, which node this worker is, the nodes a round's members make up, and where its
node's snapshots live. Every check is one ``LayoutError`` naming the variable, option or TOML path; the round
itself is ``launch/elastic.py``."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs

from hetero_llm.errors import ENVIRONMENT, LayoutError
from hetero_llm.launch import external, outputs
from hetero_llm.launch.hosts import local_hosts
from hetero_llm.planner.cluster import Cluster
from hetero_llm.train.options import RunOptions

NODE_ENV = "HETERO_NODE"  # the node a torchrun agent's workers belong to


@attrs.frozen
class Worker:
    """What torchrun told this worker."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    host: str  # MASTER_ADDR: where torchrun's rank 0 serves this round's store
    port: int
    restart: int  # TORCHELASTIC_RESTART_COUNT (torch counts failures only, not membership changes)


def check_request(file: str, checkpoint: str | None, refused: Mapping[str, object]) -> None:
    """The options ``--elastic`` takes: ``--checkpoint DIR`` is needed (every round resumes from it); what torchrun
    or the plan decides is refused (``refused``: option name -> its value, None or False when not given)."""
    for option, value in refused.items():
        if value not in (None, False, ()):
            raise LayoutError(
                file,
                option,
                "cannot be combined with --elastic (every round plans the layout and resumes from --checkpoint "
                "DIR; torchrun gives each worker its rank)",
            )
    if not checkpoint:
        raise LayoutError(
            file, "--checkpoint", "--elastic needs --checkpoint DIR (where every start and restart resumes from)"
        )


def check_environment(environ: Mapping[str, str]) -> Worker:
    """The variables torchrun's elastic agent sets, checked: one ``LayoutError`` naming the first bad one."""
    if "RANK" not in environ or "TORCHELASTIC_RUN_ID" not in environ:
        raise LayoutError(
            ENVIRONMENT,
            "TORCHELASTIC_RUN_ID",
            "not set: --elastic runs under torchrun's elastic agent (torchrun --nnodes MIN:MAX "
            "--nproc-per-node N --rdzv-backend c10d ... -m hetero_llm.cli CLUSTER.toml --elastic ...; docs/elastic.md)",
        )
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise LayoutError(
            ENVIRONMENT,
            "TORCHELASTIC_USE_AGENT_STORE",
            "'True': --elastic needs a fresh store every round (torchrun's shared store keeps the keys of "
            "earlier rounds and dies with the node of the first round's rank 0); start torchrun with "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment",
        )
    values = {}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"):
        text = environ.get(var, "")
        if not text.strip().isdigit():
            raise LayoutError(ENVIRONMENT, var, f"'{text}' is not a number (torchrun sets it; run under torchrun)")
        values[var] = int(text)
    # what torch's store would take minutes to time out on, or refuse with a TypeError: named here, before it
    bounds = (
        ("MASTER_PORT", 1, 65535, "a TCP port (1..65535)"),
        ("WORLD_SIZE", 1, None, "a number of workers >= 1"),
        ("LOCAL_WORLD_SIZE", 1, values["WORLD_SIZE"], f"a number of workers 1..WORLD_SIZE ({values['WORLD_SIZE']})"),
        ("RANK", 0, values["WORLD_SIZE"] - 1, f"a rank below WORLD_SIZE ({values['WORLD_SIZE']})"),
        (
            "LOCAL_RANK",
            0,
            values["LOCAL_WORLD_SIZE"] - 1,
            f"a rank below LOCAL_WORLD_SIZE ({values['LOCAL_WORLD_SIZE']})",
        ),
    )
    for var, lo, hi, expected in bounds:
        if values[var] < lo or (hi is not None and values[var] > hi):
            raise LayoutError(
                ENVIRONMENT, var, f"'{environ[var]}' is not {expected} (torchrun sets it; run under torchrun)"
            )
    return Worker(
        values["RANK"],
        values["WORLD_SIZE"],
        values["LOCAL_RANK"],
        values["LOCAL_WORLD_SIZE"],
        environ.get("MASTER_ADDR", "127.0.0.1"),
        values["MASTER_PORT"],
        values["TORCHELASTIC_RESTART_COUNT"],
    )


def this_node(cluster: Cluster, node: str | None, worker: Worker) -> str:
    """The node this worker belongs to (``--node``, else the one node whose host is this machine), checked to have
    as many devices as torchrun started workers on it."""
    spec, file = cluster.spec, cluster.file
    names = [n.name for n in spec.nodes]
    where = "--node"
    if node is None and os.environ.get(NODE_ENV):  # torchrun reads --node as its own --node-rank: the agent's env
        node, where = os.environ[NODE_ENV], f"{ENVIRONMENT} {NODE_ENV}"
    if node is None:
        here = local_hosts([n.host for n in spec.nodes], file)
        local = [n.name for n, mine in zip(spec.nodes, here) if mine]
        if len(local) != 1:
            which = f"several ({', '.join(local)})" if local else "none"
            raise LayoutError(
                file,
                "--node",
                f"{which} of the nodes' hosts is this machine: set {NODE_ENV}=NAME in the agent's environment "
                "(or pass --node NAME) to say which node this agent is",
            )
        node = local[0]
    if node not in names:
        raise LayoutError(file, where, f"'{node}' is not a node of [cluster] (nodes: {', '.join(names)})")
    devices = len(spec.node(node).devices)
    if devices != worker.local_world_size:
        raise LayoutError(
            file,
            f"cluster.nodes[{names.index(node)}].devices",
            f"node {node} has {devices} device(s) but torchrun started {worker.local_world_size} worker(s) on it "
            f"(LOCAL_WORLD_SIZE); start its agent with --nproc-per-node {devices}",
        )
    return node


def present_nodes(cluster: Cluster, members: Sequence[tuple[str, int]]) -> list[str]:
    """The nodes of a round, in the cluster file's order, from every worker's (node, local rank); refused when two
    agents say they are the same node (each local rank of a node must arrive once)."""
    seen: dict[str, set[int]] = {}
    for node, local in members:
        if local in seen.setdefault(node, set()):
            raise LayoutError(
                cluster.file,
                f"{ENVIRONMENT} {NODE_ENV}",
                f"two torchrun agents say they are node {node} (local rank {local} arrived twice): give each "
                f"agent its own {NODE_ENV}=NAME in its environment",
            )
        seen[node].add(local)
    return [n.name for n in cluster.spec.nodes if n.name in seen]


def check_before_store(cluster: Cluster, options: RunOptions) -> None:
    """What the plain launcher checks before any rank starts, checked before this round's store (a bad one is one
    line at once, not after the other workers arrived, the round planned and the save was agreed): every variable
    (HETERO_EMULATE_* against the cluster's devices, as no plan has more ranks), the outputs against the cluster
    file's inputs, and with ``--snapshot-every`` that the snapshot folder's file system can be written."""
    external.check_environment(os.environ, cluster.num_devices)
    o = options
    outputs.check_run_paths(
        outputs.cluster_inputs(cluster), o.metrics_jsonl, o.checkpoint, o.trace, None, o.tensorboard
    )
    if o.snapshot[1]:
        outputs.check_snapshot_folder(snapshot_folder(o.checkpoint))


def last_round(environ: Mapping[str, str], worker: Worker) -> bool:
    """Whether this worker's agent has no restart left (torchrun sets ``TORCHELASTIC_MAX_RESTARTS``): a failure of
    this round ends the job on this node."""
    text = environ.get("TORCHELASTIC_MAX_RESTARTS", "")
    return text.isdigit() and worker.restart >= int(text)


def snapshot_folder(checkpoint: str | None) -> Path:
    """Where a run's snapshots live in node memory: ``$HETERO_SHM_DIR`` (else /dev/shm), one folder per
    ``--checkpoint DIR`` (every worker of every round computes the same name; so can any local user: the folder is
    checked to be private and the run's own, ``checkpoint.trust``)."""
    digest = hashlib.sha1(os.path.abspath(str(checkpoint)).encode()).hexdigest()[:12]
    return Path(os.environ.get("HETERO_SHM_DIR") or "/dev/shm") / f"hetero_llm_snapshots_{digest}"
