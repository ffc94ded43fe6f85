"""Elastic runs: ``hetero-launch CLUSTER.toml --elastic`` under torchrun's elastic agent.

A cluster file (a layout without ``[[pipelines]]``, the planner's input) lists every node the run may use.
One torchrun agent runs per node (``torchrun --nnodes MIN:MAX --nproc-per-node N --max-restarts K
--rdzv-backend c10d ...``); torchrun decides who is present, restarts every worker when a node arrives (a node
waits at the rendezvous) or a loss cannot be recovered in place, and gives each worker ``RANK``, ``WORLD_SIZE``
and ``LOCAL_RANK``. A node lost is recovered in place when it can be: the survivors' workers go on in their
processes, in the round's next *generation* (``launch/in_place.py``). Each worker, at every start and restart (a *round*):

1. says which node it belongs to (``HETERO_NODE=NAME`` in its agent's environment, or ``--node NAME``, which
   torchrun's argument parser would take for its own ``--node-rank`` when given before the script; else the node whose host is this machine) and its local rank,
   through a store that torchrun's rank 0 serves at ``MASTER_ADDR:MASTER_PORT`` (a fresh one per round:
   ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``; the agent's shared store outlives a round and dies with the node
   of the first round's rank 0, see ``check_environment``);
2. plans the layout for the nodes present (every worker runs the same deterministic planner on the same input)
   and compares the plan's fingerprint with every other worker's;
3. runs the layout rank of its device (``node:local_rank``) as ``hetero-launch LAYOUT --rank R`` would, resuming
   from the newest complete save in ``--checkpoint DIR`` (saves are layout-free: any plan resumes any save), or
   from a newer snapshot step that the nodes present hold in memory, copied there first (``launch/restart.py``);
   a device the plan leaves idle waits, its worker alive, until the layout's ranks finish.

The global batch, data order and learning-rate schedule are the cluster file's ``[train]``, the same for every
plan, so layout invariance makes the run train the one-process model across any sequence of memberships.
What torchrun cannot carry and this adds: the exchange of (node, local rank) over its store, and with
``--snapshot-every`` the exchange of what each node's memory holds (``launch/restart.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs

from hetero_llm import layout as layout_mod
from hetero_llm.checkpoint import trust
from hetero_llm.errors import LayoutError, RankFailure
from hetero_llm.launch import external, guards, in_place, outputs, restart
from hetero_llm.launch.elastic_worker import (
    Worker,
    check_before_store,
    check_environment,
    last_round,
    present_nodes,
    snapshot_folder,
    this_node,
)
from hetero_llm.launch.node import run_rank
from hetero_llm.layout import Layout
from hetero_llm.plan import Plan, compile_plan
from hetero_llm.planner import load_cluster, output, plan_cluster
from hetero_llm.planner.cluster import Cluster
from hetero_llm.train.options import RunOptions

_TORCHRUN_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_RESTART_COUNT",
)
_POLL_S = 0.2
_START_S = 60.0  # how long a worker waits for the other workers of its round to arrive


def plan_for(cluster: Cluster, present: Sequence[str]) -> Layout:
    """The planner's layout for the nodes ``present`` (deterministic: the same input gives the same plan). The
    rendezvous master is the first present node unless ``cluster.master`` is present. Every round runs the cluster
    file's ``train.optimizer`` (the planner is not offered the other one), so each resumes the state the last saved."""
    spec = cluster.spec
    master = spec.master if spec.master in present else ""
    sub = attrs.evolve(
        cluster,
        spec=attrs.evolve(spec, nodes=tuple(n for n in spec.nodes if n.name in present), master=master),
        nodes=tuple(n for n in cluster.nodes if n.name in present),
        limits=attrs.evolve(cluster.limits, optimizers=(cluster.train.optimizer.value,)),
    )
    result = plan_cluster(sub)
    text = output.layout_text(sub, result.best, result.score, result.seed_score)
    return layout_mod.loads(text, file=cluster.file, base_dir=os.path.dirname(os.path.abspath(cluster.file)))


