"""What the hot-switching bench (``python -m bench.hot_switch.hot_switch``) measures of this host before and after each switching run:
gloo exchanges as a switch sees them (two processes on loopback, or on two testbed nodes) and a switch's host
work (copies, packing, gradient buffers) replayed with the switcher's own code on the run's real blocks. The switch
model's links and costs come from these.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import attrs

from bench.common import benchlib as B


def _exchange_rank(
    rank: int,
    port: int,
    sizes: list[int],
    reps: int,
    idle_s: float,
    out: str,
    addr: str = "127.0.0.1",
    busy_s: float = 0.0,
) -> None:
    import torch
    import torch.distributed as dist

    from hetero_llm.comm import p2p

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=2)
    sources = {n: torch.randn(n) for n in sizes}
    spans: dict[int, list] = {n: [] for n in sizes}
    for i in range(reps + 2):
        for n in sizes:  # the sizes alternate, so each pair of exchanges sees the same conditions
            # fresh flat messages, as a switch's (switcher.relayout): the one sent packed (its pages touched, as the
            # host-work replay times it), the one received new, so the exchange writes into unmapped pages
            send = torch.empty(n).copy_(sources[n])
            receive = torch.empty(n)
            dist.barrier()
            time.sleep(idle_s)
            if rank == 1:  # the later rank comes from busy_s of a switch's host work (copies, packing) on the CPU
                start = time.perf_counter()
                while time.perf_counter() - start < busy_s:
                    pass
            t0 = time.perf_counter()
            p2p.exchange({1 - rank: send}, {1 - rank: receive})
            if i >= 2:
                spans[n].append((t0, time.perf_counter()))
    Path(f"{out}.{rank}").write_text(json.dumps(spans))
    dist.destroy_process_group()


def exchange_probe(
    reps: int = 30, big: int = 1 << 17, idle_s: float = 0.01, busy_s: float = 0.0
) -> tuple[float, float]:
    """(latency s per message, bandwidth bytes/s) as a hot switch sees gloo here: two forked processes, each
    idle for ``idle_s`` (as a rank is between compute and a switch: asleep under emulated devices), then one
    ``p2p.exchange`` both ways of a 1-element or a ``big``-element float32 tensor (alternating; fresh buffers each
    time, as a switch allocates its flat messages: receiving into new pages costs 0.3-0.5 ms more per 0.5 MB
    exchange on the bench's 2-core host than into a reused buffer; the second process first busy on the CPU for
    ``busy_s``, as the later rank of a switch comes to its exchange from the switch's copies and packing: on a
    loaded host a process that has just used the CPU waits longer for it, and its exchange with it), each timed from
    the moment the later process enters to the moment the later one leaves (the processes share one monotonic
    clock). The switch model charges each device a latency per message it sends and one per message it
    receives, so the latency is half the small exchanges' median; the bandwidth is the extra bytes of a big
    exchange over the median of its extra time against the small one just before it."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp, "exchange"))
        mp.start_processes(
            _exchange_rank,
            args=(B.free_port(), [1, big], reps, idle_s, out, "127.0.0.1", busy_s),
            nprocs=2,
            start_method="fork",
        )
        return exchange_result(out, big)


def exchange_result(out: str, big: int) -> tuple[float, float]:
    """``exchange_probe``'s (latency, bandwidth) from the two ``_exchange_rank`` files ``{out}.0`` and ``{out}.1``
    (the ranks may have run anywhere on this host: ``exchange_probe_testbed`` runs them on testbed nodes)."""
    ranks = [{int(k): v for k, v in json.loads(Path(f"{out}.{r}").read_text()).items()} for r in (0, 1)]
    own = {n: [max(a[1], b[1]) - max(a[0], b[0]) for a, b in zip(ranks[0][n], ranks[1][n])] for n in (1, big)}
    extra = statistics.median(b - s for s, b in zip(own[1], own[big]))
    return statistics.median(own[1]) / 2, 4 * (big - 1) / max(extra, 1e-6)


