"""Absurd sizes refused before any rank starts (hetero-launch), not a MemoryError in every rank: each rank's
memory estimated from the plan and compared with the host's RAM and each GPU's memory. Torch-free (GPU memory is
read from nvidia-smi: asking torch would start CUDA in the launcher before it forks the ranks)."""

from __future__ import annotations

import os
import subprocess
from typing import Any

import attrs

from hetero_llm.errors import LayoutError
from hetero_llm.model.params import embedding_params, head_params, layer_params
from hetero_llm.plan import Plan

MEMORY_RULE = (
    "estimate: 8 B per token id of the step's batch on every rank, 16 B per parameter of a rank for "
    "weights, gradients and AdamW moments (ZeRO-1: their share), and one microbatch's activations at 4 B "
    "per position, layer and hidden unit plus its logits; the key named is the one that fits with the "
    "smallest change"
)
# The key that drives each part of the estimate: named when no one key can be made small enough alone
MEMORY_KEYS = {
    "tokens": "train.global_batch",
    "activations": "train.global_batch",
    "blocks": "model.hidden",
    "embeddings": "model.vocab",
    "logits": "model.vocab",
}


def memory_parts(plan: Plan, rank: int, model=None, global_batch: int | None = None) -> dict[str, int]:
    """What rank ``rank`` needs at least, in bytes, by part (``MEMORY_RULE``; 'tokens' are in this host's RAM
    whatever the device, the rest on the rank's device). ``model`` / ``global_batch`` replace the layout's
    (to find the largest value that fits). Read from the rank's compiled ``RankPlan``. Torch-free."""
    rp = plan.rank_plan(rank)
    model = model or rp.model
    gb = global_batch or rp.train.global_batch
    stage, share = rp.stage, rp.batch
    tp = stage.tp
    cp = stage.cp  # a context-parallel rank holds 1 / cp of every row's positions
    first, last = stage.first, stage.last
    layers = sum(hi - lo for lo, hi in stage.chunk_ranges)

    def count(infos) -> int:  # elements of the rank's shards of these parameters
        total = 0
        for p in infos:
            n = 1
            for d in p.shape:
                n *= d
            total += n // tp if p.shard_dim is not None else n
        return total

    edge = (embedding_params(model) if first else []) + (head_params(model) if last else [])
    edge = list({p.name: p for p in edge}.values())  # a tied head on a one-stage pipeline: one tensor
    rows = max(1, -(-share.size * gb // (rp.train.global_batch * share.microbatches)))  # one microbatch's rows
    positions = rows * model.seq_len // cp
    pipelines = len(plan.schedules)
    per_param = 8 + -(-8 // pipelines) if rp.sharded_optimizer else 16  # ZeRO-1: the moments sharded over pipelines
    return {
        "tokens": gb * (model.seq_len + 1) * 8,
        "activations": positions * layers * (model.hidden // tp) * 4,
        "blocks": per_param * layers * count(layer_params(model, 0)),
        "embeddings": per_param * count(edge),
        "logits": positions * model.vocab * 4 if last else 0,  # attention: causal SDPA, no seq_len^2 scores
    }


def _placed_parts(plan: Plan, which: list[int], on_host: bool, **change) -> dict[str, int]:
    """The parts of ranks ``which`` summed, those in this host's RAM (``on_host``: all of a CPU rank's, a GPU
    rank's token ids) or else those on their GPU."""
    total = dict.fromkeys(MEMORY_KEYS, 0)
    for r in which:
        gpu = plan.ranks[r].device != "cpu"
        for part, n in memory_parts(plan, r, **change).items():
            if not gpu or (part == "tokens") == on_host:
                total[part] += n
    return total


def host_memory_bytes() -> int:
    """This machine's RAM (physical pages times their size)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_memory(plan: Plan, ranks: list[int], ram: int | None = None, device_memory=None) -> None:
    """Before ``ranks`` start here: refuse a layout whose estimated memory (``MEMORY_RULE``) exceeds this host's RAM
    (``ranks`` together) or a GPU's memory (``device_memory(device)``: its bytes, or None when unknown; by default
    nvidia-smi's answer), naming the key that fits with the smallest change and the largest value of it that fits."""
    if not ranks:
        return
    ram = host_memory_bytes() if ram is None else ram
    groups = [(list(ranks), True, ram, "RAM on this host")]
    for device in sorted({plan.ranks[r].device for r in ranks} - {"cpu"}):
        capacity = (device_memory or _gpu_memory)(device)
        if capacity:
            mine = [r for r in ranks if plan.ranks[r].device == device]
            groups.append((mine, False, capacity, f"memory on {device}"))
    for which, on_host, capacity, where in groups:
        parts = _placed_parts(plan, which, on_host)
        need = sum(parts.values())
        if need <= capacity:
            continue
        # the key to change least: the one whose largest fitting value is nearest its own
        bounds = {key: _largest_fitting(plan, which, on_host, capacity, key) for key in MEMORY_CHOICES}
        fitting = [(value / bound, key) for key, (value, bound) in bounds.items() if bound]
        if fitting:
            key = min(fitting)[1]
        else:  # no one key alone: the one behind the largest part
            by_key: dict[str, int] = {}
            for part, n in parts.items():
                by_key[MEMORY_KEYS[part]] = by_key.get(MEMORY_KEYS[part], 0) + n
            key = max(by_key, key=by_key.__getitem__)
        value, bound = bounds[key]
        fits = f"at most {bound} fits" if bound else "no value fits with the rest of the layout"
        raise LayoutError(
            plan.rank_plan(which[0]).file,
            key,
            f"{value} needs an estimated {_gib(need)} of {where} for rank(s) "
            f"{', '.join(map(str, which))}, more than its {_gib(capacity)} ({fits}; {MEMORY_RULE})",
        )


MEMORY_CHOICES = ("train.global_batch", "model.seq_len", "model.vocab", "model.hidden")


def _largest_fitting(plan: Plan, which: list[int], on_host: bool, capacity: int, key: str) -> tuple[int, int]:
    """The layout's value of ``key`` and the largest value of it whose estimate fits ``capacity`` (0: none)."""
    rp = plan.rank_plan(which[0])  # the model and train settings are every rank's
    model = rp.model
    field, step = key.partition(".")[2], 1
    value = rp.train.global_batch if key == "train.global_batch" else getattr(model, field)
    if field == "hidden":  # keep heads dividing it (and rope's head size even)
        step = model.heads * (2 if model.position.value == "rope" else 1)

    def fits(v: int) -> bool:
        resized: dict[str, Any] = {field: v}  # one of MEMORY_CHOICES' model fields (an int)
        change = {"global_batch": v} if key == "train.global_batch" else {"model": attrs.evolve(model, **resized)}
        return sum(_placed_parts(plan, which, on_host, **change).values()) <= capacity

    lo, hi = 0, value // step  # invariant: lo == 0 or fits(lo * step); not fits(hi * step)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid * step):
            lo = mid
        else:
            hi = mid
    return value, lo * step


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def _gpu_memory(device: str) -> int | None:
    """Bytes of memory of CUDA device ``device`` ('cuda:N', N counted as CUDA_VISIBLE_DEVICES lists them), from
    nvidia-smi: asking torch would initialize CUDA in the launcher, which its forked ranks cannot inherit. None
    where nvidia-smi or the device is not there to ask."""
    index = int(device.partition(":")[2] or 0)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if index >= len(ids) or not ids[index].isdigit():  # GPU UUIDs or MIG names: not asked
            return None
        index = int(ids[index])
    try:
        query = ["nvidia-smi", f"--id={index}", "--query-gpu=memory.total", "--format=csv,noheader,nounits"]
        out = subprocess.run(query, capture_output=True, text=True, timeout=30)
        return int(out.stdout.split()[0]) * 2**20 if out.returncode == 0 else None  # MiB
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return None
