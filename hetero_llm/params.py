"""Global parameter names, full shapes and tensor-parallel shard dims; from them, the memory a rank needs at
least, which ``hetero-launch`` checks against the host's RAM (and GPUs) before any rank starts. Torch-free.

Names are global (``layers.7.attn.wq``), never stage-local, so a checkpoint or a gradient means the
same thing under every layout. A TP shard is always a contiguous slice of the full tensor along one
dim (or the full tensor, for replicated parameters): that is what lets gradient sync and hot
switching cut shards of different layouts into common blocks.

Q, K and V are separate matrices rather than one fused ``wqkv`` so that a head-split is a single
contiguous row range of each (a fused QKV shard would be three disjoint ranges).
"""

from __future__ import annotations

import os
import subprocess
from typing import TYPE_CHECKING

import attrs

from hetero_llm.errors import LayoutError
from hetero_llm.layout import ModelSpec, Mlp, Norm, Position

if TYPE_CHECKING:
    from hetero_llm.plan import Plan


@attrs.frozen
class ParamInfo:
    name: str
    shape: tuple[int, ...]
    shard_dim: int | None  # dim split across a stage's TP ranks; None = replicated in the TP group
    decay: bool  # AdamW weight decay applies (weight matrices, not norms or embeddings)
    layer: int | None  # block index, or None for embedding / final norm / head


def _norm(prefix: str, model: ModelSpec, layer: int | None) -> list[ParamInfo]:
    out = [ParamInfo(f"{prefix}.weight", (model.hidden,), None, False, layer)]
    if model.norm is Norm.LAYERNORM:
        out.append(ParamInfo(f"{prefix}.bias", (model.hidden,), None, False, layer))
    return out


# model.bias: the bias of each projection, named after its weight. Column-parallel biases are split with
# their weight's rows; row-parallel ones (bo, b2) are replicated and added once, after the all-reduce.
BIAS_OF = {"wq": "bq", "wk": "bk", "wv": "bv", "wo": "bo", "w1": "b1", "w3": "b3", "w2": "b2"}


def _proj(name: str, shape: tuple[int, int], shard_dim: int, model: ModelSpec, i: int) -> list[ParamInfo]:
    """A projection weight (column-parallel: shard_dim 0, row-parallel: 1) and, with model.bias, its bias."""
    out = [ParamInfo(name, shape, shard_dim, True, i)]
    if model.bias:
        prefix, leaf = name.rsplit(".", 1)
        out.append(ParamInfo(f"{prefix}.{BIAS_OF[leaf]}", shape[:1], 0 if shard_dim == 0 else None, False, i))
    return out


def layer_params(model: ModelSpec, i: int) -> list[ParamInfo]:
    C, F = model.hidden, model.ffn_width
    KV = model.kv_heads_n * model.head_dim  # grouped-query attention: fewer key/value rows
    p = f"layers.{i}"
    out = _norm(f"{p}.attn_norm", model, i)
    for w, rows in (("wq", C), ("wk", KV), ("wv", KV)):
        out += _proj(f"{p}.attn.{w}", (rows, C), 0, model, i)  # column-parallel
    out += _proj(f"{p}.attn.wo", (C, C), 1, model, i)  # row-parallel
    out += _norm(f"{p}.mlp_norm", model, i)
    out += _proj(f"{p}.mlp.w1", (F, C), 0, model, i)
    if model.mlp is Mlp.SWIGLU:
        out += _proj(f"{p}.mlp.w3", (F, C), 0, model, i)
    out += _proj(f"{p}.mlp.w2", (C, F), 1, model, i)
    return out


def embedding_params(model: ModelSpec) -> list[ParamInfo]:
    out = [ParamInfo("embed.tok", (model.vocab, model.hidden), None, False, None)]
    if model.position is Position.LEARNED:
        out.append(ParamInfo("embed.pos", (model.seq_len, model.hidden), None, False, None))
    return out


def head_params(model: ModelSpec) -> list[ParamInfo]:
    """The final norm and the output head. With model.tie_embeddings the head is ``embed.tok`` itself: a
    last stage holds a copy of it, and gradient sync sums the copies' gradients (Megatron's embedding group)."""
    if model.tie_embeddings:
        return _norm("final_norm", model, None) + embedding_params(model)[:1]
    return _norm("final_norm", model, None) + [ParamInfo("lm_head.weight", (model.vocab, model.hidden), None, True, None)]


