"""An elastic run (``hetero-launch CLUSTER.toml --elastic``, docs/elastic.md) losing a node and getting it back.

Three emulated nodes on this machine, one torchrun elastic agent each (bench/elastic_agents.py): n0 with two CPU
devices, n1 and n2 with one; each node's devices are slowed by its own ``HETERO_EMULATE_SLOWDOWN`` (sleeps after
each compute action: nodes of different speeds, the numbers unchanged). Node n2 (its agent and workers) is
SIGKILLed once step N is recorded and started again once step M is; the run goes on to the last step. It saves
to disk every 5 steps and snapshots every step into /dev/shm (``--snapshot-every 1``): a round resumes from the
newer of the two.
Measured with this script's clock (polling every 50 ms):

- detection: the kill -> every survivor's worker has exited (their collectives failed, or the heartbeat named
  the silent rank within cluster.timeout_s);
- restart: -> the survivors' round line (torchrun's rendezvous without n2, its keep-alive expired, workers started,
  the plan made: its own time is the line's "planned in");
- restore: the round line -> the first new step recorded, less that step's own time (the layout's rendezvous,
  reading the save, resharding);
- recovery = detection + restart + restore (the redone steps excluded); steps redone = recorded at the kill -
  the step the round resumed at. The same for the node's return (a membership change: no failure to detect).
- tokens/s of each membership (median over its steps) and the loss per step against the one-process run.

    python -m bench.elastic
    python -m bench.elastic --quick
"""

from __future__ import annotations

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

from bench import benchlib as B
from bench import elastic_agents as A
from hetero_llm.launch.elastic import snapshot_folder

NAME = "elastic"
NODES = {"n0": 2, "n1": 1, "n2": 1}
SLOWDOWN = {"n0": 6.0, "n1": 8.0, "n2": 10.0}  # emulated node speeds (n2 the slowest)
SAVES = (5, 1)  # a disk save every 5 steps, a snapshot in memory every step
REFERENCE = Path(__file__).resolve().parents[1] / "layouts" / "reference" / "reference.toml"
# No TP: with all three nodes the planner would put a TP-2 stage (6 microbatches of 1 row) on n0, which on this
# bench's shared 2-core machine trains 3-4x slower than its max_tp = 1 plan (many small cross-process
# all-reduces; docs/benchmarks.md, "TP under emulated slowdown"). The recoveries measured here do not depend on it;
# tests/test_elastic.py's hung-node test runs the TP plan.
MAX_TP = 1


class _Run:
    """The agents of one run and what the script saw, with its own clock."""

    def __init__(self, work: Path, steps: int):
        self.work, self.steps = work, steps
        self.cluster = work / "cluster.toml"
        self.cluster.write_text(
            A.cluster_text(REFERENCE.read_text().split("[cluster]")[0], NODES, steps, B.free_port(), MAX_TP)
        )
        self.rdzv = B.free_port()
        self.agents: dict[str, subprocess.Popen] = {}
        self.metrics = work / "m.jsonl"
        self.killed: set[str] = set()

    def start(self, node: str) -> None:
        self.killed.discard(node)
        self.agents[node] = A.start_agent(self.cluster, node, NODES[node], self.rdzv, self.work, SLOWDOWN[node], SAVES)

    def recorded(self) -> int:
        return len(self.metrics.read_text().splitlines()) if self.metrics.exists() else 0

    def wait(self, what: str, condition, timeout: float = 300) -> float:
        deadline = time.monotonic() + timeout
        while not condition():
            failed = [n for n, a in self.agents.items() if n not in self.killed and a.poll() not in (None, 0)]
            if time.monotonic() > deadline or failed:
                raise SystemExit(f"{NAME}: gave up waiting for {what} (failed agents: {failed}); logs in {self.work}")
            time.sleep(0.05)
        return time.monotonic()

    def round_with(self, nodes: str, after: int):
        """The first round line for ``nodes`` that starts at or after step ``after``, or None."""
        return next((r for r in A.rounds(self.work) if A.members(r) == nodes and A.start_step(r) >= after), None)

    def stop(self) -> None:
        for agent in self.agents.values():
            A.signal_node(agent, signal.SIGKILL)
        shutil.rmtree(snapshot_folder(str(self.work / "ckpt")), ignore_errors=True)  # a finished run removed it