@attrs.frozen
class HostCosts:
    """A switch's host work on this host (``host_costs``), in ``switch_seconds``' terms, and what was timed."""

    copy_bandwidth: float  # bytes/s: each device's blocks of a switch copied as one flat tensor
    block_overhead: float  # s per transfer a device takes part in (local copy, pack or unpack), fitted
    buffer_overhead: float  # s per gradient buffer a device allocates and zeroes, fitted
    step_s: float  # a step's switches' host work (each switch: its slowest device), median of the rounds as a run
    step_spread: tuple[float, float]  # those rounds' lowest and highest step_s
    hot_step_s: float  # the same switches repeated right away (nothing before them), median
    fitted_step_s: float  # what the three costs above give for the same switches (the fit's check)
    switch_s: float  # one switch's host work on its slowest device: median of the run-like rounds' exchanging switches

    def costs(self) -> tuple[float, float, float]:
        """(copy_bandwidth, block_overhead, buffer_overhead): ``switch_seconds``' host-work arguments."""
        return self.copy_bandwidth, self.block_overhead, self.buffer_overhead


def host_costs(layout: Path, steps: range, reps: int = 9, idle_s: float = 0.1, meter: bool = True) -> HostCosts:
    """A switch's host work, timed as the run's ranks do it: ``switcher.relayout`` (the switcher's own code: zero
    the target's gradient buffers, copy the local blocks, pack each peer's blocks into one flat message, unpack the
    received ones) with an exchange that sends nothing, on each device's real shards of the layout's bucket plans,
    for the switches the steps ``steps`` make (``predict.step_switch_plans``: the real blocks, sizes and counts),
    each device in a process of its own, one device at a time while the others wait idle (a run's ranks reach a
    switch apart: in six traced runs of the bench's layout (a) a median 4-34 ms apart into its first bucket, 24-68 ms
    into the second, 0.2-7 ms back home, against 1-9 ms of copies and packing before the exchange, so the last
    rank's runs alone while the first waits in the exchange), ``reps`` rounds of one step each (the steps in turn).
    Each switch comes after what comes before it in a run (``_before_switch``): a step's first switch after the
    switcher's own sorting of the step's documents into buckets (CPU work: the optimizer step and the data come
    just before it), every other after ``idle_s`` asleep (a bucket's last compute action ends asleep under emulated
    devices) and, with ``meter`` (the bench runs every rank with ``HETERO_TENSOR_METER``), the tensor meter's
    checkpoint that ``Switcher.step`` makes after each bucket, over this device's parameters, AdamW's moments and
    bucket copies: 0.6-0.9 ms of the rank's CPU just before the switch in the bench's traced runs (0.1 ms without the
    meter), and replayed switches after it take ~8% less than after the sleep alone (layout (b), 15 rounds).
    Then, per (switch, device): its bytes in one flat copy (the bandwidth); the median of each one's
    host seconds less its bytes at that bandwidth, fitted by least squares as ``block_overhead`` per transfer
    plus ``buffer_overhead`` per gradient buffer (both kept >= 0), both then scaled so that the model's step (each
    switch its slowest device, as ``switch_seconds`` prices it) is the median of those rounds' steps."""
    import torch

    from hetero_llm import layout as layout_mod
    from hetero_llm.data import documents, sources
    from hetero_llm.plan import compile_plan
    from hetero_llm.switching import bucketing, switcher
    from hetero_llm.switching.predict import step_switch_plans

    lay = layout_mod.load(layout)
    home = compile_plan(lay)
    plans = home.buckets
    named = {"home": home, **{f"b{i}": p for i, p in enumerate(plans) if lay.buckets[i].pipelines}}
    devices = [r.device_id for r in home.ranks]
    world_rank = {r.device_id: r.rank for r in home.ranks}
    source = sources.document_sources(lay.data, lay.model.seq_len, lay.file)[0]

    def step_rows(step: int) -> list:  # what Switcher.step does before a step's first switch
        docs = documents.fill_documents(source, lay.train.seed, step, lay.train.global_batch, lay.model.seq_len)
        return bucketing.bucket_rows(lay, docs)

    step_plans = [step_switch_plans(lay, home, plans, step_rows(step)) for step in steps]

    def slot(name: str, device: str) -> switcher.Slot:  # this device's shards in the plan, as the rank holds them
        plan = named[name]
        rank = next((r.rank for r in plan.ranks if r.device_id == device), None)
        params, coords = {}, {}
        for info, lo, hi in plan.params_of(rank) if rank is not None else []:
            shape = list(info.shape)
            dim = info.shard_dim or 0
            shape[dim] = hi - lo
            params[info.name], coords[info.name] = torch.zeros(shape), (dim, lo)
        return switcher.Slot(name, plan, rank, params, coords, None)

    slots = {(n, d): slot(n, d) for n in named for d in devices}
    before = _Before(list(steps), step_rows, idle_s, meter)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a rank runs (OMP_NUM_THREADS=1): a multi-threaded copy stalls on a busy host
    try:
        return _timed_host_costs(step_plans, slots, devices, world_rank, reps, before)
    finally:
        torch.set_num_threads(threads)


