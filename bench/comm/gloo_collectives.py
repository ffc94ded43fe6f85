"""What gloo's collectives send between two nodes of the emulated testbed: bytes per node and seconds.

    sudo python -m bench.comm.gloo_collectives            # 0.7 MB over a 50 Mbit/s, 2 ms link (plan_vs_measured's cross link)
    sudo python -m bench.comm.gloo_collectives --quick    # 0.1 MB

The planner prices ZeRO-1's gradient sync as the ring all-reduce it replaces (a reduce-scatter, then an
all-gather). This measures, for one buffer between two processes on two testbed nodes, the bytes each node
sent on the link (``ip -s link``: exact, whatever the load) and the seconds of: a ring ``all_reduce``; one
``reduce`` onto rank 0; one ``broadcast`` from rank 0; ZeRO-1's pair as the runtime ran it on gloo before
(``zero1_reduce_broadcast``: the reduces of both halves started together, waited for, then the broadcasts of
both); gloo's own ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` (``zero1_native``, which copy the
buffer inside: not used, for memory); and what ``comm/collectives.py`` runs on gloo now (``zero1``: an
exchange of send/receive pairs, ``collectives.exchange_reduce_scatter`` and ``exchange_all_gather``).
Medians of the repetitions; each operation runs on a fresh testbed so its bytes are its own.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import testbed as T
from bench.comm.holmes_bench import sent_bytes
from bench.common import benchlib

ROOT = Path(__file__).resolve().parents[2]
OPERATIONS = ("all_reduce", "reduce", "broadcast", "zero1_reduce_broadcast", "zero1_native", "zero1")
LINK = T.FabricSpec("50mbit", "2000us")


def _rank(rank: int, numel: int, operation: str, reps: int, folder: str) -> None:
    """One of the two processes: ``reps`` timed runs of ``operation`` between barriers; rank 0 writes the times."""
    import torch
    import torch.distributed as dist

    from hetero_llm.comm import collectives

    dist.init_process_group("gloo", rank=rank, world_size=2)
    x = torch.ones(numel)
    halves = x.view(2, numel // 2)
    times = []
    dist.barrier()
    Path(folder, f"ready{rank}").write_text("")
    while not Path(folder, "go").exists():
        time.sleep(0.02)
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        if operation == "all_reduce":
            dist.all_reduce(x)
        elif operation == "reduce":
            dist.reduce(x, dst=0)
        elif operation == "broadcast":
            dist.broadcast(x, src=0)
        elif operation == "zero1_reduce_broadcast":  # the runtime before: a reduce, then a broadcast, per member
            for works in (
                [dist.reduce(halves[j], dst=j, async_op=True) for j in range(2)],
                [dist.broadcast(halves[j], src=j, async_op=True) for j in range(2)],
            ):
                for w in works:
                    w.wait()
        elif operation == "zero1_native":  # gloo's own reduce-scatter and all-gather (copies inside)
            out = halves[rank].clone()
            dist.reduce_scatter_tensor(out, x)
            dist.all_gather_into_tensor(x, out)
        else:  # zero1: what comm/collectives.py runs on gloo (an exchange of send/receive pairs each way)
            collectives.exchange_reduce_scatter(x, None, [0, 1], rank)[0].wait()
            collectives.exchange_all_gather(x, None, [0, 1], rank).wait()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(folder, "times.json").write_text(json.dumps(times))
    Path(folder, f"done{rank}").write_text("")
    dist.destroy_process_group()


def measure(operation: str, nbytes: int, reps: int) -> dict:
    """Bytes each node sent on the link and the median seconds of ``operation`` on a buffer of ``nbytes``."""
    spec = T.TestbedSpec(
        (
            T.EmulatedDomain("fast", T.FabricSpec("1gbit", "100us")),
            T.EmulatedDomain("slow", T.FabricSpec("1gbit", "100us")),
        ),
        (T.EmulatedNode("a", "fast"), T.EmulatedNode("b", "slow")),
        LINK,
    )
    with tempfile.TemporaryDirectory() as folder, T.Testbed(spec) as tb:
        env = {
            "MASTER_ADDR": tb.address("a", "xdom"),
            "MASTER_PORT": str(benchlib.free_port()),
            "GLOO_SOCKET_IFNAME": "xdom",
            "OMP_NUM_THREADS": "1",
        }
        code = f"from bench.comm.gloo_collectives import _rank; import sys; _rank(int(sys.argv[1]), {nbytes // 4}, "
        code += f"{operation!r}, {reps}, {folder!r})"
        procs = [
            tb.run(node, [sys.executable, "-c", code, str(r)], env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
            for r, node in enumerate("ab")
        ]
        deadline = time.monotonic() + 300
        while not all(Path(folder, f"ready{r}").exists() for r in range(2)):
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                raise RuntimeError(f"gloo_collectives: {operation}: the ranks did not start")
            time.sleep(0.02)
        before = {n: sent_bytes(tb, n)["xdom"] for n in "ab"}
        Path(folder, "go").write_text("")
        while not all(Path(folder, f"done{r}").exists() for r in range(2)):
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                raise RuntimeError(f"gloo_collectives: {operation}: a rank failed or took over 300 s")
            time.sleep(0.02)
        after = {n: sent_bytes(tb, n)["xdom"] for n in "ab"}
        times = json.loads(Path(folder, "times.json").read_text())
        for p in procs:
            p.wait(timeout=60)
    return {
        "operation": operation,
        "buffer_bytes": nbytes,
        "sent_by_rank0_per_run": (after["a"] - before["a"]) / reps,
        "sent_by_rank1_per_run": (after["b"] - before["b"]) / reps,
        "seconds": statistics.median(times),
        "line_rate_seconds": nbytes / LINK.bits_per_s * 8,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a 0.1 MB buffer, 2 repetitions")
    ap.add_argument("--bytes", type=int, default=700_000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    if args.quick:
        args.bytes, args.reps = 100_000, 2
    ok, why = T.available()
    if not ok:
        sys.exit(f"gloo_collectives: the testbed needs root and network namespaces ({why})")
    load_before = os.getloadavg()
    rows = [measure(op, args.bytes, args.reps) for op in OPERATIONS]
    load_after = os.getloadavg()
    lines = [
        *benchlib.report_head("gloo_collectives", benchlib.machine(), load_before, load_after),
        "| operation | buffer MB | MB sent by rank 0 | MB sent by rank 1 | seconds (median) | buffer at the line rate s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['operation']} | {r['buffer_bytes'] / 1e6:.3f} | {r['sent_by_rank0_per_run'] / 1e6:.3f} | "
            f"{r['sent_by_rank1_per_run'] / 1e6:.3f} | {r['seconds']:.4f} | {r['line_rate_seconds']:.4f} |"
        )
    lines += ["", f"link {LINK.bandwidth}, {LINK.delay}"]
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gloo_collectives.md").write_text(text)
    payload = {"rows": rows, "command": benchlib.command_line(), "git": benchlib.git_state()}
    (out / "gloo_collectives.json").write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
