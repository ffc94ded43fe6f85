"""NIC-aware placement (Holmes): from a cluster and a model, write a layout's ``[[pipelines]]``. Torch-free.

The rules, in the order they are applied:

1. **TP stays inside a node.** Each node offers ``devices // tp`` TP groups of consecutive devices.
2. **DP stays inside a domain.** Every pipeline puts the same layers in the same domain, so the
   gradient sync of a layer (among its holders in every pipeline) never leaves that domain. A domain
   with fewer TP groups than pipelines cannot hold a stage of every pipeline; it is left out (a note
   says so) rather than let one stage's DP group span domains.
3. **Pipeline boundaries fall on cross-domain links.** A pipeline visits the domains in the order the
   cluster declares them, each once: it crosses domains ``domains - 1`` times, and its other stage
   boundaries stay inside a domain (inside a node where the node has several TP groups).
4. **Layers follow speed.** Domain *d* holds the same layers in every pipeline, as many as minimize
   the slowest domain's time (layers / mean speed of a pipeline's TP groups there); inside a domain,
   each pipeline splits them over its stages the same way, by the nodes' ``speed``. A node's
   ``memory_gb`` caps a stage's layers: 16 bytes per parameter (weights, gradients, AdamW moments) per
   device, counting the embedding and head on the first and last stages; activations are not counted.
5. **Batch follows throughput.** A pipeline's rows are proportional to 1 / its slowest stage's time.

``hetero-place CLUSTER.toml -o LAYOUT.toml`` reads a file with ``[model]``, ``[train]``, ``[data]``
and ``[cluster]`` (no ``[[pipelines]]``), and writes those sections back (``layout.dumps``) with the placed
pipelines.
"""

from __future__ import annotations

import os
from pathlib import Path

import attrs

from hetero_llm import layout as layout_mod
from hetero_llm._fs import write_atomically
from hetero_llm.errors import LayoutError
from hetero_llm.layout import (
    DEFAULT_TRANSPORT,
    ClusterSpec,
    Layout,
    ModelSpec,
    PipelineSpec,
    Schedule,
    StageSpec,
    TrainSpec,
)
from hetero_llm.model.params import embedding_params, head_params, layer_params

BYTES_PER_PARAM = 16  # float32 weight + gradient + AdamW's two moments


@attrs.frozen
class PlaceOptions:
    pipelines: int = 0  # 0: as many as the smallest usable domain has TP groups
    tp: int = 1  # devices per stage, all inside one node
    microbatches: int = 0  # per pipeline; 0: 2 x its stages (a divisor of its batch)


@attrs.frozen
class PlaceGroup:
    """One TP group: ``tp`` consecutive devices of one node."""

    node: str
    domain: str
    devices: tuple[str, ...]
    speed: float
    memory_gb: float


@attrs.frozen
class PlacedStage:
    unit: PlaceGroup
    layers: int


@attrs.frozen
class PlacedPipeline:
    batch: int
    microbatches: int
    stages: tuple[PlacedStage, ...]


@attrs.frozen
class Placement:
    pipelines: tuple[PlacedPipeline, ...]
    domains: tuple[str, ...]  # the domains a pipeline visits, in stage order
    domain_layers: tuple[int, ...]  # layers each of those domains holds (in every pipeline)
    tp: int
    notes: tuple[str, ...]


# --------------------------------------------------------------------------------------------


def place(file: str, model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, options: PlaceOptions) -> Placement:
    """The rules of this module's docstring, a step each; ``notes`` say what was left out and why."""
    tp = options.tp
    notes: list[str] = []  # what was left out, and why
    _check_tp(file, model, tp)
    by_domain = _tp_groups(file, cluster, tp, notes)
    pipelines, domains = _pipelines_and_domains(file, cluster, train, by_domain, options.pipelines, tp, notes)
    share = _share(by_domain, domains, pipelines)
    unit_layers = train.chunks if train.schedule is Schedule.INTERLEAVED else 1
    domain_layers, placed = _layers(file, model, tp, share, domains, pipelines, unit_layers, notes)
    out = _rows(file, train, options, placed)
    return Placement(tuple(out), tuple(domains), tuple(domain_layers), tp, tuple(notes))


