"""An elastic run (``hetero-launch CLUSTER.toml --elastic``, docs/elastic.md) losing a node and getting it back.

Three emulated nodes, one torchrun elastic agent each (bench/elastic/elastic_agents.py): n0 with two CPU devices, n1 and n2
with one. By default each node is a network namespace of the netns testbed (bench/testbed/: its own address, links
shaped with tc), its agent and workers run inside it and meet over the shaped links (torchrun's c10d rendezvous
served by n0's agent, gloo on the testbed's interface); ``--one-machine`` (and ``--quick``) runs every agent on
this machine's loopback. Each node's devices are emulated devices (``HETERO_EMULATE_DEVICE``, GFLOP/s per node:
every compute action lasts its modelled time, the real computation inside it, the numbers unchanged), and the
cluster file declares the same speeds to the planner (``[plan.kinds]``, priced by FLOPs: the same durations) and
the links' bandwidth and latency, so each round's plan and its predicted tokens/s are for the devices that run.
Node n2 (its agent and workers) is SIGKILLed once step N is recorded (``--hang``: SIGSTOPped, a hung node whose
sockets stay open; ``--partition``: its testbed link taken down) and started again once step M is; the run goes on
to the last step. It saves to disk every 5 steps and snapshots every step into node memory (``--snapshot-every 1``;
each node its own /dev/shm folder, removed with the node when it is lost, so a round resumes from snapshots the
nodes present hold): a round resumes from the newer of the two.
Measured with this script's clock (polling every 50 ms). A loss recovered in place (the survivors keep their
processes, launch/in_place.py):

- detection: the loss -> a survivor's rank failed (at once for a kill; a hang: its heartbeat named n2, after
  cluster.timeout_s) -> the survivors agreed on the membership (the round line's "agreed in");
- planning: the round line's "planned in"; restore: the rest until the first new step recorded, less that step's
  own time (the layout's rendezvous in the round's store, reading the snapshot, resharding);
- recovery = detection + planning + restore (the redone steps excluded); steps redone = recorded at the loss - the
  step the round resumed at.

A loss or a return that restarts every worker (the node's return today):

- detection: the loss -> every survivor's worker has exited; restart: -> the survivors' round line (torchrun's
  rendezvous, workers started, the plan made); restore as above; recovery = detection + restart + restore.
- tokens/s of each membership (median over its steps but its first) against the planner's prediction for the plan
  the round ran (planned here by the workers' own function, its fingerprint checked against the round line's);
- the loss per step against the one-process run (a plot).

    python -m bench.elastic.elastic                  # the netns testbed (root)
    python -m bench.elastic.elastic --one-machine    # every agent on loopback
    python -m bench.elastic.elastic --quick          # one machine, 20 steps (the test suite)
    python -m bench.elastic.elastic --quick --hang   # n2 hung, not killed (--hang-worker: its worker only)
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import click

from bench import testbed as T
from bench.common import benchlib as B
from bench.elastic import elastic_agents as A
from bench.elastic import elastic_report as R
from hetero_llm.launch.elastic import plan_for
from hetero_llm.launch.elastic_worker import snapshot_folder
from hetero_llm.plan import compile_plan
from hetero_llm.planner.cluster import load_cluster
from hetero_llm.planner.evaluate import evaluate

NAME = "elastic"
NODES = {"n0": 2, "n1": 1, "n2": 1}
# Emulated device speeds, GFLOP/s per device (n2 the slowest): the planner's [plan.kinds] (FLOPs pricing) and the
# runtime's HETERO_EMULATE_DEVICE, so each compute action lasts what the planner charges for it. Slow enough that
# an action (tens of ms) holds the real computation of the reference model inside it on a loaded 2-core machine.
GFLOPS = {"n0": 0.05, "n1": 0.04, "n2": 0.03}
TESTBED_LINK = (1.0, 100.0)  # the testbed's fabric: Gbit/s each way, one-way us (tc shaped; declared to the planner)
LOOPBACK_LINK = (10.0, 20.0)  # one machine: fast links declared (loopback is fast)
SAVES = (5, 1)  # a disk save every 5 steps, a snapshot in memory every step
REFERENCE = Path(__file__).resolve().parents[2] / "layouts" / "reference" / "reference.toml"
# No TP: with all three nodes the planner would put a TP-2 stage (6 microbatches of 1 row) on n0, which on this
# bench's shared 2-core machine trains 3-4x slower than its max_tp = 1 plan (many small cross-process
# all-reduces; docs/benchmarks_history.md, "TP under emulated slowdown"). The recoveries measured here do not depend on it;
# tests/unit/test_elastic.py's hung-node test runs the TP plan.
MAX_TP = 1


class _Run:
    """The agents of one run and what the script saw, with its own clock; ``tb``: the testbed whose namespaces the
    nodes run in (None: this machine's loopback)."""

    def __init__(self, work: Path, steps: int, tb=None):
        self.work, self.steps, self.tb = work, steps, tb
        self.cluster = work / "cluster.toml"
        if tb is None:
            self.emulated = A.Emulated(GFLOPS, link=LOOPBACK_LINK)
        else:
            hosts = {n: tb.address(n, "domain") for n in NODES}
            self.emulated = A.Emulated(GFLOPS, hosts, TESTBED_LINK, tb.interface("domain"))
        common = REFERENCE.read_text().split("[cluster]")[0]
        self.cluster.write_text(A.cluster_text(common, NODES, steps, B.free_port(), MAX_TP, self.emulated))
        self.rdzv = B.free_port()
        self.agents: dict[str, subprocess.Popen] = {}
        self.metrics = work / "m.jsonl"
        self.killed: set[str] = set()

    def start(self, node: str) -> None:
        self.killed.discard(node)
        where = None
        if self.tb is not None:  # the agent in the node's namespace; n0 serves torchrun's rendezvous
            hosts = self.emulated.hosts
            where = A.Where(
                ("ip", "netns", "exec", self.tb.namespace(node)),
                hosts["n0"],
                f",is_host={int(node == 'n0')}",
                hosts[node],
            )
        device = self.emulated.device(node)
        self.agents[node] = A.start_agent(
            self.cluster,
            node,
            NODES[node],
            self.rdzv,
            self.work,
            saves=SAVES,
            device=device,
            where=where,
            shm=self.shm(node),
        )

    def shm(self, node: str) -> Path:
        """The node's own memory for snapshots (its HETERO_SHM_DIR): a lost node's snapshots go with it."""
        return Path("/dev/shm") / f"bench_elastic_{os.getpid()}_{node}"

    def snapshots_left(self) -> bool:
        name = snapshot_folder(str(self.work / "ckpt")).name
        return any((self.shm(node) / name).exists() for node in NODES)

    def recorded(self) -> int:
        return len(self.metrics.read_text().splitlines()) if self.metrics.exists() else 0

    def wait(self, what: str, condition, timeout: float = 300) -> float:
        deadline = time.monotonic() + timeout
        while not condition():
            failed = [n for n, a in self.agents.items() if n not in self.killed and a.poll() not in (None, 0)]
            if time.monotonic() > deadline or failed:
                tails = "".join(f"\n--- {p.name}\n" + p.read_text()[-2000:] for p in sorted(self.work.glob("*.log")))
                raise SystemExit(f"{NAME}: gave up waiting for {what} (failed agents: {failed}); logs:{tails}")
            time.sleep(0.05)
        return time.monotonic()

    def round_with(self, nodes: str, after: int):
        """The first round line for ``nodes`` that starts at or after step ``after``, or None."""
        return next((r for r in A.rounds(self.work) if A.members(r) == nodes and A.start_step(r) >= after), None)

    def stop(self) -> None:
        for agent in self.agents.values():
            A.signal_node(agent, signal.SIGKILL)
        for node in NODES:  # a finished run removed its snapshots; a failed one may not have
            shutil.rmtree(self.shm(node), ignore_errors=True)


def _recovery(run: _Run, t0: float, t_detected: float, nodes: str, after: int, recorded: int, old: list[int]) -> dict:
    """The times and steps of a recovery that began at ``t0``: n0's new workers (``old``: the workers before), the
    round for ``nodes`` and its first new step."""
    t_spawned = run.wait("n0's new workers", lambda: bool(set(A.children(run.agents["n0"].pid)) - set(old)))
    t_round = run.wait(f"the round of {nodes}", lambda: run.round_with(nodes, after) is not None)
    line = run.round_with(nodes, after)
    start = A.start_step(line)
    t_step = run.wait(f"a step of the round of {nodes}", lambda: run.recorded() > start)
    step_s = json.loads(run.metrics.read_text().splitlines()[start])["seconds"]
    planned = float(re.search(r"planned in ([0-9.]+) s", line).group(1))
    return {
        "members": nodes,
        "join_s": 0.0,
        "detection_s": t_detected - t0,
        "restart_s": t_round - t_detected,
        "rendezvous_s": t_spawned - t_detected,
        "worker_start_s": t_round - t_spawned,
        "planning_s": planned,
        "restore_s": max(0.0, t_step - t_round - step_s),
        "recovery_s": (t_detected - t0) + (t_round - t_detected) + max(0.0, t_step - t_round - step_s),
        "resumed_at": start,
        "steps_redone": max(0, recorded - start),
    }


def _recovery_in_place(run: _Run, t0: float, t_detected: float, nodes: str, recorded: int) -> dict:
    """The times and steps of a recovery in place that began at ``t0`` (the kill or the hang): no worker exits or
    starts; a survivor's rank fails (at once for a kill; ``t_detected``, when a heartbeat named the hung node), the
    survivors agree (the round line's "agreed in"), plan and resume in their processes."""
    line = run.round_with(nodes, 0)
    start = A.start_step(line)
    t_step = run.wait(f"a step of the round of {nodes}", lambda: run.recorded() > start)
    step_s = json.loads(run.metrics.read_text().splitlines()[start])["seconds"]
    planned = float(re.search(r"planned in ([0-9.]+) s", line).group(1))
    agreed = float(re.search(r"survivors agreed in ([0-9.]+) s", line).group(1))
    recovery = max(0.0, t_step - t0 - step_s)
    return {
        "members": nodes,
        "join_s": 0.0,
        # until a survivor's rank failed (a hang: its heartbeat's cluster.timeout_s), then the leader's decision
        "detection_s": (t_detected - t0) + agreed,
        "restart_s": 0.0,
        "rendezvous_s": 0.0,
        "worker_start_s": 0.0,
        "planning_s": planned,
        "restore_s": max(0.0, recovery - (t_detected - t0) - agreed - planned),
        "recovery_s": recovery,
        "resumed_at": start,
        "steps_redone": max(0, recorded - start),
        "in_place": True,
    }


def _link(tb, node: str, state: str) -> None:
    """Take the node's testbed link (its domain interface) down or up: a partition and its end."""
    subprocess.run(["ip", "-n", tb.namespace(node), "link", "set", tb.interface("domain"), state], check=True)


LOSSES = {
    "kill": "killed",
    "cut": "cut the link of",
    "hang": "stopped (SIGSTOP)",
    "hang-worker": "stopped the worker (SIGSTOP, its agent running) of",
}
HANDED_ON = "the survivors recover in place"  # a survivor's heartbeat named the hung node (train/rank.py)


def scenario(
    work: Path, steps: int, kill_at: int, back_at: int, tb=None, how: str = "kill"
) -> tuple[list[dict], list[dict], list[str], bool]:
    """Run it: the recoveries, the metrics rows, the round lines and whether snapshots were left behind; ``how`` n2
    is lost (``LOSSES``): killed; its link taken down (its processes live on, cut off: a hang to detect); or its
    agent and workers stopped (a hung node, its sockets open). At its return what is left of it is killed (and its
    link brought up) before its agent starts again."""
    run = _Run(work, steps, tb)
    try:
        run.start("n0")  # it serves torchrun's rendezvous: first
        if tb is None:  # on one machine the first agent to listen serves it (on the testbed: is_host says who)
            A.wait_serving(run.agents["n0"], run.rdzv)
        run.start("n1")
        run.start("n2")
        run.wait("the first round", lambda: run.round_with("n0, n1, n2", 0) is not None)
        run.wait(f"step {kill_at}", lambda: run.recorded() >= kill_at)
        survivors = [w for n in ("n0", "n1") for w in A.children(run.agents[n].pid)]
        recorded = run.recorded()
        t_kill = time.monotonic()
        run.killed.add("n2")
        if how == "cut":
            _link(tb, "n2", "down")
        else:
            if how == "hang-worker":  # its agent runs on, waiting for a worker that never ends
                for worker in A.children(run.agents["n2"].pid):
                    os.kill(worker, signal.SIGSTOP)
            else:
                A.signal_node(run.agents["n2"], signal.SIGKILL if how == "kill" else signal.SIGSTOP)
            shutil.rmtree(run.shm("n2"), ignore_errors=True)  # its memory is lost with it: its snapshots too
        B.say(f"{NAME}: {LOSSES[how]} node n2 after step {recorded}")
        named: dict[str, float] = {}  # a hang: when a survivor's heartbeat named n2 (its line in the agents' logs)

        def survivors_on() -> bool:
            if "at" not in named and any(HANDED_ON in p.read_text() for p in run.work.glob("n[01].*.log")):
                named["at"] = time.monotonic()
            return run.round_with("n0, n1", 0) is not None or not any(Path(f"/proc/{p}").exists() for p in survivors)

        # in place (the survivors keep their workers: launch/in_place.py), or a restart
        t_detected = run.wait("the survivors' round or their workers to exit", survivors_on)
        line = run.round_with("n0, n1", 0)
        if line is not None and ", in place: " in line:
            lost = _recovery_in_place(run, t_kill, named.get("at", t_kill), "n0, n1", recorded)
        else:
            lost = _recovery(run, t_kill, t_detected, "n0, n1", 0, recorded, survivors)
        B.say(f"{NAME}: re-planned without n2: recovery {lost['recovery_s']:.1f} s")
        run.wait(f"step {back_at}", lambda: run.recorded() >= back_at)
        running = [w for n in ("n0", "n1") for w in A.children(run.agents[n].pid)]
        t_back = time.monotonic()
        if how != "kill":  # the cut-off or stopped node's agent and workers (hung or failed) go, its link comes back
            A.signal_node(run.agents["n2"], signal.SIGKILL)
            if how == "cut":
                _link(tb, "n2", "up")
        run.start("n2")  # training goes on while its agent starts and joins: the running agents stop their workers
        t_stopped = run.wait(  # once they see it waiting at the rendezvous; the time not training starts there
            "the running workers to stop", lambda: not any(Path(f"/proc/{p}").exists() for p in running)
        )
        back = _recovery(run, t_stopped, t_stopped, "n0, n1, n2", lost["resumed_at"] + 1, run.recorded(), running)
        back["join_s"] = t_stopped - t_back
        B.say(f"{NAME}: n2 back: recovery {back['recovery_s']:.1f} s")
        for node in ("n0", "n1", "n2"):
            if run.agents[node].wait(600) != 0:
                raise SystemExit(f"{NAME}: node {node}'s agent failed; logs in {work}")
        left = run.snapshots_left()  # a finished run removes its snapshots
    finally:
        run.stop()
    rows = [json.loads(line) for line in run.metrics.read_text().splitlines()]
    return [lost, back], rows, A.rounds(work), left


def rates(rows: list[dict], lines: list[str], cluster_file: Path) -> list[dict]:
    """tokens/s of each round: measured (the median over its steps but its first, which includes its start) and
    the planner's prediction for the plan the round ran (planned here as every worker plans it: its fingerprint
    checked against the round line's)."""
    cluster = load_cluster(cluster_file)
    starts = [A.start_step(r) for r in lines]
    out = []
    for i, line in enumerate(lines):
        end = starts[i + 1] if i + 1 < len(lines) else len(rows)
        own = [r["tokens"] / r["seconds"] for r in rows[starts[i] + 1 : end]]
        if not own:
            continue
        members = A.members(line)
        lay = plan_for(cluster, members.split(", "))
        fingerprint = compile_plan(lay).fingerprint()[:12]
        if f"plan {fingerprint}," not in line:
            raise SystemExit(f"{NAME}: the round {line!r} ran another plan than {fingerprint}, planned here")
        predicted = evaluate(cluster, lay, str(cluster_file)).score
        measured = statistics.median(own)
        out.append(
            {
                "members": members,
                "plan": fingerprint,
                "shape": _shape(lay),
                "steps": f"{starts[i] + 2}..{end}",
                "tokens_s": measured,
                "predicted_tokens_s": predicted.tokens_per_s,
                "predicted_step_s": predicted.step_time,
                "measured_step_s": statistics.median(r["seconds"] for r in rows[starts[i] + 1 : end]),
                "ratio": measured / predicted.tokens_per_s,
            }
        )
    return out


def _shape(lay) -> str:
    """``zbh1: 3L@n0:0+3L@n0:1 / 6L@n1:0``: the schedule and each pipeline's stages (layers @ devices)."""
    pipes = (
        "+".join(f"{st.layers}L@{','.join(st.devices)}" for st in p.stages) + f" ({p.microbatches} mb)"
        for p in lay.pipelines
    )
    return f"{lay.train.schedule.value}: " + " / ".join(pipes)


def save_cost(tmp: Path, steps: int, reps: int) -> list[dict]:
    """Wall seconds per step that a save every step adds to the one-process run of the reference model, into a
    folder on disk (``--checkpoint-every 1``, what a round resumes from otherwise) and into /dev/shm (a synchronous
    save, what a snapshot was before it was overlapped: bench/elastic/snapshot_cost.py measures the overlapped one), against
    no save; the three runs interleaved ``reps`` times, medians."""
    layout = tmp / "cost.toml"
    layout.write_text(REFERENCE.read_text().replace("steps = 3", f"steps = {steps}"))
    shm = Path("/dev/shm") / f"bench_elastic_{os.getpid()}"
    walls: dict[str, list[float]] = {"none": [], "disk": [], "memory": []}
    env = B.clean_env({"OMP_NUM_THREADS": "1"})
    try:
        for rep in range(reps):
            for side, extra in (("none", ()), ("disk", (str(tmp / f"ck{rep}"),)), ("memory", (str(shm / f"ck{rep}"),))):
                run = B.launch_layout(layout, tmp / f"{side}{rep}", env=env, checkpoint=extra[0] if extra else None)
                walls[side].append(run.wall_s)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    base = statistics.median(walls["none"])
    return [
        {
            "where": side,
            "runs": len(walls[side]),
            "save_ms_per_step": 1e3 * (statistics.median(walls[side]) - base) / steps,
        }
        for side in ("disk", "memory")
    ]


def testbed_spec() -> T.TestbedSpec:
    """The nodes in one domain of the netns testbed, each link shaped to TESTBED_LINK (what the planner is told)."""
    gbps, us = TESTBED_LINK
    fabric = T.FabricSpec(f"{gbps * 1000:g}mbit", f"{us:g}us")
    nodes = tuple(T.EmulatedNode(n, "lan", GFLOPS[n]) for n in NODES)
    return T.TestbedSpec((T.EmulatedDomain("lan", fabric),), nodes, fabric)


@click.command()
@click.option("--quick", is_flag=True, help="Smoke run: fewer steps, on one machine.")
@click.option(
    "--one-machine", is_flag=True, help="Every node's agent on this machine's loopback, not in the netns testbed."
)
@click.option(
    "--no-save-cost",
    "skip_saves",
    is_flag=True,
    help="Skip measuring what a save every step costs the one-process run.",
)
@click.option(
    "--partition",
    is_flag=True,
    help="Lose n2 by cutting its link (ip link down: a hang to detect) instead of killing it (the testbed only).",
)
@click.option(
    "--hang",
    is_flag=True,
    help="Lose n2 by stopping its agent and workers (SIGSTOP: a hung node, its sockets open) instead of killing it.",
)
@click.option(
    "--hang-worker", is_flag=True, help="Lose n2 by stopping its worker only (SIGSTOP), its torchrun agent running on."
)
@click.option(
    "--work-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Keep the run's files (agents' logs, metrics, checkpoints) here instead of a temporary folder.",
)
@click.option("--out-dir", type=click.Path(file_okay=False, path_type=Path), default=B.RESULTS, show_default=True)
def main(quick, one_machine, partition, hang, hang_worker, skip_saves, work_dir, out_dir):
    """Kill an emulated node at step N, bring it back at step M: recovery times, tokens/s, losses."""
    steps, kill_at, back_at = (20, 3, 6) if quick else (60, 8, 20)  # quick: n2 joins with 14 steps left (a loaded host)
    testbed = not (quick or one_machine)
    if partition and not testbed:
        raise SystemExit(f"{NAME}: --partition cuts a testbed link: it cannot run with --quick or --one-machine")
    if partition + hang + hang_worker > 1:
        raise SystemExit(f"{NAME}: --partition, --hang and --hang-worker are ways to lose n2: pass one")
    how = "cut" if partition else "hang" if hang else "hang-worker" if hang_worker else "kill"
    name = NAME + {"kill": "", "cut": "_partition", "hang": "_hang", "hang-worker": "_hang_worker"}[how]
    if testbed:
        ok, why = T.available()
        if not ok:
            raise SystemExit(f"{NAME}: the netns testbed cannot run here ({why}): run as root, or pass --one-machine")
    info, before = B.machine(), B.load_average()
    B.say(f"{NAME}: {B.machine_line(info)}; load {before[0]:.2f}")
    with contextlib.ExitStack() as stack:
        tmp = str(work_dir) if work_dir else stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_elastic_"))
        Path(tmp).mkdir(parents=True, exist_ok=True)
        one = Path(tmp, "one")
        one.mkdir()
        layout = one / "l.toml"
        layout.write_text(REFERENCE.read_text().replace("steps = 3", f"steps = {steps}"))
        ref = [r["loss"] for r in B.run_layout(layout, one, env=B.clean_env({"OMP_NUM_THREADS": "1"}))]
        work = Path(tmp, "run")
        work.mkdir()
        with T.Testbed(testbed_spec()) if testbed else contextlib.nullcontext() as tb:
            recoveries, rows, lines, left = scenario(work, steps, kill_at, back_at, tb, how)
        timeout_s = load_cluster(work / "cluster.toml").spec.timeout_s  # what a hang is named after
        per_round = rates(rows, lines, work / "cluster.toml")
        cost = save_cost(Path(tmp), 10 if quick else 30, 1 if quick else 3) if not skip_saves else []
    after = B.load_average()
    worst = max(abs(r["loss"] - b) / abs(b) for r, b in zip(rows, ref))
    continuous = [r["step"] for r in rows] == list(range(1, steps + 1))
    setup = {
        "name": name,
        "gflops": GFLOPS,
        "link": TESTBED_LINK if testbed else LOOPBACK_LINK,
        "saves": SAVES,
        "steps": steps,
        "at": (kill_at, back_at),
        "testbed": testbed,
        "how": how,
        "timeout_s": timeout_s,
    }
    md = R.report(setup, info, before, after, recoveries, per_round, cost, worst, continuous)
    out_dir.mkdir(parents=True, exist_ok=True)
    R.plot(rows, ref, recoveries, out_dir / f"{name}.png", R.EVENT[how])
    md_path, _ = B.write_results(
        out_dir,
        name,
        md,
        {
            "machine": info,
            "load_before": before,
            "load_after": after,
            "results": recoveries,
            "mode": "netns testbed" if testbed else "one machine",
            "rates": per_round,
            "rounds": lines,
            "max_rel_loss_diff": worst,
            "steps_continuous": continuous,
            "snapshots_left_behind": left,
            "save_cost": cost,
            "steps": [r["step"] for r in rows],
            "step_seconds": [r["seconds"] for r in rows],
            "losses": [r["loss"] for r in rows],
            "reference_losses": ref,
        },
    )
    B.say(f"wrote {md_path}")
    if not continuous or worst > 1e-5:
        raise SystemExit(f"{NAME}: the elastic run did not train the one-process model (max rel. diff {worst:.2e})")


if __name__ == "__main__":
    main()
