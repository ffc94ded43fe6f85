"""Activation memory per context-parallel rank vs cp, and the longest row that trains under a memory cap (issue 35).

A tiny model (2 layers, hidden 32, 2 heads, vocab 64, RoPE) on CPU trains one row (forward and backward) with
its positions split over a CP ring of ``cp`` gloo processes (``model/context.py``); cp = 1 is the same ring
code on one rank. Each rank counts what autograd saves with the tensor meter (``runtime/tensor_meter.py``):
the activations held at the end of the forward, the most a rank holds. Not counted (the meter's definition):
the transient score matrices of one attention block, freed before the next (T/(2cp) squared per head).

1. **Per rank vs cp**: activation bytes at 1K-16K positions (--quick: 512-4K), fitted as a + b * seq_len per
   cp; the sequence-proportional part b should be 1/cp of cp = 1's (target: within 10%).
2. **Longest row under a cap**: the cap is what cp = 1 holds at the middle length; for each cp the longest row
   (a multiple of 256) whose every rank stays under it, found by bisection on real runs (target: at least
   (cp - 0.5) times cp = 1's).

cp is 1 and 2 only: the machine has 2 cores, and a ring's ranks all compute (two computing ranks at most).

    python -m bench.context.context_memory
    python -m bench.context.context_memory --quick
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import click

from bench.common import benchlib as B

NAME = "context_memory"
CPS = (1, 2)
STEP = 256  # row lengths searched: multiples of this (a multiple of 2 * cp)


def _model():
    from hetero_llm.layout import Mlp, ModelSpec, Norm, Position

    return ModelSpec(
        layers=2, hidden=32, heads=2, vocab=64, seq_len=STEP,
        norm=Norm.RMSNORM, position=Position.ROPE, mlp=Mlp.SWIGLU,
    )  # fmt: skip


def measure(ring, seq_len: int) -> int:
    """Activation bytes this rank holds at the end of the forward of one row of ``seq_len`` (then trains it)."""
    import torch

    from hetero_llm.model import cp_chunks
    from hetero_llm.model.context import ContextShard
    from hetero_llm.model.forward import StageShape, init_full, stage_forward, token_loss_sum
    from hetero_llm.model.params import stage_params
    from hetero_llm.runtime.tensor_meter import TensorMeter

    model = _model()
    p = {i.name: init_full(i, model, 0).requires_grad_() for i in stage_params(model, 0, model.layers, True, True)}
    gen = torch.Generator().manual_seed(seq_len)
    tokens, targets = (torch.randint(0, model.vocab, (1, seq_len), generator=gen) for _ in range(2))
    local = torch.as_tensor(cp_chunks.local_positions(seq_len, ring.size, ring.index))
    shard = ContextShard(ring, local, None, local[None])
    meter = TensorMeter()
    meter.register("params", lambda: p.values())
    meter.state_bytes()  # parameters are state, not activations
    with meter.saving():
        logits = stage_forward(p, tokens[:, local], StageShape(0, model.layers, True, True), model, ctx=shard)
        loss = token_loss_sum(logits, targets[:, local])
        held = meter.segment_peak
        loss.backward()
    return held


def _rank(rank: int, cp: int, port: int, lengths: list[int], cap_len: int, cap: int, out: str) -> None:
    """Measure ``lengths``, then search the longest row under ``cap`` (cp 1: the cap is its own at ``cap_len``)."""
    import torch
    import torch.distributed as dist

    from hetero_llm.comm.ring import SOLO, Ring

    torch.set_num_threads(1)
    if cp > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=cp)
    ring = Ring(None, tuple(range(cp)), rank) if cp > 1 else SOLO

    def most(seq_len: int) -> int:  # the largest over the ring's ranks: what a cap must hold; all ranks agree
        t = torch.tensor([measure(ring, seq_len)])
        if cp > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t)

    found = {n: most(n) for n in lengths}
    cap = cap or found[cap_len]
    lo = hi = cap_len  # lo fits
    while most(hi * 2) <= cap:
        hi *= 2
    lo, hi = hi, hi * 2  # lo fits, hi does not
    while hi - lo > STEP:
        mid = (lo + hi) // 2 // STEP * STEP
        lo, hi = (mid, hi) if most(mid) <= cap else (lo, mid)
    if cp > 1:
        dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps({"bytes": found, "cap": cap, "longest": lo}))


def _run(cp: int, lengths: list[int], cap_len: int, cap: int, tmp: str) -> dict:
    import torch.multiprocessing as mp

    out = str(Path(tmp) / f"cp{cp}.json")
    mp.spawn(_rank, args=(cp, B.free_port(), lengths, cap_len, cap, out), nprocs=cp, join=True)
    return json.loads(Path(out).read_text())


def _fit(points: dict[int, int]) -> tuple[float, float]:
    """Least squares a + b * n over (n, bytes)."""
    ns, ys = list(points), list(points.values())
    mn, my = sum(ns) / len(ns), sum(ys) / len(ys)
    b = sum((n - mn) * (y - my) for n, y in zip(ns, ys)) / sum((n - mn) ** 2 for n in ns)
    return my - b * mn, b


@click.command()
@click.option("--quick", is_flag=True, help="512-4K positions instead of 1K-16K")
@click.option("--out-dir", type=click.Path(path_type=Path), default=B.RESULTS, show_default=True)
def main(quick: bool, out_dir: Path) -> None:
    lengths = [512, 1024, 2048, 4096] if quick else [1024, 2048, 4096, 8192, 16384]
    cap_len = lengths[len(lengths) // 2]
    load_before = B.load_average()
    with tempfile.TemporaryDirectory(prefix="context_memory_") as tmp:
        per_cp: dict[int, dict] = {}
        for cp in CPS:
            B.say(f"cp {cp}: {lengths}, then the longest row under the cap")
            per_cp[cp] = _run(cp, lengths, cap_len, per_cp[1]["cap"] if cp > 1 else 0, tmp)
    cap = per_cp[1]["cap"]
    longest = {cp: per_cp[cp]["longest"] for cp in CPS}
    load_after = B.load_average()
    fits = {cp: _fit({int(n): b for n, b in per_cp[cp]["bytes"].items()}) for cp in CPS}
    results = []
    for cp in CPS:
        slope_ratio = fits[cp][1] / fits[1][1]
        chunk = lengths[-1] // (2 * cp)
        results.append(
            {
                "cp": cp,
                # not metered: one block's float32 scores at the longest length (B = 1, the model's heads)
                "block_scores_bytes": _model().heads * chunk * chunk * 4,
                "bytes": per_cp[cp]["bytes"],
                "fixed_bytes": fits[cp][0],
                "bytes_per_position": fits[cp][1],
                "slope_vs_cp1": slope_ratio,
                "slope_error_vs_1_over_cp": slope_ratio * cp - 1,
                "longest_row": longest[cp],
                "longest_vs_cp1": longest[cp] / longest[1],
            }
        )
    rows = [
        [r["cp"], *(f"{r['bytes'][str(n)] / 2**20:.2f}" for n in lengths), f"{r['bytes_per_position']:.0f}",
         f"{r['slope_vs_cp1']:.3f}", f"{r['slope_error_vs_1_over_cp']:+.1%}", r["longest_row"],
         f"{r['longest_vs_cp1']:.2f}x", f"{r['block_scores_bytes'] / 2**20:.0f}"]
        for r in results
    ]  # fmt: skip
    headers = [
        "cp",
        *(f"MiB at {n}" for n in lengths),
        "B/position",
        "slope / cp 1",
        "vs 1/cp",
        "longest row",
        "vs cp 1",
        f"block scores MiB at {lengths[-1]}",
    ]
    machine = B.machine()
    markdown = "\n".join(
        [
            *B.report_head("Activation memory per context-parallel rank", machine, load_before, load_after),
            "Per rank, the most of the ring's ranks: activations autograd holds at the end of the forward of one row "
            "(tensor meter). Longest row: under the cap of what cp 1 holds at "
            f"{cap_len} positions ({cap / 2**20:.2f} MiB), multiples of {STEP}. cp 1 and 2 only: 2 cores. Block scores: "
            "the float32 score matrix of one (T/2cp)^2 attention block, a transient the meter does not count (a few "
            "such are alive inside one block's backward); it shrinks as 1/cp^2.",
            "",
            B.markdown_table(headers, rows),
        ]
    )
    payload = {"command": B.command_line(), "machine": machine, "cap_bytes": cap, "cap_len": cap_len,
               "load_before": load_before, "load_after": load_after, "results": results}  # fmt: skip
    md, js = B.write_results(out_dir, NAME, markdown, payload)
    print(markdown)
    B.say(f"wrote {md} and {js}")


if __name__ == "__main__":
    main()