def layout_rank(plan: Plan, node: str, local_rank: int) -> int | None:
    """The rank the plan gives device ``node:local_rank``, or None (the plan leaves it idle)."""
    device = f"{node}:{local_rank}"
    return next((r.rank for r in plan.ranks if r.device_id == device), None)


def describe_round(plan: Plan, present: Sequence[str], cluster: Cluster, start: int) -> str:
    """The line a round prints: its nodes, the plan's shape and fingerprint, and where it starts."""
    devices = sum(len(cluster.spec.node(n).devices) for n in present)
    return (
        f"elastic: nodes {', '.join(present)} ({plan.world_size} ranks on {devices} of {cluster.num_devices} devices, "
        f"{len(plan.layout.pipelines)} pipeline(s)), plan {plan.fingerprint()[:12]}, "
        + (f"resuming at step {start}" if start else "starting at step 0")
    )


def run(cluster_file: str, node: str | None, options: RunOptions) -> None:
    """One elastic worker (see the module's docstring): its round, generation after generation while nodes are lost
    and the survivors recover in place (``launch/in_place.py``)."""
    worker = check_environment(os.environ)
    guards.watch_my_agent()  # a worker whose agent is killed ends, naming why, instead of training on alone
    cluster = load_cluster(cluster_file)
    me = this_node(cluster, node, worker)
    check_before_store(cluster, options)
    snapshots, key = None, None
    if options.snapshot[1]:  # before the members meet: no worker reads or writes the folder before all checked it
        key = trust.run_key(str(options.checkpoint))
        snapshots = trust.private_folder(snapshot_folder(options.checkpoint))
    # the round's workers start together but import torch first: on a loaded host that may take longer than
    # cluster.timeout_s, which bounds a training rank's silence, not a start
    timeout_s = max(_START_S, cluster.spec.timeout_s)
    store = _round_store(worker, timeout_s)
    store.set(f"member/{worker.rank}", json.dumps([me, worker.local_rank]))
    members = [tuple(json.loads(store.get(f"member/{r}"))) for r in range(worker.world_size)]
    present_nodes(cluster, members)  # two agents claiming one node: refused
    guards.check_shared(store, worker.rank, members, str(options.checkpoint))  # before any save is looked for
    liveness = in_place.Liveness(worker.host, worker.port, worker.rank, worker.world_size, timeout_s, worker.rank == 0)
    gen, recovered = in_place.Generation.first(members), ""
    try:
        while (failure := _generation(store, worker, me, cluster, gen, options, snapshots, key, recovered)) is not None:
            gen, recovered = in_place.recover(store, worker.rank, gen, liveness, failure, cluster.spec.timeout_s)
            liveness.generation = gen.number
    except BaseException:
        if snapshots is not None and last_round(os.environ, worker):
            shutil.rmtree(snapshots, ignore_errors=True)  # no round comes after this one: its snapshots go now
        raise
    finally:
        liveness.stop()
    if gen.number:  # the store lives in torchrun rank 0's process: it ends after every other worker let go of it
        in_place.leave(store, worker.rank, gen, cluster.spec.timeout_s)


