"""Whether hot switching pays (``hetero-plan --buckets``): planned bucket layouts priced as whole steps, their
switches and the memory of their shard copies included, against the best static plan. Torch-free.

``propose.propose`` plans each bucket on its own rows. ``judge`` then predicts whole steps, on the
documents of the first ``STEPS`` steps (the ones training draws, ``documents.fill_documents``):

- each bucket's rows as the run packs them (``bucketing.bucket_rows``: first-fit decreasing, top-up included,
  padded to its pipelines' shares);
- each bucket's compute from the planner's cost model: its plan's pipeline time (step time less gradient sync
  and optimizer) for ``train.global_batch`` rows of its width, scaled by the rows it runs (a bucket under the
  home layout: home's on rows of that width);
- the step's switches (``predict.step_switches``: the switch planner's bytes per link kind, each device's
  latency per message, copies and host work per block) over the cluster's links: a node's link at the slowest
  device kind's ``link_gbps``, the domains' NICs, the cross-domain network;
- home's gradient sync and optimizer step once.

The static step is the best static plan's predicted step (the planner's whole static space). Memory: a rank
keeps its float32 parameter shards of every planned bucket layout besides home's (``Switcher``'s slots), so a
device holds home's weights, gradients and moments, every copy, and the running layout's gradients and
activations; a set of buckets that does not fit a device is not proposed. Buckets are then dropped (run under
home) one at a time while that makes the predicted step faster; buckets are proposed only if the step that
is left is predicted faster than the static one, else the static layout is written.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import attrs

from hetero_llm import layout as layout_mod
from hetero_llm.data import documents, sources
from hetero_llm.plan import compile_plan
from hetero_llm.planner.buckets import Bucket, elastic_unit
from hetero_llm.planner.candidates import Candidate, PipelineChoice, Score
from hetero_llm.planner.cluster import Cluster
from hetero_llm.planner.memory import MOMENT_BYTES, MemoryModel
from hetero_llm.planner.output import planned_layout
from hetero_llm.planner.search import Planner
from hetero_llm.switching import bucketing
from hetero_llm.switching.predict import COPY_BANDWIDTH, NODE_LINK, link_costs, step_switches

STEPS = 4  # steps whose documents are priced (each draws its own documents)
FLOAT32_BYTES = 4


@attrs.frozen
class Priced:
    """One set of buckets priced over ``STEPS`` steps (seconds are means per step)."""

    buckets: tuple[Bucket, ...]
    compute_s: float  # the buckets' compute
    switch_s: float  # the switches
    home_s: float  # home's gradient sync and optimizer step
    copy_bytes: float  # the most bytes of bucket-layout parameter copies on one device
    peak_bytes: float  # the most bytes on one device, counted as the module doc says
    over: str  # "" when every device fits, else the first device over its memory

    @property
    def step_s(self) -> float:
        return self.compute_s + self.switch_s + self.home_s if not self.over else math.inf


@attrs.frozen
class Verdict:
    buckets: tuple[Bucket, ...]  # what to write: planned buckets, or all under home when switching does not pay
    static_s: float  # the best static plan's predicted step
    proposed: Priced  # every bucket propose planned
    chosen: Priced  # what is left after dropping the buckets that do not pay

    @property
    def switching(self) -> bool:
        return any(b.plan is not None for b in self.buckets)

    def lines(self) -> list[str]:
        def one(p: Priced) -> str:
            planned = [str(b.max_len) for b in p.buckets if b.plan is not None]
            if p.over:
                return f"buckets up to {', '.join(planned)}: do not fit ({p.over})"
            return (
                f"buckets up to {', '.join(planned) or '(none)'}: {p.step_s:.4g} s per step ({p.compute_s:.4g} s "
                f"compute, {p.switch_s:.4g} s switches = {p.switch_s / p.step_s:.1%}, {p.home_s:.4g} s sync and "
                f"optimizer), {self.static_s / p.step_s:.3f}x static; parameter copies {p.copy_bytes / 1e9:.3g} GB, "
                f"peak {p.peak_bytes / 1e9:.3g} GB per device"
            )

        out = [
            f"hot switching, PREDICTED over the documents of {STEPS} steps (cost model, switches over the "
            f"cluster's links): best static plan {self.static_s:.4g} s per step",
            "  proposed " + one(self.proposed),
        ]
        if self.chosen.buckets != self.proposed.buckets:
            out.append("  kept " + one(self.chosen))
        if self.switching:
            out.append("  => writing the buckets kept")
        else:
            out.append("  => switching is not predicted to pay: writing the static layout (no [[buckets]])")
        return out

    def to_json(self) -> dict:
        def one(p: Priced) -> dict:
            return {
                "buckets": [b.max_len for b in p.buckets if b.plan is not None],
                "step_s": p.step_s if math.isfinite(p.step_s) else None,
                "compute_s": p.compute_s,
                "switch_s": p.switch_s,
                "home_s": p.home_s,
                "copy_bytes": p.copy_bytes,
                "peak_bytes": p.peak_bytes,
                "over_memory": p.over or None,
            }

        return {
            "static_step_s": self.static_s,
            "proposed": one(self.proposed),
            "kept": one(self.chosen),
            "switching": self.switching,
        }


def judge(cluster: Cluster, home: Candidate, home_score: Score, buckets: Sequence[Bucket]) -> Verdict:
    """Price ``buckets`` (``propose``'s) against the best static plan ``home`` (see the module doc)."""
    prices = _Pricer(cluster, home, home_score)
    proposed = prices.price(tuple(buckets))
    # each bucket's choices: its own plan (if planned), the home layout, and home's stages as an elastic bucket of
    # the fewest rows home's schedule allows (``elastic_home``: a step then pads the bucket's rows to that unit, not
    # to the global batch, for the price of a parameter copy and switches by local copies)
    choices = []
    for b in buckets:
        options = [b, _home(b)] if b.plan is not None else [b]
        elastic = prices.elastic_home(b.max_len)
        if elastic is not None:
            options.append(elastic)
        choices.append(options)
    best = proposed
    while True:  # change the one bucket whose change helps most, while one does
        tries = [
            prices.price(tuple(o if j == i else b for j, b in enumerate(best.buckets)))
            for i, options in enumerate(choices)
            for o in options
            if o != best.buckets[i]
        ]
        better = min(tries, key=lambda p: p.step_s, default=None)
        if better is None or not better.step_s < best.step_s:
            break
        best = better
    static_s = home_score.step_time
    pays = any(b.plan is not None for b in best.buckets) and best.step_s < static_s
    if pays:
        chosen = best.buckets
    else:
        why = (
            f"home layout: whole steps with switching are not predicted faster than the best static plan "
            f"({best.step_s:.4g} s vs {static_s:.4g} s)"
            if not best.over
            else f"home layout: the bucket layouts' parameter copies do not fit ({best.over})"
        )
        chosen = tuple(_home(b, why) for b in buckets)
    return Verdict(chosen, static_s, proposed, best)


def _home(b: Bucket, why: str = "") -> Bucket:
    if b.plan is None:
        return b
    return Bucket(
        b.max_len, None, None, why or "home layout: its own plan does not pay for its switches on whole steps"
    )


class _Pricer:
    def __init__(self, cluster: Cluster, home: Candidate, home_score: Score):

        self.cluster, self.home, self.home_score = cluster, home, home_score
        self.planner_at: dict[int, Score] = {}  # bound -> the home layout's score on rows of that width
        lay = planned_layout(cluster, home)
        self.source = sources.document_sources(lay.data, lay.model.seq_len, lay.file)[0]
        self.global_batch = cluster.train.global_batch
        self._Planner = Planner

    def home_score_at(self, bound: int) -> Score:
        """The home layout's score on rows of ``bound`` positions."""
        if bound not in self.planner_at:
            shorter = attrs.evolve(self.cluster, model=attrs.evolve(self.cluster.model, seq_len=bound))
            at_seq_len = bound == self.cluster.model.seq_len
            self.planner_at[bound] = self.home_score if at_seq_len else self._Planner(shorter).evaluate(self.home)
        return self.planner_at[bound]

    def _home_pipe_s(self, bound: int) -> float:
        s = self.home_score_at(bound)
        return s.step_time - s.sync_time - s.optimizer_time

    def elastic_home(self, bound: int) -> Bucket | None:
        """Home's stages as an elastic bucket of rows up to ``bound``: each pipeline keeps its rows per microbatch
        and takes the fewest microbatches that keep home's proportions (rounded) and at least its stage count (what
        1F1B and ZB-H1 hold at most: no more activations than planned), so a step's rows pad to the sum of those
        shares, not to the global batch. None under other schedules, or where that is home itself."""

        if self.home.schedule not in ("1f1b", "zbh1"):
            return None
        # the fewest microbatches that keep every pipeline at >= its stage count and home's proportions (rounded)
        f = max(len(p.stages) / p.microbatches for p in self.home.pipelines)
        counts = [max(len(p.stages), round(p.microbatches * f)) for p in self.home.pipelines]
        pipes = tuple(PipelineChoice(p.rows * m, m, p.stages) for p, m in zip(self.home.pipelines, counts))
        cand = attrs.evolve(self.home, pipelines=pipes)
        if cand == self.home or elastic_unit(cand) is None:
            return None
        shares = sum(p.batch for p in pipes)
        at = attrs.evolve(
            self.cluster,
            model=attrs.evolve(self.cluster.model, seq_len=bound),
            train=attrs.evolve(self.cluster.train, global_batch=shares),
        )
        score = self._Planner(at).evaluate(cand)
        return Bucket(bound, cand, score, "") if score.feasible else None

    def price(self, buckets: tuple[Bucket, ...]) -> Priced:

        text = layout_mod.dumps(planned_layout(self.cluster, self.home, buckets))
        lay = layout_mod.loads(text, file=self.cluster.file, base_dir=Path(self.cluster.file).parent)
        home_plan = compile_plan(lay)
        plans = list(home_plan.buckets)
        links = self._links(lay)
        compute = switches = 0.0
        steps = max(1, min(STEPS, self.cluster.train.steps))
        for step in range(steps):
            docs = documents.fill_documents(self.source, lay.train.seed, step, self.global_batch, lay.model.seq_len)
            rows_of = bucketing.bucket_rows(lay, docs)
            for b, rows in zip(buckets, rows_of):
                if rows is None:
                    continue
                if b.plan is not None and b.score is not None:  # its plan's time for its shares' rows
                    shares = sum(p.batch for p in b.plan.pipelines)
                    pipe_s = (b.score.step_time - b.score.sync_time - b.score.optimizer_time) / shares
                else:
                    pipe_s = self._home_pipe_s(b.max_len) / self.global_batch
                compute += pipe_s * rows.num_rows
            switches += sum(s for _, _, s in step_switches(lay, home_plan, plans, rows_of, links, *self._copy()))
        copies, peak, over = self._memory(buckets)
        home_s = self.home_score.sync_time + self.home_score.optimizer_time
        return Priced(buckets, compute / steps, switches / steps, home_s, copies, peak, over)

    def _copy(self) -> tuple[float, float]:

        return COPY_BANDWIDTH, 0.0

    def _links(self, lay) -> dict[str, tuple[float, float]]:
        """The switch links: ``predict.link_costs`` (the layout's domains and cross-domain network), a node's
        link at the slowest device kind's ``link_gbps`` plus the cluster's ``p2p_latency_us``."""

        links = dict(link_costs(lay))
        slowest = min(n.kind.link_gbps for n in self.cluster.nodes)
        latency = max(NODE_LINK[0], self.cluster.limits.p2p_latency_us * 1e-6)
        links["node"] = (latency, slowest * 1e9 / 8)
        return links

    def _memory(self, buckets: tuple[Bucket, ...]) -> tuple[float, float, str]:
        """(most copy bytes on a device, most bytes on a device, the first device over its memory or "")."""

        mm = MemoryModel(self.cluster)

        def per_device(cand: Candidate, score: Score, model: MemoryModel) -> dict[str, tuple[float, float, float]]:
            """device -> (parameter elements, moment elements, activation bytes) of a layout."""
            out = {}
            moments = model.moments(cand)
            for p, pipe in enumerate(cand.pipelines):
                for s, st in enumerate(pipe.stages):
                    params = model.stage_params(st.group.tp, st.layers, s == 0, s == len(pipe.stages) - 1)
                    act = score.memory[p][s] - params * 8 - moments[p][s] * MOMENT_BYTES
                    for d in st.group.devices:
                        out[d] = (params, moments[p][s], max(0.0, act))
            return out

        home = per_device(self.home, self.home_score, mm)
        layouts = []
        for b in buckets:
            if b.plan is not None and b.score is not None:
                shorter = attrs.evolve(self.cluster, model=attrs.evolve(self.cluster.model, seq_len=b.max_len))
                layouts.append(per_device(b.plan, b.score, MemoryModel(shorter)))
        capacity = {
            d: mm.capacity(st.group) for pipe in self.home.pipelines for st in pipe.stages for d in st.group.devices
        }
        most_copies = most = 0.0
        over = ""
        for d, (params, moments, act) in home.items():
            copies = sum(lay.get(d, (0.0, 0.0, 0.0))[0] for lay in layouts) * FLOAT32_BYTES
            resident = params * 8 + moments * MOMENT_BYTES + copies  # home's weights, gradients, moments; copies
            running = [act] + [lay[d][0] * FLOAT32_BYTES + lay[d][2] for lay in layouts if d in lay]
            peak = resident + max(running)
            most_copies, most = max(most_copies, copies), max(most, peak)
            if peak > capacity[d] and not over:
                over = f"{d}: {peak / 1e9:.3g} GB of {capacity[d] / 1e9:.3g}"
        return most_copies, most, over
