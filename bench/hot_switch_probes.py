"""What the hot-switching bench (``python -m bench.hot_switch``) measures of this host before its runs: gloo
exchanges as a switch sees them (two processes on loopback, or on two testbed nodes) and the cost of the
switch's local copies and of its host work per block. The switch model's links and costs come from these.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench import benchlib as B
from bench.hot_switch_config import Config, layout_text


def _exchange_rank(
    rank: int, port: int, sizes: list[int], reps: int, idle_s: float, out: str, addr: str = "127.0.0.1"
) -> None:
    import torch
    import torch.distributed as dist

    from hetero_llm.comm import p2p

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=2)
    buffers = {n: (torch.zeros(n), torch.empty(n)) for n in sizes}
    spans: dict[int, list] = {n: [] for n in sizes}
    for i in range(reps + 2):
        for n in sizes:  # the sizes alternate, so each pair of exchanges sees the same conditions
            dist.barrier()
            time.sleep(idle_s)
            t0 = time.perf_counter()
            p2p.exchange({1 - rank: buffers[n][0]}, {1 - rank: buffers[n][1]})
            if i >= 2:
                spans[n].append((t0, time.perf_counter()))
    Path(f"{out}.{rank}").write_text(json.dumps(spans))
    dist.destroy_process_group()


def exchange_probe(reps: int = 30, big: int = 1 << 17, idle_s: float = 0.01) -> tuple[float, float]:
    """(latency s per message, bandwidth bytes/s) as a hot switch sees gloo here: two forked processes, each
    idle for ``idle_s`` (as a rank is between compute and a switch: asleep under emulated devices), then one
    ``p2p.exchange`` both ways of a 1-element or a ``big``-element float32 tensor (alternating), each timed from
    the moment the later process enters to the moment the later one leaves (the processes share one monotonic
    clock). The switch model charges each device a latency per message it sends and one per message it
    receives, so the latency is half the small exchanges' median; the bandwidth is the extra bytes of a big
    exchange over the median of its extra time against the small one just before it."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp, "exchange"))
        mp.start_processes(
            _exchange_rank, args=(B.free_port(), [1, big], reps, idle_s, out), nprocs=2, start_method="fork"
        )
        return exchange_result(out, big)


def exchange_result(out: str, big: int) -> tuple[float, float]:
    """``exchange_probe``'s (latency, bandwidth) from the two ``_exchange_rank`` files ``{out}.0`` and ``{out}.1``
    (the ranks may have run anywhere on this host: ``exchange_probe_testbed`` runs them on testbed nodes)."""
    ranks = [{int(k): v for k, v in json.loads(Path(f"{out}.{r}").read_text()).items()} for r in (0, 1)]
    own = {n: [max(a[1], b[1]) - max(a[0], b[0]) for a, b in zip(ranks[0][n], ranks[1][n])] for n in (1, big)}
    extra = statistics.median(b - s for s, b in zip(own[1], own[big]))
    return statistics.median(own[1]) / 2, 4 * (big - 1) / max(extra, 1e-6)


def copy_costs(cfg: Config, idle_s: float = 0.1, reps: int = 15) -> tuple[float, float]:
    """(bytes/s of copying a few MB, seconds of host work per block) on this host. The second is the switch's
    own per-transfer code (``hotswitch._block`` and ``_apply``: narrow the source, copy or add into the target)
    run in this process over device node0:0's transfers of the bench's real switches (home -> b0 -> b1) on
    full-size parameters, each round after ``idle_s`` asleep: a rank reaches a switch after its compute,
    asleep under emulated devices, and cold it takes 1.5-2.5x what the same loop takes hot (measured)."""
    import torch

    from hetero_llm import layout as layout_mod
    from hetero_llm.plan import compile_plan
    from hetero_llm.switching import switcher as hotswitch
    from hetero_llm.switching.transfers import bucket_plans, step_switch

    src, dst = torch.randn(1 << 20), torch.empty(1 << 20)
    big = []
    for _ in range(30):
        t0 = time.perf_counter()
        dst.copy_(src)
        big.append(time.perf_counter() - t0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "switching.toml"
        path.write_text(layout_text(cfg, "top-up", (1, 1)))
        lay = layout_mod.load(path)
    home = compile_plan(lay)
    slots = {"home": home, **{f"b{i}": p for i, p in enumerate(bucket_plans(lay))}}

    def slot(name, plan):  # every parameter whole, so any transfer's block is in it
        infos = {i.name: i for r in plan.ranks for i, _, _ in plan.params_of(r.rank)}
        params = {n: torch.zeros(i.shape) for n, i in infos.items()}
        for p in params.values():
            p.grad = torch.zeros_like(p)
        return hotswitch.Slot(name, plan, None, params, {n: (i.shard_dim or 0, 0) for n, i in infos.items()}, None)

    full = {name: slot(name, plan) for name, plan in slots.items()}
    seconds, count = 0.0, 0
    for a, b, grads in (("home", "b0", False), ("b0", "b1", True)):
        sw = step_switch(home, slots[a], slots[b], params=True, grads=grads)
        moves = [(t, full["home"]) for t in sw.params] + [(t, full[a]) for t in sw.grads]
        mine = [(t, origin) for t, origin in moves if cfg.devices[0] in (t.src, t.dst)]
        rounds = []
        for _ in range(reps):
            time.sleep(idle_s)
            t0 = time.perf_counter()
            with torch.no_grad():
                for t, origin in mine:
                    hotswitch._apply(full[b], t, hotswitch._block(origin, t))
            rounds.append(time.perf_counter() - t0)
        seconds += B.median(rounds)
        count += len(mine)
    return 4 * (1 << 20) / B.median(big), seconds / count


def exchange_probe_testbed(tb, reps: int, big: int, idle_s: float = 0.01) -> tuple[float, float]:
    """``exchange_probe`` between the testbed's two nodes, over their domain's fabric (where the world
    group, which switches use, runs: ``gloo_ifname = "dom0"``)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp, "exchange"))
        code = (
            f"import sys; from bench import hot_switch_probes; "
            f"hot_switch_probes._exchange_rank(int(sys.argv[1]), {B.free_port()}, [1, {big}], {reps}, {idle_s}, {out!r}, "
            f"{tb.address('node0', 'domain')!r})"
        )
        procs = [
            tb.run(
                f"node{r}",
                [sys.executable, "-c", code, str(r)],
                env={"GLOO_SOCKET_IFNAME": "dom0", "OMP_NUM_THREADS": "1"},
                cwd=B.ROOT,
            )
            for r in (0, 1)
        ]
        for proc in procs:
            if proc.wait(timeout=600) != 0:
                raise RuntimeError(f"the exchange probe on the testbed failed ({proc.returncode})")
        return exchange_result(out, big)