def _recovery(run: _Run, t0: float, t_detected: float, nodes: str, after: int, recorded: int) -> dict:
    """The times and steps of a recovery that began at ``t0``: the round for ``nodes`` and its first new step."""
    t_round = run.wait(f"the round of {nodes}", lambda: run.round_with(nodes, after) is not None)
    line = run.round_with(nodes, after)
    start = A.start_step(line)
    t_step = run.wait(f"a step of the round of {nodes}", lambda: run.recorded() > start)
    step_s = json.loads(run.metrics.read_text().splitlines()[start])["seconds"]
    planned = float(re.search(r"planned in ([0-9.]+) s", line).group(1))
    return {
        "members": nodes,
        "detection_s": t_detected - t0,
        "restart_s": t_round - t_detected,
        "planning_s": planned,
        "restore_s": max(0.0, t_step - t_round - step_s),
        "recovery_s": (t_detected - t0) + (t_round - t_detected) + max(0.0, t_step - t_round - step_s),
        "resumed_at": start,
        "steps_redone": max(0, recorded - start),
    }


def scenario(work: Path, steps: int, kill_at: int, back_at: int) -> tuple[list[dict], list[dict], list[str], bool]:
    """Run it: the recoveries, the metrics rows, the round lines and whether snapshots were left behind."""
    run = _Run(work, steps)
    try:
        run.start("n0")  # it serves torchrun's rendezvous: first
        time.sleep(1.0)
        run.start("n1")
        run.start("n2")
        run.wait("the first round", lambda: run.round_with("n0, n1, n2", 0) is not None)
        run.wait(f"step {kill_at}", lambda: run.recorded() >= kill_at)
        survivors = [w for n in ("n0", "n1") for w in A.children(run.agents[n].pid)]
        recorded = run.recorded()
        t_kill = time.monotonic()
        A.signal_node(run.agents["n2"], signal.SIGKILL)
        run.killed.add("n2")
        B.say(f"{NAME}: killed node n2 after step {recorded}")
        t_detected = run.wait(
            "the survivors' workers to exit", lambda: not any(Path(f"/proc/{p}").exists() for p in survivors)
        )
        lost = _recovery(run, t_kill, t_detected, "n0, n1", 0, recorded)
        B.say(f"{NAME}: re-planned without n2: recovery {lost['recovery_s']:.1f} s")
        run.wait(f"step {back_at}", lambda: run.recorded() >= back_at)
        recorded = run.recorded()
        t_back = time.monotonic()
        run.start("n2")
        back = _recovery(run, t_back, t_back, "n0, n1, n2", lost["resumed_at"] + 1, recorded)
        B.say(f"{NAME}: n2 back: recovery {back['recovery_s']:.1f} s")
        for node in ("n0", "n1", "n2"):
            if run.agents[node].wait(600) != 0:
                raise SystemExit(f"{NAME}: node {node}'s agent failed; logs in {work}")
        left = snapshot_folder(str(work / "ckpt")).exists()  # a finished run removes its snapshots
    finally:
        run.stop()
    rows = [json.loads(line) for line in run.metrics.read_text().splitlines()]
    return [lost, back], rows, A.rounds(work), left


def rates(rows: list[dict], lines: list[str]) -> list[dict]:
    """tokens/s of each round's steps (median; a round's first step, which includes its start, left out)."""
    starts = [A.start_step(r) for r in lines]
    out = []
    for i, line in enumerate(lines):
        end = starts[i + 1] if i + 1 < len(lines) else len(rows)
        own = [r["tokens"] / r["seconds"] for r in rows[starts[i] + 1 : end]]
        if own:
            out.append(
                {"members": A.members(line), "steps": f"{starts[i] + 1}..{end}", "tokens_s": statistics.median(own)}
            )
    return out