def _check_tp(file: str, model: ModelSpec, tp: int) -> None:
    if tp < 1:
        raise LayoutError(file, "--tp", f"must be >= 1, got {tp}")
    if model.heads % tp or model.ffn_width % tp:
        raise LayoutError(
            file,
            "--tp",
            f"TP size {tp} does not divide heads ({model.heads}) and the MLP width "
            f"({model.ffn_width}) (pick a common divisor)",
        )


def _tp_groups(file: str, cluster: ClusterSpec, tp: int, notes: list[str]) -> dict[str, list[PlaceGroup]]:
    """Rule 1: each node's ``devices // tp`` TP groups of consecutive devices, by domain."""
    by_domain: dict[str, list[PlaceGroup]] = {}
    for node in cluster.nodes:
        domain = cluster.domain_of(node.name)
        groups = len(node.devices) // tp
        if len(node.devices) % tp:
            notes.append(
                f"{node.name}: {len(node.devices) % tp} of its {len(node.devices)} devices left unused "
                f"(TP {tp} groups stay inside a node)"
            )
        for g in range(groups):
            devices = tuple(f"{node.name}:{i}" for i in range(g * tp, (g + 1) * tp))
            by_domain.setdefault(domain, []).append(PlaceGroup(node.name, domain, devices, node.speed, node.memory_gb))
    if not by_domain:
        most = max(len(n.devices) for n in cluster.nodes)
        raise LayoutError(file, "--tp", f"no node has {tp} devices (the most is {most}; TP stays inside a node)")
    return by_domain


def _pipelines_and_domains(
    file: str,
    cluster: ClusterSpec,
    train: TrainSpec,
    by_domain: dict[str, list[PlaceGroup]],
    pipelines: int,
    tp: int,
    notes: list[str],
) -> tuple[int, list[str]]:
    """Rule 2: the pipeline count (``pipelines``, 0: the smallest usable domain's TP groups) and the domains,
    in the cluster's order, with a TP group for each pipeline (the others left out)."""
    order = [d.name for d in cluster.domains] or [DEFAULT_TRANSPORT]
    sizes = {d: len(by_domain.get(d, [])) for d in order}
    pipelines = pipelines or min(n for n in sizes.values() if n)
    if pipelines < 1:
        raise LayoutError(file, "--pipelines", f"must be >= 1, got {pipelines}")
    domains = [d for d in order if sizes[d] >= pipelines]
    if not domains:
        best = max(order, key=lambda d: sizes[d])
        raise LayoutError(
            file,
            "--pipelines",
            f"no domain has {pipelines} TP groups of {tp} device(s) "
            f"(the most is {sizes[best]}, in {best}): use --pipelines {sizes[best]} or fewer",
        )
    for d in order:
        if d not in domains and sizes[d]:
            notes.append(
                f"domain {d} left out: its {sizes[d]} TP group(s) cannot hold a stage of each of the "
                f"{pipelines} pipelines without a DP group spanning domains"
            )
    if train.global_batch < pipelines:
        raise LayoutError(
            file,
            "--pipelines",
            f"{pipelines} pipelines need train.global_batch >= {pipelines} (it is {train.global_batch})",
        )
    return pipelines, domains


def _share(
    by_domain: dict[str, list[PlaceGroup]], domains: list[str], pipelines: int
) -> dict[tuple[int, str], list[PlaceGroup]]:
    """Rule 2/3: pipeline p takes a contiguous block of each domain's TP groups (boundaries inside nodes)."""
    share: dict[tuple[int, str], list[PlaceGroup]] = {}
    for d in domains:
        units = by_domain[d]
        base, extra = divmod(len(units), pipelines)
        lo = 0
        for p in range(pipelines):
            n = base + (p < extra)
            share[(p, d)] = units[lo : lo + n]
            lo += n
    return share


