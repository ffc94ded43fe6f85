"""The hot-switching bench's static baselines and planned buckets, from the project's planner (``python -m
bench.hot_switch.hot_switch``): the planner's cluster for the bench's scenario, the best static layouts it predicts over
its whole static space, and what ``hetero-plan --buckets`` proposes; plus the modelled memory of a layout per
device (the planner's memory model, bucket layouts' parameter copies counted). Public planner API only:
``load_cluster``, ``plan_cluster`` (its ranked results), ``planner.evaluate``, ``switching.propose.propose``,
``planner.output.planned_layout`` and ``switching.worth.judge``.

The planner's device kind is the emulated device: ``tflops`` its GFLOP/s, ``link_gbps`` the TP link (a node's
link: the planner groups TP inside a node, so its cluster is one node of two devices; on the testbed the
layouts' second device is then renamed to the second node's), ``memory_gb`` the cap: what static TP 2 with one
row per microbatch needs per device by the planner's own memory model (``cap_positions`` = half a row of
``seq_len``), over one minus the memory margin. Every static layout the planner proposes fits it, as does every
bucket layout the bench runs (checked: ``modelled_peak``). ``[plan.documents]`` declares the lognormal lengths the
rows are packed from (the scenario's median and sigma), so the planner prices attention per document, as the
runtime computes it.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from bench.hot_switch.hot_switch_config import Config, common, tp2
from hetero_llm import layout as layout_mod
from hetero_llm.layout import Layout, Recompute

REJECTED = "buckets --buckets rejected (kept set, not written)"
SCHEDULES = ("1f1b", "zbh1", "interleaved")  # every schedule the planner prices (planner/cluster.py)
OPTIMIZERS = ("adamw", "adamw_zero1")


def cluster_text(cfg: Config, memory_gb: float, optimizer: str = "adamw") -> str:
    """The planner's cluster file for the scenario (see the module doc)."""
    one_node = attrs.evolve(cfg, network="loopback")
    lay = common(one_node, ())
    lay = attrs.evolve(lay, train=attrs.evolve(lay.train, optimizer=layout_mod.Optimizer(optimizer)))
    text = layout_mod.dumps(lay)
    schedules = ", ".join(f'"{s}"' for s in SCHEDULES)
    return (
        text
        + f"""
[plan]
max_tp = 2
max_cp = {cfg.max_cp}
schedules = [{schedules}]
max_evals = 400
[plan.documents]  # the lengths the rows are packed from (data.doc_len_*): attention priced per document
distribution = "lognormal"
median = {cfg.median:.9g}
sigma = {cfg.sigma:.9g}
[plan.nodes]
node0 = "emu"
[plan.kinds.emu]
tflops = {cfg.gflops / 1e3:.9g}
memory_gb = {memory_gb:.9g}
link_gbps = {cfg.tp_gbps:.9g}
mem_bw_gbs = 10  # the optimizer step runs for real on this CPU (not emulated): the catalogue's cpu figure
"""
    )


def load(cfg: Config, folder: Path, memory_gb: float, optimizer: str = "adamw"):
    from hetero_llm.planner import load_cluster

    path = folder / f"cluster_{optimizer}.toml"
    path.write_text(cluster_text(cfg, memory_gb, optimizer))
    return load_cluster(path)


def cap_gb(cfg: Config, folder: Path) -> float:
    """The memory cap (GB per device): static TP 2 with one row per microbatch, by the planner's memory model."""
    from hetero_llm.planner.evaluate import evaluate

    cluster = load(cfg, folder, 1e3)
    tp = one_node(cfg, common(cfg, (tp2(cfg, cfg.global_batch, cfg.global_batch),)))
    if cfg.max_cp > 1:  # a row must be split even recomputing: the cap is cp 2 with full recompute
        stage = attrs.evolve(tp.pipelines[0].stages[0], cp=2, recompute=Recompute.FULL)
        tp = attrs.evolve(tp, pipelines=(attrs.evolve(tp.pipelines[0], stages=(stage,)),))
    score = evaluate(cluster, tp, "<hot_switch tp2>").score
    return max(m for ms in score.memory for m in ms) / (1 - cluster.limits.memory_margin) / 1e9 * 1.0001


