"""One rank of the paired comparison: hetero_llm's training loop and torch.distributed.pipelining in turns,
in the same processes.

On a busy shared machine the load changes within seconds, so separate runs of the two sides see
different machines. Here every rank process holds both: ``hetero_llm.train.rank.train`` (the library's
own loop, runtime and communicators) and ``torch_pp_rank.TorchPipeline`` (on its own gloo group), and
runs them in alternating rounds of a few steps (ours, torch, torch, ours, ...), each round from
the initial parameters, so both sides train the same steps and their losses can be compared too.
Each rank also counts its process CPU time per round (``time.process_time``: every thread, gloo's
included), which the load of other programs does not change: the same math at a higher CPU cost
is runtime overhead.

    python -m bench.pipeline.paired_rank LAYOUT.toml --rank R --rounds 6 --steps 4 --port P [--out F.json]
    python -m bench.pipeline.paired_rank LAYOUT.toml ... --versus dynamic     # the layout's schedule vs dynamic

With ``--versus SCHEDULE`` both sides are hetero_llm's loop, the layout's schedule against SCHEDULE
(the results name the two sides "ours" and "other"). With ``--versus network`` both run the layout
as it is, "other" with every stage boundary over its process group instead of shared memory.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import click


@click.command()
@click.argument("layout_file", type=click.Path(exists=True, dir_okay=False))
@click.option("--rank", type=int, required=True)
@click.option("--port", type=int, required=True)
@click.option("--rounds", default=6, show_default=True, help="Rounds per side, alternating.")
@click.option("--steps", default=4, show_default=True, help="Training steps per round.")
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="Rank 0 writes the step rows here.")
@click.option(
    "--versus",
    default="torch",
    show_default=True,
    help="The other side: 'torch' (torch.distributed.pipelining), 'network' (the layout with its "
    "shared-memory boundaries over their process groups), or a train.schedule value to run "
    "hetero_llm's loop with instead of the layout's (e.g. 'dynamic').",
)
def main(layout_file: str, rank: int, port: int, rounds: int, steps: int, out: str | None, versus: str) -> None:
    import attrs
    import torch
    import torch.distributed as dist

    from bench.pipeline.torch_pp_rank import TorchPipeline
    from hetero_llm import layout as layout_mod
    from hetero_llm.comm import groups, shm
    from hetero_llm.plan import compile_plan
    from hetero_llm.train.options import RunOptions
    from hetero_llm.train.rank import train

    overrides = [f"train.steps={steps}", f"cluster.port={port}"]
    plan = compile_plan(layout_mod.load(layout_file, overrides))
    comms = groups.init(plan.rank_plan(rank), torch.device("cpu"), shm.rank_rings(plan, rank))
    other_comms = comms
    if versus == "torch":
        baseline = TorchPipeline(plan, rank, group=dist.new_group(list(range(plan.world_size))))
    elif versus == "network":  # the same plan and groups; no shared-memory rings: gloo carries every boundary
        other, other_comms = plan, attrs.evolve(comms, shm={})
    else:  # the same communicators serve both: the plan's groups do not depend on the schedule
        other = compile_plan(layout_mod.load(layout_file, [*overrides, f"train.schedule={versus}"]))
    result: dict[str, list] = {"ours": [], "other": [], "ours_events": [], "other_events": [], "cpu": []}
    cpu = {"ours": [], "other": []}  # this process's CPU seconds per round (every thread: gloo's too)
    try:
        for round_ in range(rounds):
            for side in ("ours", "other") if round_ % 2 == 0 else ("other", "ours"):
                start = time.process_time()
                if side == "ours":
                    events: list = []
                    history = train(
                        plan.rank_plan(rank), comms, RunOptions(quiet=True), trace=events, keep_history=True
                    )
                    result["ours"].append([{"step": m.step, "loss": m.loss, "seconds": m.seconds} for m in history])
                    result["ours_events"].append(events)
                elif versus == "torch":
                    baseline.reset()
                    result["other"].append([baseline.step(k) for k in range(steps)])
                else:
                    events = []
                    history = train(
                        other.rank_plan(rank), other_comms, RunOptions(quiet=True), trace=events, keep_history=True
                    )
                    result["other"].append([{"step": m.step, "loss": m.loss, "seconds": m.seconds} for m in history])
                    result["other_events"].append(events)
                cpu[side].append(time.process_time() - start)
                dist.barrier()  # the two sides never overlap
        every = [None] * plan.world_size
        dist.all_gather_object(every, cpu)
        result["cpu"] = every  # [rank] -> {"ours": [s per round], "other": [...]}
        if rank == 0 and out:
            Path(out).write_text(json.dumps(result))
    finally:
        groups.shutdown()


if __name__ == "__main__":
    main()
