"""What a restart from snapshots held on other nodes costs (``checkpoint/holders.py``, ``launch/restart.py``).

The reference model (``--hidden`` sets its width), a layout of two pipelines of two stages (4 ranks, DP 2 x PP 2)
placed on three emulated nodes as a plan may place them: n0 runs both stage-0 ranks, n1 and n2 one stage-1 rank
each. Every rank snapshots at step 5 into its node's folder (each node its own folder under /dev/shm: its memory);
a disk save of step 3 is in ``--checkpoint DIR`` (a temporary folder on disk). n2 is lost (its folder removed), so
no surviving node holds every block. The round of n0 and n1 (one worker each, threads of this process over a real
TCPStore, as torchrun's workers talk over theirs) then agrees where to resume: ``restart.agree``, which publishes
what each node holds, chooses step 5, has n0 and n1 copy their files into ``DIR/step-000005`` (sha256 checked)
and seals it. Measured, interleaved ``reps`` times, medians: that agreement (the slowest worker's wall time), the
same round without snapshots (it resumes from the disk save: only the chooser's look at ``DIR``), and the copy
alone (``holders.copy_into`` of the same files, one after the other) and the checks ``--resume`` makes, which the
chooser runs on the copy before sealing it (``shards.check_resumable``). Mode: one process, CPU, threads.
Usage: ``python -m bench.elastic.snapshot_restart [--hidden 256] [--quick]``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import shutil
import statistics
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import click

from bench.common import benchlib as B
from hetero_llm import layout as layout_mod
from hetero_llm.checkpoint import folders, holders, shards, snapshots, trust
from hetero_llm.launch import restart
from hetero_llm.plan import Plan, compile_plan

NAME = "snapshot_restart"
REFERENCE = B.ROOT / "layouts" / "reference" / "reference.toml"
PLACED = {"n0": [0, 2], "n1": [1], "n2": [3]}  # which ranks of ``dp_pp_plan`` ran on which emulated node
PIPELINE = """
[[pipelines]]
batch = 6
microbatches = 3
[[pipelines.stages]]
layers = 3
devices = ["n0:{i}"]
[[pipelines.stages]]
layers = 3
devices = ["n1:{i}"]
"""


def dp_pp_plan(folder: Path, hidden: int = 32, steps: int = 20) -> Plan:
    """The reference model (width ``hidden``) as two pipelines of two stages: ranks 0 and 2 hold stage 0, ranks 1
    and 3 stage 1 (every block has two holders)."""
    text = REFERENCE.read_text().replace("steps = 3", f"steps = {steps}").replace("hidden = 32", f"hidden = {hidden}")
    nodes = "".join(f'[[cluster.nodes]]\nname = "n{n}"\ndevices = ["cpu", "cpu"]\n' for n in range(2))
    path = folder / f"dp_pp_h{hidden}.toml"
    path.write_text(
        text[: text.index("[cluster]")] + "[cluster]\n" + nodes + PIPELINE.format(i=0) + PIPELINE.format(i=1)
    )
    return compile_plan(layout_mod.load(str(path)))


def rank_state(plan: Plan, rank: int):
    """Rank ``rank`` of ``plan``: its plan, state and optimizer after one step on made-up gradients (equal across
    DP replicas, as in training), so that the optimizer has moments."""
    import torch

    from hetero_llm.runtime.state import init_state, make_optimizer

    rp = plan.rank_plan(rank)
    state = init_state(rp, torch.device("cpu"))
    optimizer = make_optimizer(state, rp.train)
    for p in state.params.values():
        p.grad = torch.full_like(p, 0.01)
    optimizer.step()
    return rp, state, optimizer


def snapshot_ranks(plan: Plan, root: Path, step: int, ranks, key: bytes) -> dict[int, tuple]:
    """Ranks ``ranks`` of ``plan`` (``rank_state``) take a snapshot at ``step`` into round folder ``root``, their
    records signed with ``key`` (the run's: ``trust.run_key`` of its --checkpoint DIR); their (state, optimizer) by
    rank."""
    states = {}
    for r in ranks:
        rp, state, optimizer = rank_state(plan, r)
        writer = snapshots.SnapshotWriter(rp, root, key)
        writer.take(state, optimizer, step)
        writer.wait()
        states[r] = (state, optimizer)
    return states


def agree_round(
    plan: Plan, checkpoint: Path, shm: Path | None, nodes: list[str], timeout_s: float = 20.0
) -> dict[str, tuple]:
    """One elastic round of the nodes ``nodes`` (one worker each, the first torchrun's rank 0; ``shm/NODE``: each
    node's snapshot folder, None: no snapshots), threads over a real TCPStore: per node, what ``restart.agree``
    returned (or raised, as a 1-tuple) and the seconds it took."""
    key = trust.run_key(checkpoint) if shm else None
    server = _store(len(nodes), True, 0)
    members = [(n, 0) for n in nodes]
    results: dict[str, tuple] = {}

    def worker(rank: int) -> None:
        store = _store(len(nodes), False, server.port)
        t0 = time.perf_counter()
        try:
            got = restart.agree(
                store, rank, members, plan.layout, str(checkpoint), shm / nodes[rank] if shm else None, key, timeout_s
            )
            results[nodes[rank]] = (got, time.perf_counter() - t0)
        except Exception as e:  # reported, not lost in the thread
            results[nodes[rank]] = (e,)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(len(nodes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


def _store(world: int, master: bool, port: int):
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, world, master, timeout=timedelta(seconds=30), wait_for_workers=False)


def one_rep(plan: Plan, tmp: Path, shm: Path) -> dict[str, float]:
    """One measurement of each kind (see the module's docstring); the snapshots written anew (not timed)."""
    ckpt, step = tmp / "ckpt", 5
    for node, ranks in PLACED.items():
        snapshot_ranks(plan, shm / node / "a-000000", step, ranks, trust.run_key(ckpt))
    shutil.rmtree(shm / "n2")  # lost with its node
    choice = holders.choose({n: holders.held(shm / n, trust.run_key(ckpt)) for n in ("n0", "n1")}, plan.layout, 3)
    assert choice is not None and choice.nodes == ["n0", "n1"], choice
    alone = tmp / "alone"
    alone.mkdir()
    t0 = time.perf_counter()
    holders.copy_into(shm / "n0", alone, [f for f in choice.files if f.node == "n0"], lambda n: None)
    holders.copy_into(shm / "n1", alone, [f for f in choice.files if f.node == "n1"], lambda n: None)
    copy_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    copied = holders.unsealed(alone, choice, plan.layout)
    folders.check_fits(copied, plan.layout)
    shards.check_resumable(copied)
    check_s = time.perf_counter() - t0
    shutil.rmtree(alone)
    memory = agree_round(plan, ckpt, shm, ["n0", "n1"])
    folder = folders.step_folder(ckpt, step)
    assert all(r[0] == (str(folder), f"{restart.MEMORY} held on n0, n1") for r in memory.values()), memory
    shutil.rmtree(folder)  # back to the disk save of step 3 for the next measurement
    (ckpt / folders.LATEST).write_text("step-000003\n")
    disk = agree_round(plan, ckpt, None, ["n0", "n1"])
    assert all(r[0] == (str(folders.step_folder(ckpt, 3)), "") for r in disk.values()), disk
    return {
        "memory_s": max(r[1] for r in memory.values()),
        "disk_s": max(r[1] for r in disk.values()),
        "copy_s": copy_s,
        "check_s": check_s,
        "copied_mb": sum(f.size for f in choice.files) / 1e6,
    }


def disk_save(plan: Plan, tmp: Path, step: int) -> Path:
    """A complete save of ``plan``'s every rank at ``step`` in ``tmp/ckpt`` (made as a round makes one)."""
    key = trust.run_key(tmp / "ckpt")
    snapshot_ranks(plan, tmp / "d" / "a-000000", step, range(plan.world_size), key)
    choice = holders.choose({"d": holders.held(tmp / "d", key)}, plan.layout, -1)
    assert choice is not None
    folder = folders.step_folder(tmp / "ckpt", step)
    holders.begin(folder)
    holders.copy_into(tmp / "d", folder, choice.files, lambda n: None)
    holders.seal(folder, choice, plan.layout)
    shutil.rmtree(tmp / "d")
    return folder


@click.command()
@click.option("--quick", is_flag=True, help="Smoke run: one repetition.")
@click.option("--hidden", default=32, show_default=True, help="The model's width (the reference model's: 32).")
@click.option("--reps", default=5, show_default=True, help="Repetitions (medians).")
@click.option("--out-dir", type=click.Path(file_okay=False, path_type=Path), default=B.RESULTS, show_default=True)
def main(quick, hidden, reps, out_dir):
    """The cost of a restart from snapshots held across two nodes, against one from the disk save."""
    reps = 1 if quick else reps
    info, before = B.machine(), B.load_average()
    B.say(f"{NAME}: {B.machine_line(info)}; load {before[0]:.2f}")
    shm = Path("/dev/shm") / f"bench_{NAME}_{os.getpid()}"
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix=f"bench_{NAME}_") as tmp:
            plan = dp_pp_plan(Path(tmp), hidden)
            disk_save(plan, Path(tmp), 3)
            for rep in range(reps):
                rows.append(one_rep(plan, Path(tmp), shm))
                B.say(f"  rep {rep}: " + ", ".join(f"{k} {v:.4f}" for k, v in rows[-1].items()))
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    after = B.load_average()
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    md = "\n".join(
        [
            *B.report_head(NAME, info, before, after),
            f"The reference model at hidden {hidden}, 2 pipelines x 2 stages on emulated nodes n0 (both stage-0 "
            f"ranks), n1 and n2 (a stage-1 rank each); n2 lost; one process, CPU, the two workers as threads over a "
            f"TCPStore; snapshots in /dev/shm, `--checkpoint DIR` in a temporary folder on disk; {reps} rep(s), "
            "medians.",
            "",
            "| round resumes from | agreement ms (slowest worker) | the copy alone ms | its check alone ms | MB copied |",
            "| --- | --- | --- | --- | --- |",
            f"| the snapshot of step 5 held on n0 and n1 | {1e3 * med['memory_s']:.1f} | {1e3 * med['copy_s']:.1f} | "
            f"{1e3 * med['check_s']:.1f} | {med['copied_mb']:.2f} |",
            f"| the disk save of step 3 (no snapshots) | {1e3 * med['disk_s']:.1f} | 0 | 0 | 0 |",
        ]
    )
    B.say(md)
    name = NAME if hidden == 32 else f"{NAME}_h{hidden}"
    B.write_results(out_dir, name, md, {"hidden": hidden, "reps": reps, "load": [before, after], "rows": rows})


if __name__ == "__main__":
    main()