@attrs.frozen
class _Before:
    """What comes before a switch in a run, for ``host_costs``' replay (see there)."""

    steps: list[int]
    step_rows: object  # step -> its buckets' rows (Switcher.step's work before the step's first switch)
    idle_s: float
    meter: bool

    def start(self, slots, device) -> None:
        """In a replaying process: the tensor meter a run's rank has (``HETERO_TENSOR_METER``), over ``device``'s
        tensors: the home parameters, AdamW's two moments of each, the bucket layouts' copies."""
        if not self.meter:
            return
        import os

        import torch

        from hetero_llm.runtime import tensor_meter

        os.environ[tensor_meter.ENV] = "unused"  # never written: only train's loop writes the report
        meter = tensor_meter.from_env()
        home = list(slots["home", device].params.values())
        moments = [torch.zeros_like(p) for p in home for _ in range(2)]
        copies = [p for (name, d), s in slots.items() if d == device and name != "home" for p in s.params.values()]
        meter.register("parameters", lambda: home)
        meter.register("optimizer", lambda: moments)
        meter.register("bucket copies", lambda: copies)

    def __call__(self, r: int, j: int) -> None:
        """Before switch ``j`` of round ``r``'s step."""
        from hetero_llm.runtime import tensor_meter

        if j == 0:
            self.step_rows(self.steps[r % len(self.steps)])
            return
        time.sleep(self.idle_s)
        tensor_meter.checkpoint()  # nothing without a meter


def _replay_device(
    device, turn: int, devices: int, step_plans, slots, world_rank, reps: int, before: _Before, barrier, queue
) -> None:
    """One device's part of ``host_costs``' rounds, in a process of its own: every switch in its ``turn`` among the
    ``devices`` (the others wait at the barrier meanwhile), after what comes before it in a run (``before``: the
    "run" rounds, as in a run) or right away (the "hot" rounds)."""
    import torch

    from hetero_llm.switching import switcher

    torch.set_num_threads(1)  # as a rank runs (OMP_NUM_THREADS=1): a multi-threaded copy stalls on a busy host
    before.start(slots, device)
    out: dict[tuple[str, int, int], float] = {}
    for r in range(reps):
        for kind in ("run", "hot"):
            for j, (a, b, sw) in enumerate(step_plans[r % len(step_plans)]):
                for t in range(devices):
                    barrier.wait()
                    if t != turn:
                        continue
                    src, dst = slots[a, device], slots[b, device]
                    grads = bool(sw.grads) or bool(sw.grad_buffers)
                    if grads:
                        for p in src.params.values():
                            p.grad = torch.zeros_like(p)  # what the bucket's backward left
                    if kind == "run":
                        before(r, j)
                    t0 = time.perf_counter()
                    switcher.relayout(
                        sw,
                        device,
                        world_rank,
                        slots["home", device],
                        src,
                        dst,
                        grads,
                        torch.device("cpu"),
                        lambda s, r: None,
                    )
                    out[kind, r, j] = time.perf_counter() - t0
                    if grads:
                        switcher.release_gradients(src)  # outside the switch's time, as in a run
    queue.put((device, out))