def _layers(
    file: str,
    model: ModelSpec,
    tp: int,
    share: dict[tuple[int, str], list[PlaceGroup]],
    domains: list[str],
    pipelines: int,
    unit_layers: int,
    notes: list[str],
) -> tuple[list[int], list[list[PlacedStage]]]:
    """Rule 4: layers per domain (the same in every pipeline), then per stage; each pipeline's stages."""
    if model.layers < len(domains) * unit_layers:
        raise LayoutError(
            file,
            "model.layers",
            f"{model.layers} layers cannot give a stage to each of the "
            f"{len(domains)} domains {', '.join(domains)} (use more layers, or fewer domains)",
        )
    caps = _layer_caps(model, tp, share, domains, pipelines)
    weights = [sum(sum(u.speed for u in share[(p, d)]) for p in range(pipelines)) / pipelines for d in domains]
    domain_caps = [min(sum(caps[p, di]) for p in range(pipelines)) for di in range(len(domains))]
    domain_layers = _split(model.layers, weights, domain_caps, unit_layers)
    if domain_layers is None:
        raise LayoutError(
            file,
            "cluster.nodes",
            f"the {model.layers} layers do not fit in memory_gb: the domains "
            f"hold at most {sum(domain_caps)} (raise memory_gb, use --tp {tp * 2}, or fewer pipelines)",
        )
    placed = []
    for p in range(pipelines):
        stages = []
        for di, d in enumerate(domains):
            units = share[(p, d)]
            split = _split(domain_layers[di], [u.speed for u in units], caps[p, di], unit_layers)
            assert split is not None  # domain_caps bound every pipeline's capacity here
            if 0 in split:
                notes.append(
                    f"pipeline {p}: {split.count(0)} TP group(s) in {d} left idle ({domain_layers[di]} "
                    f"layers for {len(units)} groups)"
                )
            stages += [PlacedStage(u, n) for u, n in zip(units, split) if n]
        placed.append(stages)
    return domain_layers, placed