def _generation(
    raw,
    worker: Worker,
    me: str,
    cluster: Cluster,
    gen: in_place.Generation,
    options: RunOptions,
    snapshots,
    key,
    recovered: str,
) -> RankFailure | None:
    """One generation of the round: plan for its nodes, agree on the save, run this worker's layout rank (or wait,
    idle). None when the run is over; the failure of this worker's rank (or another's, seen as the next generation
    opened) when the survivors are to recover in place."""
    store = raw if gen.number == 0 else _prefixed(raw, gen.prefix)
    rank, members = gen.rank_of(worker.rank), list(gen.members)
    present = present_nodes(cluster, members)
    t0 = time.perf_counter()
    lay = plan_for(cluster, present)
    plan = compile_plan(lay)
    planned_s = time.perf_counter() - t0
    store.set(f"plan/{rank}", plan.fingerprint())
    for r in range(len(members)):
        theirs = store.get(f"plan/{r}").decode()
        if theirs != plan.fingerprint():
            raise LayoutError(
                cluster.file,
                "cluster",
                f"elastic: worker {gen.ranks[r]} (node {members[r][0]}) planned another layout ({theirs[:12]}, this "
                f"worker {plan.fingerprint()[:12]}): every agent must run the same hetero_llm and cluster file",
            )
    external.check_environment(os.environ, plan.world_size)  # OMP_NUM_THREADS, HETERO_EMULATE_*, ...: one line
    # one worker picks the save, over the snapshots of every node present (their holders copy it to disk)
    resume, source = restart.agree(
        store, rank, members, lay, str(options.checkpoint), snapshots, key, cluster.spec.timeout_s
    )
    o = options
    outputs.check_run_paths(lay, o.metrics_jsonl, o.checkpoint, o.trace, resume, o.tensorboard)
    mine = layout_rank(plan, me, worker.local_rank)
    from hetero_llm.checkpoint import folders

    start = folders.find(resume).step if resume else 0
    if (done := guards.finished_line(start, lay.train.steps, resume)) is not None:  # the others trained it all
        _end_as_done(store, rank, len(members), worker.local_rank, done, snapshots, cluster.spec.timeout_s)
        return None
    if rank == 0 and not options.quiet:
        line = f"{describe_round(plan, present, cluster, start)}{source} (planned in {planned_s:.2f} s{recovered})"
        print(line, flush=True)
    idle = len(members) - plan.world_size
    if snapshots is not None and last_round(os.environ, worker):
        _clean_up_on_exit(snapshots)
    guards.TRAINING.set()  # a refusal from here on is the rank's failure (a port in use may be free next round)
    until = lambda: in_place.opened(raw, gen)  # noqa: E731  (another worker's rank failed: recover with it)
    if mine is None:
        if not _wait_for(store, plan.world_size, cluster.spec.timeout_s, forever=True, until=until):
            return RankFailure("elastic: another worker's rank failed")
        store.add("idle-done", 1)
    else:
        _rank_environment(worker, gen)
        round_folder = snapshots / f"{plan.fingerprint()[:12]}-{start:06d}" if snapshots else None
        keep = (str(round_folder), options.snapshot[1]) if round_folder else (None, 0)
        # a peer that stops responding (a hung node): the heartbeat opens the next generation instead of exiting
        lost = lambda cause: in_place.open_next(raw, gen, worker.rank, cause)  # noqa: E731
        try:
            run_rank(plan, mine, attrs.evolve(options, resume=resume, snapshot=keep, on_lost_peer=lost))
        except RankFailure as failure:  # a peer lost (its connection closed): the survivors recover in place
            failure.__traceback__ = None  # (its frames held this generation's groups and stores)
            return failure
        store.add("finished", 1)
        if not _wait_for(store, plan.world_size, cluster.spec.timeout_s, forever=True, until=until):
            return RankFailure("elastic: another worker's rank failed after this one finished")
    if snapshots is not None and worker.local_rank == 0:  # one worker per node removes its node's snapshots
        if _wait_for(store, plan.world_size, cluster.spec.timeout_s):  # once the run is over (every rank done)
            shutil.rmtree(snapshots, ignore_errors=True)  # (a failed round keeps them for the next)
        store.add("snapshots-removed", 1)
    if rank == 0:  # this round's store lives in torchrun rank 0's process: let the others read it to the end
        _wait_for(store, plan.world_size, cluster.spec.timeout_s, idle=idle, removed=len(present) if snapshots else 0)
    return None


def _prefixed(store, prefix: str):
    import torch.distributed as dist

    return dist.PrefixStore(prefix, store)


def _rank_environment(worker: Worker, gen: in_place.Generation) -> None:
    """The environment a layout rank runs in: as ``hetero-launch LAYOUT --rank R`` (torchrun's variables gone) in
    the first generation, whose ranks meet at the layout's own rendezvous; in a later one they meet in the round's
    store under the generation's keys, as torchrun's workers do in its agent's store (the layout's rendezvous
    port may still be held by the first generation's server, in a survivor's process)."""
    for var in _TORCHRUN_VARS:
        os.environ.pop(var, None)
    if gen.number:
        os.environ.update(
            MASTER_ADDR=worker.host,
            MASTER_PORT=str(worker.port),
            TORCHELASTIC_USE_AGENT_STORE="True",
            TORCHELASTIC_RESTART_COUNT=f"{worker.restart}g{gen.number}",
        )


