"""Hot switching's exchange as it is (``p2p.exchange``: one ``batch_isend_irecv`` in the switch group) against what
it was (plain ``irecv``/``isend`` on the default group): two processes over gloo on this host's loopback.

    flock /work/bench.lock python -m bench.comm.switch_exchange              # 1, 64Ki and 1Mi float32 elements
    python -m bench.comm.switch_exchange --reps 5 --out DIR                  # a smoke run

Each repetition exchanges one flat message each way (fresh buffers, as a switch's), both ways of doing it one after
the other (which first alternates), each timed on rank 0 from a barrier to the end of its waits. Medians per size.
On gloo the batch is the same sends and receives (gloo has no batches): this shows that the switch group and the
batch cost nothing on CPU; what they buy is NCCL's (docs/hot_switching.md).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import click

from bench.common import benchlib

SIZES = (1, 1 << 16, 1 << 20)


def _plain(sends: dict, receives: dict) -> None:
    """The exchange before the switch group (main at 2db19ea): receives, then sends, on the default group."""
    import torch.distributed as dist

    from hetero_llm.comm import p2p

    works = [p2p.started(dist.irecv(buf, peer, tag=p2p.SWITCH_TAG)) for peer, buf in sorted(receives.items())]
    works += [p2p.started(dist.isend(buf, peer, tag=p2p.SWITCH_TAG)) for peer, buf in sorted(sends.items())]
    for w in works:
        p2p.finish(w)


def _rank(rank: int, port: int, reps: int, sizes: tuple[int, ...], out: str) -> None:
    import functools

    import torch
    import torch.distributed as dist

    from hetero_llm.comm import p2p

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    switch_group = dist.new_group([0, 1])  # as groups.switch_group: all ranks, made before any exchange
    ways = {
        "plain, default group": _plain,
        "batched, switch group": functools.partial(p2p.exchange, group=switch_group),
    }
    times: dict[str, dict[int, list[float]]] = {name: {n: [] for n in sizes} for name in ways}
    peer = 1 - rank
    for n in sizes:
        for rep in range(reps):
            for name in list(ways)[:: 1 if rep % 2 == 0 else -1]:
                send, receive = torch.randn(n), torch.empty(n)
                dist.barrier()
                t0 = time.perf_counter()
                ways[name]({peer: send}, {peer: receive})
                times[name][n].append(time.perf_counter() - t0)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps({name: {str(n): t for n, t in by.items()} for name, by in times.items()}))


@click.command()
@click.option("--reps", type=int, default=200, show_default=True, help="Exchanges of each size, each way.")
@click.option("--out", type=click.Path(file_okay=False), default=str(benchlib.RESULTS), show_default=True)
def main(reps: int, out: str) -> None:
    """Time the switch exchange both ways (see the module doc)."""
    import torch.multiprocessing as mp

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp, "times.json"))
        mp.spawn(_rank, args=(benchlib.free_port(), reps, SIZES, path), nprocs=2, join=True)
        times = json.loads(Path(path).read_text())
    load_after = os.getloadavg()
    rows = [
        [name, int(n), int(n) * 4 / 2**20, statistics.median(t) * 1e6, statistics.quantiles(t, n=10)[-1] * 1e6]
        for name, by in times.items()
        for n, t in by.items()
    ]
    markdown = "\n".join(
        [
            "# The switch exchange: batched in the switch group vs plain sends on the default group (gloo, loopback)",
            "",
            f"`{benchlib.command_line()}`",
            "",
            f"{benchlib.machine_line(benchlib.machine())}; {benchlib.load_line(load_before, load_after)}; "
            f"{reps} exchanges of each size each way, one message each way, timed on rank 0.",
            "",
            benchlib.markdown_table(["exchange", "elements", "MiB each way", "median us", "90th percentile us"], rows),
            "",
        ]
    )
    payload = {"reps": reps, "times_s": times, "load": [load_before, load_after], "machine": benchlib.machine()}
    md, js = benchlib.write_results(Path(out), "switch_exchange", markdown, payload)
    print(markdown)
    benchlib.say(f"wrote {md} and {js}")


if __name__ == "__main__":
    main()