def stage_params(model: ModelSpec, layer_lo: int, layer_hi: int, first: bool, last: bool) -> list[ParamInfo]:
    """Parameters a stage holding layers [layer_lo, layer_hi) owns, in a fixed order (each once)."""
    out = embedding_params(model) if first else []
    for i in range(layer_lo, layer_hi):
        out += layer_params(model, i)
    if last:
        out += [info for info in head_params(model) if info not in out]  # a tied head on the first stage
    return out


def all_params(model: ModelSpec) -> list[ParamInfo]:
    return stage_params(model, 0, model.layers, True, True)


def shard_range(info: ParamInfo, tp_size: int, tp_index: int) -> tuple[int, int]:
    """The [lo, hi) range along ``info.shard_dim`` that TP rank ``tp_index`` of ``tp_size`` holds."""
    if info.shard_dim is None:
        return 0, info.shape[0]
    n = info.shape[info.shard_dim]
    return tp_index * n // tp_size, (tp_index + 1) * n // tp_size


def count_params(model: ModelSpec) -> int:
    total = 0
    for info in all_params(model):
        n = 1
        for s in info.shape:
            n *= s
        total += n
    return total


# --------------------------------------------------------------------------------------------------
# Memory: absurd sizes refused before any rank starts (hetero-launch), not a MemoryError in every rank
# --------------------------------------------------------------------------------------------------


MEMORY_RULE = ("estimate: 8 B per token id of the step's batch on every rank, 16 B per parameter of a rank for "
               "weights, gradients and AdamW moments (ZeRO-1: their share), and one microbatch's activations at 4 B "
               "per position, layer and hidden unit plus its logits; the key named is the one that fits with the "
               "smallest change")
# The key that drives each part of the estimate: named when no one key can be made small enough alone
MEMORY_KEYS = {"tokens": "train.global_batch", "activations": "train.global_batch", "blocks": "model.hidden",
               "embeddings": "model.vocab", "logits": "model.vocab"}


def memory_parts(plan: Plan, rank: int, model=None, global_batch: int | None = None) -> dict[str, int]:
    """What rank ``rank`` needs at least, in bytes, by part (``MEMORY_RULE``; 'tokens' are in this host's RAM
    whatever the device, the rest on the rank's device). ``model`` / ``global_batch`` replace the layout's
    (to find the largest value that fits). Torch-free."""
    lay = plan.layout
    model = model or lay.model
    gb = global_batch or lay.train.global_batch
    info = plan.ranks[rank]
    pipe = lay.pipelines[info.pipeline]
    stage = pipe.stages[info.stage]
    tp = len(stage.devices)
    first, last = info.stage == 0, info.stage == len(pipe.stages) - 1

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
    rows = max(1, -(-pipe.batch * gb // (lay.train.global_batch * pipe.microbatches)))  # one microbatch's rows
    positions = rows * model.seq_len
    per_param = 16 if lay.train.optimizer.value != "adamw_zero1" else 8 + -(-8 // len(lay.pipelines))  # moments sharded
    return {
        "tokens": gb * (model.seq_len + 1) * 8,
        "activations": positions * stage.layers * (model.hidden // tp) * 4,
        "blocks": per_param * stage.layers * count(layer_params(model, 0)),
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
            key = max(by_key, key=by_key.get)
        value, bound = bounds[key]
        fits = f"at most {bound} fits" if bound else "no value fits with the rest of the layout"
        raise LayoutError(plan.layout.file, key, f"{value} needs an estimated {_gib(need)} of {where} for rank(s) "
                          f"{', '.join(map(str, which))}, more than its {_gib(capacity)} ({fits}; {MEMORY_RULE})")


MEMORY_CHOICES = ("train.global_batch", "model.seq_len", "model.vocab", "model.hidden")


def _largest_fitting(plan: Plan, which: list[int], on_host: bool, capacity: int, key: str) -> tuple[int, int]:
    """The layout's value of ``key`` and the largest value of it whose estimate fits ``capacity`` (0: none)."""
    model = plan.layout.model
    field, step = key.partition(".")[2], 1
    value = plan.layout.train.global_batch if key == "train.global_batch" else getattr(model, field)
    if field == "hidden":  # keep heads dividing it (and rope's head size even)
        step = model.heads * (2 if model.position.value == "rope" else 1)

    def fits(v: int) -> bool:
        change = {"global_batch": v} if key == "train.global_batch" else {"model": attrs.evolve(model, **{field: v})}
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