def one_node(cfg: Config, lay: Layout) -> Layout:
    """``lay`` on the planner's one node (testbed layouts name node1:0 for the second device)."""
    rename = {cfg.devices[1]: "node0:1", cfg.devices[0]: "node0:0"}
    return _renamed(attrs.evolve(lay, cluster=common(attrs.evolve(cfg, network="loopback"), ()).cluster), rename)


def on_bench(cfg: Config, lay: Layout) -> Layout:
    """A planner's layout (one node) on the bench's cluster (loopback or two testbed nodes)."""
    rename = {"node0:0": cfg.devices[0], "node0:1": cfg.devices[1]}
    return _renamed(attrs.evolve(lay, cluster=common(cfg, ()).cluster, file="<hot_switch>"), rename)


def _renamed(lay: Layout, rename: dict[str, str]) -> Layout:
    def pipes(pipelines):
        return tuple(
            attrs.evolve(
                p, stages=tuple(attrs.evolve(s, devices=tuple(rename[d] for d in s.devices)) for s in p.stages)
            )
            for p in pipelines
        )

    buckets = tuple(attrs.evolve(b, pipelines=pipes(b.pipelines)) for b in lay.buckets)
    return attrs.evolve(lay, pipelines=pipes(lay.pipelines), buckets=buckets)


@attrs.frozen
class Planned:
    name: str  # e.g. "static (planner #1): 2 pipelines ..., recompute"
    layout: Layout  # on the bench's cluster
    predicted_s: float  # the planner's predicted step
    rank: int  # in the planner's ranking (1 = its best), 0 for planned buckets


def static_candidates(cfg: Config, folder: Path) -> tuple[float, list[Planned]]:
    """(the cap in GB, the planner's best ``cfg.static_candidates`` static layouts over both optimizers, the best of
    each structure: stages, TP sizes, recompute and rows per microbatch)."""
    from hetero_llm.planner import plan_cluster
    from hetero_llm.planner.output import planned_layout, summary

    memory = cap_gb(cfg, folder)
    ranked = []
    for optimizer in OPTIMIZERS:
        cluster = load(cfg, folder, memory, optimizer)
        result = plan_cluster(cluster, top=40)
        ranked += [(s.step_time, optimizer, cluster, c) for c, s in result.ranked if s.feasible]
    ranked.sort(key=lambda x: x[0])
    distinct, seen = [], set()
    for x in ranked:  # the best of each structure (a schedule or optimizer of the same stages: near the same step)
        key = tuple(
            (p.rows, tuple((s.group.tp, s.group.cp, s.layers, s.recompute) for s in p.stages)) for p in x[3].pipelines
        )
        if key not in seen:
            seen.add(key)
            distinct.append(x)
    out: list[Planned] = []
    for seconds, optimizer, cluster, cand in distinct[: cfg.static_candidates]:
        recompute = sum(st.recompute for p in cand.pipelines for st in p.stages)
        tp = "/".join(str(st.group.tp) for p in cand.pipelines for st in p.stages)
        cp = "/".join(str(st.group.cp) for p in cand.pipelines for st in p.stages)
        name = (
            f"static #{len(out) + 1}: {summary(cand)}, TP {tp}, {p_rows(cand)} rows/mb"
            + (f", cp {cp}" if cfg.max_cp > 1 else "")
            + (f", recompute {recompute} stage(s)" if recompute else "")
            + (", ZeRO-1" if optimizer != "adamw" else "")
        )
        out.append(Planned(name, on_bench(cfg, planned_layout(cluster, cand)), seconds, len(out) + 1))
    return memory, out


def p_rows(cand) -> str:
    return "/".join(str(p.rows) for p in cand.pipelines)


