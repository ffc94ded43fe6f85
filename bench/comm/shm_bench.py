"""Shared-memory stage boundaries (hetero_llm/comm/shm.py) against gloo over TCP loopback, on this host.

Three measurements, each A/B pair interleaved in one run (``benchlib``'s rules):

1. **p2p**: two processes ping-pong a message of 4 B, 64 KiB, 1 MiB and 16 MiB, through a shm ring
   and through gloo ``isend``/``irecv`` (what the runtime uses), in alternating rounds; one-way time =
   median round trip / 2; bandwidth = size / one-way time. Target: >= 3x lower one-way time at 1 MiB.
2. **waiting**: what waiting costs the waiting rank: its process CPU time while it waits ~100 ms for a
   message, and the one-way time at 4 B and 1 MiB, for gloo and for shm readers that spin 0 (the
   library's ``SPIN_S``), 50 us or 500 us before they sleep in futex(2).
3. **training**: tokens/s of 2-stage layouts (one CPU rank per stage, so 2 computing ranks) with their
   boundary in shared memory vs over gloo, in paired rounds inside the same rank processes
   (``paired_rank.py --versus network``), 1F1B and the dynamic schedule (whose receives are polled).

    python -m bench.comm.shm_bench
    python -m bench.comm.shm_bench --quick
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import click

from bench.common import benchlib as B
from bench.pipeline.paired import paired_rates, run_paired

NAME = "shm_bench"
SIZES = (4, 64 << 10, 1 << 20, 16 << 20)
SPINS_US = (0, 50, 500)


def size_label(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB" if n >= 1 << 10 else f"{n} B"


# ------------------------------------------------------------------------------------------
# The two p2p processes (this script with --rank)


def _reps(n: int, quick: bool) -> int:
    reps = 400 if n <= 64 << 10 else 100 if n <= 1 << 20 else 12
    return max(3, reps // 20) if quick else reps


# C901: one worker of a two-rank benchmark: its timed closures share the rank's rings, store and peer, and its
# rounds run in the order the results are written
def p2p_rank(rank: int, port: int, rounds: int, quick: bool, out: str) -> None:  # noqa: C901
    import torch
    import torch.distributed as dist

    from hetero_llm.comm import shm, shm_ring
    from hetero_llm.schedule import Direction

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=2)
    biggest = max(SIZES)
    specs = [
        shm.RingSpec(0, 1, Direction.FWD, 2, biggest, "bench ping"),
        shm.RingSpec(1, 0, Direction.BWD, 2, biggest, "bench pong"),
    ]
    rings = shm.open_rings(specs, rank, store, 120.0, True, f"rank {rank}")
    ping, pong = (0, 1, Direction.FWD), (1, 0, Direction.BWD)
    peer = 1 - rank

    def once(transport: str, x, y, tag: int) -> None:
        """Rank 0: send x, receive into y; rank 1: receive into y, send y back."""
        if transport == "shm":
            if rank == 0:
                rings[ping].send(x, tag)
                rings[pong].post(y, tag).wait()
            else:
                rings[ping].post(y, tag).wait()
                rings[pong].send(y, tag)
        elif rank == 0:
            dist.isend(x, peer, tag=tag).wait()
            dist.irecv(y, peer, tag=tag).wait()
        else:
            dist.irecv(y, peer, tag=tag).wait()
            dist.isend(y, peer, tag=tag).wait()

    def one_way(transport: str, n: int, reps: int) -> float:
        x, y = torch.ones(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
        for i in range(2):  # warm-up: first-touch page faults, gloo's lazy pair connection
            once(transport, x, y, i)
        dist.barrier()
        times = []
        for i in range(reps):
            t0 = time.perf_counter()
            once(transport, x, y, i)
            times.append(time.perf_counter() - t0)
        return statistics.median(times) / 2

    result: dict = {"p2p": {}, "waiting": {}}
    for n in SIZES:
        per = {"gloo": [], "shm": []}
        for r in range(rounds):
            for transport in ("gloo", "shm") if r % 2 == 0 else ("shm", "gloo"):
                per[transport].append(one_way(transport, n, _reps(n, quick)))
        result["p2p"][n] = per

    # Waiting: rank 1 sends after ~100 ms; rank 0 measures its CPU time while it waits. Then one-way times.
    variants = [("gloo", None)] + [(f"shm, spin {us} us", us) for us in SPINS_US]
    default_spin = shm_ring.SPIN_S
    for r in range(rounds):
        for name, spin_us in variants if r % 2 == 0 else variants[::-1]:
            transport = "gloo" if spin_us is None else "shm"
            if spin_us is not None:
                shm_ring.SPIN_S = spin_us * 1e-6
            row = result["waiting"].setdefault(name, {"cpu_ms_per_100ms": [], "one_way_4B": [], "one_way_1MiB": []})
            x, y = torch.ones(4, dtype=torch.uint8), torch.empty(4, dtype=torch.uint8)
            dist.barrier()
            if rank == 0:
                cpu, wall = time.process_time(), time.perf_counter()
                once(transport, x, y, 99)
                cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
                row["cpu_ms_per_100ms"].append(cpu * 1e3 / (wall * 10))
            else:
                time.sleep(0.1)
                once(transport, x, y, 99)
            row["one_way_4B"].append(one_way(transport, 4, _reps(4, quick)))
            row["one_way_1MiB"].append(one_way(transport, 1 << 20, _reps(1 << 20, quick)))
    shm_ring.SPIN_S = default_spin
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------
# Summaries


def summarize_p2p(got: dict) -> list[dict]:
    rows = []
    for n in SIZES:
        per = got["p2p"][str(n)]
        gloo, shm = B.median(per["gloo"]), B.median(per["shm"])
        ratios = [g / s for g, s in zip(per["gloo"], per["shm"])]
        rows.append(
            {
                "bytes": n,
                "size": size_label(n),
                "gloo_us": gloo * 1e6,
                "shm_us": shm * 1e6,
                "ratio": B.median(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
                "gloo_MBps": n / gloo / 1e6,
                "shm_MBps": n / shm / 1e6,
                "rounds": len(ratios),
            }
        )
    return rows


def summarize_waiting(got: dict) -> list[dict]:
    return [
        {
            "waiter": name,
            "cpu_ms_per_100ms": B.median(v["cpu_ms_per_100ms"]),
            "one_way_4B_us": B.median(v["one_way_4B"]) * 1e6,
            "one_way_1MiB_us": B.median(v["one_way_1MiB"]) * 1e6,
        }
        for name, v in got["waiting"].items()
    ]


def summarize_training(name: str, schedule: str, got: dict, tokens: int, steps: int) -> dict:
    shm, gloo, cpu = paired_rates(got, tokens, steps)
    ratios = [s / g for s, g in zip(shm, gloo)]
    rounds = len(ratios)
    same = all(abs(a["loss"] - b["loss"]) == 0 for ra, rb in zip(got["ours"], got["other"]) for a, b in zip(ra, rb))
    return {
        "model": name,
        "schedule": schedule,
        "shm_tokens_s": B.median(shm),
        "gloo_tokens_s": B.median(gloo),
        "ratio": B.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "rounds": rounds,
        "shm_cpu_step_s": cpu["ours"],
        "gloo_cpu_step_s": cpu["other"],
        "same_losses": same,
    }


def plot(p2p: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.2, 3.6), dpi=120)
    x = range(len(p2p))
    for j, (side, color) in enumerate((("gloo", "tab:gray"), ("shm", "tab:blue"))):
        ax.bar([i + (j - 0.5) * 0.4 for i in x], [r[f"{side}_us"] for r in p2p], 0.4, label=side, color=color)
    for i, r in enumerate(p2p):
        ax.text(i, r["gloo_us"] * 1.15, f"{r['ratio']:.1f}x", ha="center", fontsize=8)
    ax.set_yscale("log")
    ax.set_xticks(list(x), [r["size"] for r in p2p])
    ax.set_ylabel("one-way time, us (median, log)")
    ax.set_title("stage-boundary message between two ranks of one node", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ------------------------------------------------------------------------------------------


TRAIN_MODELS = {  # (ModelConfig, microbatches): a 2-stage pipeline, one CPU rank per stage
    "compute-heavy (8 layers, hidden 128, 256 KiB messages)": (B.ModelConfig(), 4),
    "comm-heavy (2 layers, hidden 256, 1 MiB messages)": (B.ModelConfig(layers=2, hidden=256, seq_len=256), 4),
}


@click.command()
@click.option("--rank", type=int, default=None, hidden=True)
@click.option("--port", type=int, default=0, hidden=True)
@click.option("--out", default="", hidden=True)
@click.option("--rounds", default=6, show_default=True, help="Paired rounds of every A/B comparison.")
@click.option(
    "--round-steps", default=5, show_default=True, help="Training steps per paired round (the first is warm-up)."
)
@click.option("--quick", is_flag=True, help="Smoke run: 2 rounds, few repetitions, a tiny training model.")
@click.option("--out-dir", type=click.Path(file_okay=False, path_type=Path), default=B.RESULTS, show_default=True)
def main(rank, port, out, rounds, round_steps, quick, out_dir):
    """One-way time and bandwidth of shm vs gloo, what waiting costs, and tokens/s of 2-stage training."""
    if quick:
        rounds, round_steps = 2, 3
    if rank is not None:
        p2p_rank(rank, port, rounds, quick, out)
        return
    models = (
        TRAIN_MODELS
        if not quick
        else {
            "tiny (2 layers, hidden 32)": (B.ModelConfig(layers=2, hidden=32, vocab=64, seq_len=16, global_batch=4), 2)
        }
    )
    info, before = B.machine(), B.load_average()
    B.say(f"{NAME}: {B.machine_line(info)}; load {before[0]:.2f}")
    with tempfile.TemporaryDirectory(prefix="bench_shm_") as tmp:
        got_p2p = Path(tmp, "p2p.json")
        B.start_ranks(
            "bench.comm.shm_bench",
            ["--port", str(B.free_port()), "--rounds", str(rounds), "--out", str(got_p2p)]
            + (["--quick"] if quick else []),
            2,
            env={"OMP_NUM_THREADS": "1"},
        )
        got = json.loads(got_p2p.read_text())
        p2p, waiting = summarize_p2p(got), summarize_waiting(got)
        for r in p2p:
            B.say(
                f"p2p {r['size']:>7}: gloo {r['gloo_us']:9.1f} us, shm {r['shm_us']:9.1f} us, {r['ratio']:.2f}x "
                f"({r['ratio_min']:.2f}-{r['ratio_max']:.2f})"
            )
        for r in waiting:
            B.say(
                f"waiting {r['waiter']:18}: {r['cpu_ms_per_100ms']:.2f} ms CPU per 100 ms; one-way 4 B "
                f"{r['one_way_4B_us']:.1f} us, 1 MiB {r['one_way_1MiB_us']:.1f} us"
            )
        training = []
        for name, (cfg, microbatches) in models.items():
            for schedule in ("1f1b", "dynamic"):
                layout = Path(tmp, "layout.toml")
                half = cfg.layers // 2
                layout.write_text(B.layout_toml(cfg, [half, cfg.layers - half], microbatches, schedule))
                paired = run_paired(
                    layout, Path(tmp, f"paired_{len(training)}"), 2, rounds, round_steps, versus="network"
                )
                training.append(summarize_training(name, schedule, paired, cfg.tokens_per_step, round_steps))
                t = training[-1]
                B.say(
                    f"train {name} {schedule}: shm {t['shm_tokens_s']:.0f}, gloo {t['gloo_tokens_s']:.0f} tokens/s, "
                    f"{t['ratio']:.3f}x ({t['ratio_min']:.2f}-{t['ratio_max']:.2f}); CPU s/step "
                    f"{t['shm_cpu_step_s']:.3f} vs {t['gloo_cpu_step_s']:.3f} (load {B.load_average()[0]:.2f})"
                )
    after = B.load_average()
    one_mib = next(r for r in p2p if r["bytes"] == 1 << 20)
    verdict = "met" if one_mib["ratio"] >= 3 else "MISSED"
    md = "\n".join(
        [
            *B.report_head(NAME, info, before, after),
            f"## One-way time, paired rounds ({rounds} per size; target >= 3x lower at 1 MiB: {verdict}, "
            f"{one_mib['ratio']:.2f}x)",
            "",
            B.markdown_table(
                ["size", "gloo us", "shm us", "gloo/shm", "range", "gloo MB/s", "shm MB/s"],
                [
                    [
                        r["size"],
                        r["gloo_us"],
                        r["shm_us"],
                        f"{r['ratio']:.2f}x",
                        f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}",
                        r["gloo_MBps"],
                        r["shm_MBps"],
                    ]
                    for r in p2p
                ],
            ),
            "",
            "## What waiting costs the waiting rank (a message ~100 ms late)",
            "",
            B.markdown_table(
                ["waiter", "CPU ms per 100 ms waited", "one-way 4 B, us", "one-way 1 MiB, us"],
                [[r["waiter"], r["cpu_ms_per_100ms"], r["one_way_4B_us"], r["one_way_1MiB_us"]] for r in waiting],
            ),
            "",
            f"## Training, 2 stages (2 computing ranks), paired rounds ({rounds} x {round_steps} steps)",
            "",
            B.markdown_table(
                [
                    "model",
                    "schedule",
                    "shm tokens/s",
                    "gloo tokens/s",
                    "shm/gloo",
                    "range",
                    "CPU s/step shm",
                    "CPU s/step gloo",
                    "same losses",
                ],
                [
                    [
                        t["model"],
                        t["schedule"],
                        t["shm_tokens_s"],
                        t["gloo_tokens_s"],
                        f"{t['ratio']:.3f}",
                        f"{t['ratio_min']:.2f}-{t['ratio_max']:.2f}",
                        t["shm_cpu_step_s"],
                        t["gloo_cpu_step_s"],
                        str(t["same_losses"]),
                    ]
                    for t in training
                ],
            ),
        ]
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    plot(p2p, out_dir / f"{NAME}.png")
    md_path, _ = B.write_results(
        out_dir,
        NAME,
        md,
        {
            "machine": info,
            "load_before": before,
            "load_after": after,
            "results": p2p,
            "waiting": waiting,
            "training": training,
        },
    )
    B.say(f"wrote {md_path}")


if __name__ == "__main__":
    main()