def plot(rows: list[dict], ref: list[float], recoveries: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    steps = [r["step"] for r in rows]
    ax.plot(steps, ref, "k-", label="one process, uninterrupted")
    ax.plot(steps, [r["loss"] for r in rows], "o", mfc="none", label="elastic: n2 lost, then back")
    for rec, what in zip(recoveries, ("n2 lost", "n2 back")):
        ax.axvline(rec["resumed_at"] + 0.5, color="grey", ls=":")
        ax.text(rec["resumed_at"] + 0.6, max(ref), what, fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def save_cost(tmp: Path, steps: int, reps: int) -> list[dict]:
    """Wall seconds per step that a save every step adds to the one-process run of the reference model, into a
    folder on disk (``--checkpoint-every 1``, what a round resumes from otherwise) and into /dev/shm (a synchronous
    save, what a snapshot was before it was overlapped: bench/snapshot_cost.py measures the overlapped one), against
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


@click.command()
@click.option("--quick", is_flag=True, help="Smoke run: fewer steps.")
@click.option("--out-dir", type=click.Path(file_okay=False, path_type=Path), default=B.RESULTS, show_default=True)
def main(quick, out_dir):
    """Kill an emulated node at step N, bring it back at step M: recovery times, tokens/s, losses."""
    steps, kill_at, back_at = (30, 3, 6) if quick else (60, 8, 20)
    info, before = B.machine(), B.load_average()
    B.say(f"{NAME}: {B.machine_line(info)}; load {before[0]:.2f}")
    with tempfile.TemporaryDirectory(prefix="bench_elastic_") as tmp:
        one = Path(tmp, "one")
        one.mkdir()
        layout = one / "l.toml"
        layout.write_text(REFERENCE.read_text().replace("steps = 3", f"steps = {steps}"))
        ref = [r["loss"] for r in B.run_layout(layout, one, env=B.clean_env({"OMP_NUM_THREADS": "1"}))]
        work = Path(tmp, "run")
        work.mkdir()
        recoveries, rows, lines, left = scenario(work, steps, kill_at, back_at)
        cost = save_cost(Path(tmp), 10 if quick else 30, 1 if quick else 3)
    after = B.load_average()
    worst = max(abs(r["loss"] - b) / abs(b) for r, b in zip(rows, ref))
    continuous = [r["step"] for r in rows] == list(range(1, steps + 1))
    per_round = rates(rows, lines)
    verdict = "met" if all(r["recovery_s"] <= 15 for r in recoveries) else "MISSED"
    md = "\n".join(
        [
            *B.report_head(NAME, info, before, after),
            "Emulated nodes on one machine (one torchrun agent each, HETERO_EMULATE_SLOWDOWN "
            + ", ".join(f"{n} x{s:g}" for n, s in SLOWDOWN.items())
            + f"), {steps} steps, node n2 killed after step {kill_at} and started again after step {back_at}; "
            + f"--checkpoint-every {SAVES[0]} --snapshot-every {SAVES[1]}.",
            "",
            f"## Recoveries (target <= 15 s excluding redone steps: {verdict})",
            "",
            B.markdown_table(
                [
                    "event",
                    "members after",
                    "detection s",
                    "restart s",
                    "planning s",
                    "restore s",
                    "recovery s",
                    "resumed at step",
                    "steps redone",
                ],
                [
                    [
                        what,
                        r["members"],
                        B.fmt(r["detection_s"]),
                        B.fmt(r["restart_s"]),
                        B.fmt(r["planning_s"]),
                        B.fmt(r["restore_s"]),
                        B.fmt(r["recovery_s"]),
                        r["resumed_at"],
                        r["steps_redone"],
                    ]
                    for what, r in zip(("n2 killed", "n2 back"), recoveries)
                ],
            ),
            "",
            "## tokens/s per membership (median of each round's steps but its first)",
            "",
            B.markdown_table(
                ["members", "steps", "tokens/s"], [[r["members"], r["steps"], B.fmt(r["tokens_s"])] for r in per_round]
            ),
            "",
            "## What a save every step costs (one-process run of the reference model, wall time vs no save)",
            "",
            B.markdown_table(
                ["saved into", "runs", "ms per step"],
                [[c["where"], c["runs"], B.fmt(c["save_ms_per_step"])] for c in cost],
            ),
            "",
            f"Losses vs the one-process run: max relative difference {worst:.2e} over {len(rows)} steps; "
            f"steps 1..{steps} each recorded once: {continuous}.",
        ]
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    plot(rows, ref, recoveries, out_dir / f"{NAME}.png")
    md_path, _ = B.write_results(
        out_dir,
        NAME,
        md,
        {
            "machine": info,
            "load_before": before,
            "load_after": after,
            "results": recoveries,
            "rates": per_round,
            "rounds": lines,
            "max_rel_loss_diff": worst,
            "steps_continuous": continuous,
            "snapshots_left_behind": left,
            "save_cost": cost,
            "steps": [r["step"] for r in rows],
            "losses": [r["loss"] for r in rows],
            "reference_losses": ref,
        },
    )
    B.say(f"wrote {md_path}")
    if not continuous or worst > 1e-5:
        raise SystemExit(f"{NAME}: the elastic run did not train the one-process model (max rel. diff {worst:.2e})")


if __name__ == "__main__":
    main()