def planned_buckets(cfg: Config, folder: Path, memory: float) -> tuple[Planned | None, list[str]]:
    """What ``hetero-plan --buckets {short}`` proposes for the scenario (None when it writes the static layout),
    and its verdict's lines."""
    from hetero_llm.planner import plan_cluster
    from hetero_llm.planner.output import planned_layout
    from hetero_llm.switching import propose, worth

    cluster = load(cfg, folder, memory)
    result = plan_cluster(cluster, top=1)
    bounds = propose.parse_bounds(f"{cfg.short}", cluster)
    verdict = worth.judge(cluster, result.best, result.score, propose.propose(cluster, bounds, result.best))
    if not verdict.switching:
        kept = [b for b in verdict.chosen.buckets if b.plan is not None]
        if not (cfg.run_rejected and kept and not verdict.chosen.over):
            return None, verdict.lines()
        # the buckets --buckets priced and rejected (it writes the static layout): run to check the refusal
        lay = on_bench(cfg, planned_layout(cluster, result.best, verdict.chosen.buckets))
        return Planned(REJECTED, lay, verdict.chosen.step_s, 0), verdict.lines()
    lay = on_bench(cfg, planned_layout(cluster, result.best, verdict.buckets))
    return Planned("switching, hetero-plan --buckets", lay, verdict.chosen.step_s, 0), verdict.lines()


def modelled_peak(cfg: Config, folder: Path, memory: float, lay: Layout) -> float:
    """``modelled_peaks``' most over devices."""
    return max(modelled_peaks(cfg, folder, memory, lay))


def modelled_peaks(cfg: Config, folder: Path, memory: float, lay: Layout) -> list[float]:
    """Bytes per device (``cfg.devices``' order) by the planner's memory model: home's (its weights, gradients,
    moments and activations); with buckets, an upper bound: that, plus the one storage every bucket layout's
    parameters share (float32, the largest of this device's shards in them: ``Switcher.storage``), plus the most
    any bucket layout's own modelled bytes exceed home's."""
    from hetero_llm.plan import compile_plan
    from hetero_llm.planner.evaluate import evaluate

    def per_device(one: Layout, seq_len: int) -> dict[str, float]:
        at = attrs.evolve(cfg, seq_len=seq_len, global_batch=one.train.global_batch)
        cluster = load(at, folder, memory, one.train.optimizer.value)
        local = one_node(at, attrs.evolve(one, model=attrs.evolve(one.model, seq_len=seq_len)))
        score = evaluate(cluster, local, "<hot_switch>").score
        return {
            d: score.memory[p][s]
            for p, pipe in enumerate(local.pipelines)
            for s, st in enumerate(pipe.stages)
            for d in st.devices
        }

    home = per_device(attrs.evolve(lay, buckets=()), cfg.seq_len)
    order = ["node0:0", "node0:1"]  # one_node's names of cfg.devices
    if not lay.buckets:
        return [home.get(d, 0.0) for d in order]
    copies: dict[str, float] = {d: 0.0 for d in home}
    running: dict[str, float] = dict(home)
    for i, b in enumerate(lay.buckets):
        if not b.pipelines:
            continue
        own = layout_mod.bucket_layout(lay, i)
        plan = compile_plan(one_node(cfg, own))
        for r in plan.ranks:
            shard = sum(
                _numel(info.shape) // info.shape[info.shard_dim or 0] * (hi - lo)
                for info, lo, hi in plan.params_of(r.rank)
            )
            copies[r.device_id] = max(copies[r.device_id], 4.0 * shard)  # one storage: the largest layout's
        mine = per_device(attrs.evolve(own, train=attrs.evolve(own.train, optimizer=lay.train.optimizer)), b.max_len)
        for d, m in mine.items():
            running[d] = max(running[d], m)
    return [home[d] + copies[d] + max(0.0, running[d] - home[d]) if d in home else 0.0 for d in order]


def _numel(shape) -> int:
    n = 1
    for x in shape:
        n *= x
    return n