def _end_as_done(
    store, rank: int, world_size: int, local_rank: int, line: str, snapshots: Path | None, timeout_s: float
) -> None:
    """A round whose save has every step trained: rank 0 says so, each node's local rank 0 removes its snapshots
    (the run is over), rank 0 keeps the round's store up until every worker read it; every worker exits 0."""
    if rank == 0:
        print(line, flush=True)
    if snapshots is not None and local_rank == 0:
        shutil.rmtree(snapshots, ignore_errors=True)
    guards.end_finished_round(store, rank, world_size, timeout_s)


def _clean_up_on_exit(snapshots: Path) -> None:
    """In a last round, the ways a worker ends besides an exception also remove the snapshots: its agent stopping
    it (SIGTERM: torchrun stops a failed round's other workers so) becomes SystemExit, which the round's clean-up
    sees; its heartbeat giving up on a silent peer (which ends the process at once) removes them first."""
    import signal

    from hetero_llm.comm import heartbeat

    def stopped(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stopped)
    heartbeat.BEFORE_EXIT.append(lambda: shutil.rmtree(snapshots, ignore_errors=True))


def _round_store(worker: Worker, timeout_s: float):
    """This round's store, served by torchrun's rank 0 at MASTER_ADDR:MASTER_PORT (torch's rule for env://). A
    client probes with plain sockets first, retrying within ``timeout_s``: torch's client prints a page of C++ on
    a failed connect, before the one line that says why."""
    import socket
    from datetime import timedelta

    import torch.distributed as dist

    from hetero_llm.comm import rendezvous

    deadline = time.monotonic() + timeout_s
    if worker.rank != 0:
        try:
            reached = rendezvous.reach(worker.host, worker.port, deadline)
        except socket.gaierror as e:
            reached = f"the host does not resolve ({e.strerror})"
        if isinstance(reached, str) or not rendezvous.ping(reached, deadline):
            why = reached if isinstance(reached, str) else "what answers there is not a store"
            raise RankFailure(
                f"elastic: worker {worker.rank} could not reach this round's store at {worker.host}:{worker.port} "
                f"within {timeout_s:g} s (last: {why}); is torchrun's rank 0 of this round started?"
            )
    try:
        return dist.TCPStore(
            worker.host,
            worker.port,
            worker.world_size,
            worker.rank == 0,
            timeout=timedelta(seconds=timeout_s),  # also each operation's: a get waits for the slowest worker
            wait_for_workers=False,
        )
    except (RuntimeError, TimeoutError, ValueError) as e:
        raise RankFailure(
            f"elastic: worker {worker.rank} could not reach this round's store at {worker.host}:{worker.port}: "
            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from None


def _wait_for(
    store,
    ranks: int,
    timeout_s: float,
    idle: int = 0,
    removed: int = 0,
    forever: bool = False,
    until: Callable[[], bool] | None = None,
) -> bool:
    """Until ``ranks`` layout ranks finished (and ``idle`` idle workers saw it, ``removed`` nodes removed their
    snapshots): True; bounded by ``timeout_s`` unless ``forever`` (an idle worker waits out the whole training;
    torchrun stops it if the round fails). False when the time ran out, the store went away or ``until()`` holds
    (the next generation opened: a rank failed)."""
    deadline = time.monotonic() + timeout_s
    counts = {"finished": ranks, "idle-done": idle, "snapshots-removed": removed}
    while forever or time.monotonic() < deadline:
        try:
            if all(store.add(key, 0) >= n for key, n in counts.items()):
                return True
            if until is not None and until():
                return False
        except Exception:  # the store's process ended: the round is over either way
            if forever:
                sys.stderr.write("elastic: this round's store (torchrun's rank 0) went away; ending this worker\n")
                raise SystemExit(1) from None
            return False
        time.sleep(_POLL_S)
    return False