def _timed_host_costs(step_plans, slots, devices, world_rank, reps: int, before: _Before) -> HostCosts:
    import multiprocessing

    import numpy as np
    import torch

    from hetero_llm.switching.predict import switch_seconds

    ctx = multiprocessing.get_context("fork")
    barrier, queue = ctx.Barrier(len(devices)), ctx.Queue()
    procs = [
        ctx.Process(
            target=_replay_device,
            args=(d, turn, len(devices), step_plans, slots, world_rank, reps, before, barrier, queue),
        )
        for turn, d in enumerate(devices)
    ]
    for proc in procs:
        proc.start()
    try:
        by_device = dict(queue.get(timeout=600) for _ in procs)
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    timed: dict[tuple[int, int, str], list[float]] = {}
    run_steps, hot_steps, switches, exchanging = [], [], [], []
    for r in range(reps):
        k = r % len(step_plans)
        for kind, steps in (("run", run_steps), ("hot", hot_steps)):
            steps.append(sum(max(by_device[d][kind, r, j] for d in devices) for j in range(len(step_plans[k]))))
        for j, (_, _, sw) in enumerate(step_plans[k]):
            (exchanging if sw.messages() else switches).append(max(by_device[d]["run", r, j] for d in devices))
        for j in range(len(step_plans[k])):
            for d in devices:
                timed.setdefault((k, j, d), []).append(by_device[d]["run", r, j])
    rows, flat_bw = [], []
    for (k, j, device), seconds in timed.items():
        sw = step_plans[k][j][2]
        mine = [t for t in sw.transfers if device in (t.src, t.dst)]
        nbytes = sum(t.nbytes for t in mine)
        if nbytes:
            src, dst = torch.randn(nbytes // 4), torch.zeros(nbytes // 4)  # both touched: no first-use page faults
            copies = []
            for _ in range(9):
                t0 = time.perf_counter()
                dst.copy_(src)
                copies.append(time.perf_counter() - t0)
            flat_bw.append(nbytes / max(B.median(copies), 1e-9))
        rows.append((len(mine), sw.grad_buffers.get(device, 0), nbytes, B.median(seconds)))
    copy_bw = B.median(flat_bw) if flat_bw else float("inf")
    a = np.array([[n, g] for n, g, _, _ in rows], dtype=float)
    y = np.array([s - nb / copy_bw for _, _, nb, s in rows])
    block, buffer = np.linalg.lstsq(a, y, rcond=None)[0]
    if block < 0 or buffer < 0:  # keep both >= 0: refit the other alone
        keep = 0 if block >= buffer else 1
        one = max(0.0, float(a[:, keep] @ y / max(a[:, keep] @ a[:, keep], 1e-12)))
        block, buffer = (one, 0.0) if keep == 0 else (0.0, one)
    no_link = {k: (0.0, float("inf")) for k in ("local", "node", "domain", "cross_domain")}

    def step_model(costs) -> float:
        return B.median([sum(switch_seconds(sw, no_link, *costs) for _, _, sw in p) for p in step_plans])

    copies = step_model((copy_bw, 0.0, 0.0))
    overheads = step_model((float("inf"), float(block), float(buffer)))
    # the fit takes each (switch, device) alone; a step pays its switches' slowest devices in a row, where a stall of
    # the busy host in any one counts: the overheads are scaled so that the model's step is the run-like rounds' median
    scale = max(0.0, B.median(run_steps) - copies) / overheads if overheads > 0 else 0.0
    costs = (copy_bw, float(block) * scale, float(buffer) * scale)
    fitted = step_model(costs)
    return HostCosts(
        *costs,
        step_s=B.median(run_steps),
        step_spread=(min(run_steps), max(run_steps)),
        hot_step_s=B.median(hot_steps),
        fitted_step_s=fitted,
        switch_s=B.median(exchanging or switches),
    )


def exchange_probe_testbed(tb, reps: int, big: int, idle_s: float = 0.01, busy_s: float = 0.0) -> tuple[float, float]:
    """``exchange_probe`` between the testbed's two nodes, over their domain's fabric (where the world
    group, which switches use, runs: ``gloo_ifname = "dom0"``)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp, "exchange"))
        code = (
            f"import sys; from bench.hot_switch import hot_switch_probes; "
            f"hot_switch_probes._exchange_rank(int(sys.argv[1]), {B.free_port()}, [1, {big}], {reps}, {idle_s}, {out!r}, "
            f"{tb.address('node0', 'domain')!r}, {busy_s!r})"
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