def _layer_caps(
    model: ModelSpec, tp: int, share: dict[tuple[int, str], list[PlaceGroup]], domains: list[str], pipelines: int
) -> dict[tuple[int, int], list[int]]:
    """The most layers each TP group's ``memory_gb`` holds (``BYTES_PER_PARAM``, the embedding on a pipeline's
    first stage, the head on its last), by (pipeline, domain index)."""
    layer_sz, embed_sz, head_sz = (
        _device_params(model, layer_params(model, 0), tp),
        _device_params(model, embedding_params(model), tp),
        _device_params(model, head_params(model), tp),
    )

    def cap(unit: PlaceGroup, first: bool, last: bool) -> int:
        if unit.memory_gb <= 0:
            return model.layers
        room = unit.memory_gb * 1e9 / BYTES_PER_PARAM - (embed_sz if first else 0) - (head_sz if last else 0)
        return max(0, int(room // layer_sz))

    caps = {}
    for p in range(pipelines):
        for di, d in enumerate(domains):
            units = share[(p, d)]
            last = di == len(domains) - 1
            caps[p, di] = [cap(u, di == 0 and i == 0, last and i == len(units) - 1) for i, u in enumerate(units)]
    return caps


def _rows(file: str, train: TrainSpec, options: PlaceOptions, placed: list[list[PlacedStage]]) -> list[PlacedPipeline]:
    """Rule 5: rows by throughput; microbatches a divisor of the rows."""
    rates = [1.0 / max(s.layers / s.unit.speed for s in st) for st in placed]
    batches = _split(train.global_batch, rates, [train.global_batch] * len(placed), 1)
    assert batches is not None  # every cap holds the whole batch
    out = []
    for stages, batch in zip(placed, batches):
        n = len(stages)
        target = options.microbatches or 2 * n
        step = n if train.schedule is Schedule.INTERLEAVED else 1
        fits = [m for m in range(step, batch + 1, step) if batch % m == 0 and m <= max(target, step)]
        if not fits:
            raise LayoutError(
                file,
                "--microbatches",
                f"a pipeline of {n} stages and {batch} rows has no microbatch "
                f"count dividing {batch}" + (f" that is a multiple of {n} ('interleaved')" if step > 1 else ""),
            )
        out.append(PlacedPipeline(batch, fits[-1], tuple(stages)))
    return out


def _device_params(model: ModelSpec, infos, tp: int) -> float:
    total = 0.0
    for info in infos:
        n = 1
        for s in info.shape:
            n *= s
        total += n / tp if info.shard_dim is not None else n
    return total


def _split(total: int, weights: list[float], caps: list[int], unit: int = 1) -> list[int] | None:
    """``total`` into parts that are multiples of ``unit``, each <= its cap, minimizing max(part / weight).

    Greedy from one unit each: the next unit goes where it raises part / weight least (optimal for a
    min-max of linear costs). With fewer units than parts, the heaviest parts get one each and the
    rest 0. None when the caps cannot hold ``total``.
    """
    n, k = total // unit, len(weights)
    room = [c // unit for c in caps]
    if sum(room) < n:
        return None
    parts = [0] * k
    for i in sorted(range(k), key=lambda i: -weights[i])[:n]:
        if room[i] > 0:
            parts[i] = 1
    for _ in range(n - sum(parts)):
        i = min((i for i in range(k) if parts[i] < room[i]), key=lambda i: ((parts[i] + 1) / weights[i], i))
        parts[i] += 1
    return [p * unit for p in parts]


# --------------------------------------------------------------------------------------------
# TOML in and out


def pipeline_specs(placement: Placement) -> tuple[PipelineSpec, ...]:
    """The placement as the layout's ``[[pipelines]]``."""
    return tuple(
        PipelineSpec(
            batch=p.batch,
            microbatches=p.microbatches,
            stages=tuple(StageSpec(layers=s.layers, devices=s.unit.devices) for s in p.stages),
        )
        for p in placement.pipelines
    )


def comments(placement: Placement) -> dict[str, str]:
    """Each stage's node, domain and speed, beside its devices in the written layout."""
    return {
        f"pipelines[{p}].stages[{s}].devices": f"{st.unit.node}, domain {st.unit.domain}, speed {st.unit.speed:g}"
        for p, pipe in enumerate(placement.pipelines)
        for s, st in enumerate(pipe.stages)
    }


def report(placement: Placement) -> str:
    pl = placement
    crossings = len(pl.domains) - 1
    lines = [
        f"placement: {len(pl.pipelines)} pipeline(s), TP {pl.tp}; stages visit domains "
        f"{' -> '.join(pl.domains)} ({crossings} cross-domain boundary per pipeline)",
        "",
        f"{'pipeline':<9} {'stage':<6} {'devices':<22} {'node':<10} {'domain':<10} {'speed':>5} {'layers':>7}  rows/mb",
    ]
    for p, pipe in enumerate(pl.pipelines):
        lo = 0
        for s, st in enumerate(pipe.stages):
            rows = f"{pipe.batch}/{pipe.microbatches}" if s == 0 else ""
            lines.append(
                f"{p:<9} {s:<6} {','.join(st.unit.devices):<22} {st.unit.node:<10} {st.unit.domain:<10} "
                f"{st.unit.speed:>5g} {lo:>3}-{lo + st.layers - 1:<3}  {rows}"
            )
            lo += st.layers
    lines += ["", "gradient sync stays inside a domain (the same layers in every pipeline):"]
    lo = 0
    for d, n in zip(pl.domains, pl.domain_layers):
        holders = [",".join(s.unit.devices) for pipe in pl.pipelines for s in pipe.stages if s.unit.domain == d]
        lines.append(f"  layers {lo}-{lo + n - 1} in {d}: {' '.join(holders)}")
        lo += n
    if pl.notes:
        lines += ["", "notes:"] + [f"  - {n}" for n in pl.notes]
    return "\n".join(lines)


def place_file(cluster_path: str | os.PathLike, out_path: str | os.PathLike, options: PlaceOptions) -> Placement:
    """Place, check the result as a layout, and write it atomically (the cluster file's sections plus the pipelines)."""
    _, _, sec = layout_mod.read_cluster_file(cluster_path, "placement")
    placement = place(str(cluster_path), sec["model"], sec["train"], sec["cluster"], options)
    src, out = Path(cluster_path), Path(out_path)
    data = sec["data"]
    if data.path and not Path(data.path).is_absolute() and src.resolve().parent != out.resolve().parent:
        raise LayoutError(
            str(cluster_path),
            "data.path",
            f"'{data.path}' is relative to the cluster file: write "
            "the placed layout next to it, or make data.path absolute",
        )
    summary = f"{len(placement.pipelines)} pipeline(s), TP {placement.tp}, domains {' -> '.join(placement.domains)}"
    placed = Layout(
        file=str(out_path),
        model=sec["model"],
        train=sec["train"],
        data=data,
        cluster=sec["cluster"],
        pipelines=pipeline_specs(placement),
    )
    text = layout_mod.dumps(
        placed,
        header=f"Placed by hetero-place from {src.name}: {summary}.\nRe-place rather than edit the pipelines.",
        comments={"pipelines[0]": f"placed pipelines: {summary}", **comments(placement)},
    )
    layout_mod.loads(text, file=str(out_path), base_dir=src.parent)  # the result must be a valid layout
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(out, lambda f: f.write(text.encode("utf-8")))
    return placement
