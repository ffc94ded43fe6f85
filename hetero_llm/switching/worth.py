"""Whether hot switching pays (``hetero-plan --buckets``): planned bucket layouts priced as whole steps, their
switches and the memory they hold included, against the best static plan. Torch-free.

``propose.propose`` plans each bucket on its own rows. ``judge`` then predicts whole steps, on the
documents of the first ``STEPS`` steps (the ones training draws, ``documents.fill_documents``):

- each bucket's rows as the run packs them (``bucketing.bucket_rows``: first-fit decreasing, top-up included,
  padded to its pipelines' shares): a bucket is sized by its step's documents, not by ``train.global_batch``;
- each bucket's compute from the planner's cost model, its own plan evaluated **at its own rows**
  (``rows_plan``: an elastic bucket's pipelines run ``rounds`` times their shares and microbatches, a fixed one
  ``rounds`` times the rows per microbatch; a bucket under the home layout: home's stages likewise) and with its
  own documents' attention (the sum of their squared lengths over its rows, not the corpus' mean row);
- the step's switches (``predict.step_switches``: the switch planner's bytes per link kind, each device's
  latency per message, copies and host work per block) over the cluster's links: a node's link at the slowest
  device kind's ``link_gbps``, the domains' NICs, the cross-domain network;
- home's gradient sync and optimizer step once.

The static step is the best static plan's predicted step (the planner's whole static space, context parallelism
included). Memory, as held (one parameter storage shared by every layout, HotSPa's "single model storage
backbone"): a device holds home's weights, gradients and moments throughout, and beside them **one** float32
buffer for the bucket layouts' shards (the largest over the bucket layouts with a plan of their own: layouts run
one at a time and share it, the runtime's ``Switcher.storage``; a layout whose shards equal home's on a device
gets its views too, as the runtime gives it them; allocated once, so counted while home runs too, where HotSPa
frees its switch buffers after the update); while a bucket layout runs, that layout's gradients and activations;
while home runs, home's activations. A set of buckets that does not fit a
device is not proposed. Buckets are then
changed (own plan, home's, home's stages elastic) one at a time while that makes the predicted step faster;
buckets are proposed only if the step that is left is predicted at least ``MIN_GAIN`` times faster than the static
one, else the static layout is written: a smaller predicted gain is inside the cost model's error (3-6% on held-out
published rows, static layouts; the switch time within 20%; bucket layouts measured 0.70-0.89x where 1.01x was
predicted, docs/benchmarks.md), and a switching run that is slower than the static layout is the one outcome a
user who asked for ``--buckets`` must not get.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import attrs

from hetero_llm.data import documents, sources
from hetero_llm.plan import compile_plan
from hetero_llm.planner.buckets import Bucket, elastic_unit
from hetero_llm.planner.candidates import Candidate, PipelineChoice, Score
from hetero_llm.planner.cluster import Cluster
from hetero_llm.planner.cost import PlannerCostModel
from hetero_llm.planner.documents import LENGTHS, Documents
from hetero_llm.planner.memory import MOMENT_BYTES, MemoryModel
from hetero_llm.planner.output import planned_layout
from hetero_llm.switching import bucketing
from hetero_llm.switching.predict import COPY_BANDWIDTH, NODE_LINK, link_costs, step_switches

STEPS = 4  # steps whose documents are priced (each draws its own documents)
MIN_GAIN = 1.05  # the predicted speed-up over the best static plan below which the static layout is written
FLOAT32_BYTES = 4


@attrs.frozen
class Priced:
    """One set of buckets priced over ``STEPS`` steps (seconds are means per step)."""

    buckets: tuple[Bucket, ...]
    compute_s: float  # the buckets' compute
    switch_s: float  # the switches
    home_s: float  # home's gradient sync and optimizer step
    copy_bytes: float  # the most bytes on one device of the one buffer bucket layouts' own shards share
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
                f"optimizer), {self.static_s / p.step_s:.3f}x static; bucket shard buffer {p.copy_bytes / 1e9:.3g} GB, "
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
            out.append(
                f"  => switching is not predicted to pay (under {MIN_GAIN:g}x the static plan, the cost model's "
                "margin): writing the static layout (no [[buckets]])"
            )
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
    pays = any(b.plan is not None for b in best.buckets) and best.step_s * MIN_GAIN <= static_s
    if pays:
        chosen = best.buckets
    else:
        why = (
            f"home layout: whole steps with switching are not predicted {MIN_GAIN:g}x faster than the best static "
            f"plan ({best.step_s:.4g} s vs {static_s:.4g} s)"
            if not best.over
            else f"home layout: the bucket layouts do not fit ({best.over})"
        )
        chosen = tuple(_home(b, why) for b in buckets)
    return Verdict(chosen, static_s, proposed, best)


def _home(b: Bucket, why: str = "") -> Bucket:
    if b.plan is None:
        return b
    return Bucket(
        b.max_len, None, None, why or "home layout: its own plan does not pay for its switches on whole steps"
    )


@functools.lru_cache(maxsize=64)
def _step_documents(data, seq_len: int, file: str, seed: int, step: int, rows: int) -> tuple:
    source = sources.document_sources(data, seq_len, file)[0]
    return tuple(documents.fill_documents(source, seed, step, rows, seq_len))


def step_documents(cluster: Cluster, step: int) -> list:
    """The documents training draws at ``step`` (``documents.fill_documents`` of the cluster's source and seed into
    ``train.global_batch`` rows of ``model.seq_len``), kept: the pricing reads them for every set of buckets."""
    m, t = cluster.model, cluster.train
    return list(_step_documents(cluster.data, m.seq_len, cluster.file, t.seed, step, t.global_batch))


def rows_plan(plan: Candidate, rows: int, elastic: bool) -> Candidate:
    """``plan`` as a bucket runs it on ``rows`` rows (a multiple of its unit, ``bucketing.bucket_shares``' sum:
    ``bucketing.bucket_rows`` pads to it), split as the runtime splits them (``bucketing.bucket_split``): each
    pipeline its share times the rounds; elastic, in that many more microbatches of the rows per microbatch the
    plan was checked for; fixed, in its own microbatches."""
    _, split = bucketing.bucket_split(plan.pipelines, rows, elastic)
    pipes = tuple(PipelineChoice(size, count, p.stages) for p, (_, size, count) in zip(plan.pipelines, split))
    if all(q.batch == p.batch and q.microbatches == p.microbatches for p, q in zip(plan.pipelines, pipes)):
        return plan
    return attrs.evolve(plan, pipelines=pipes)


def pipe_seconds(score: Score) -> float:
    """A plan's pipelines' time in a step: its step less the gradient sync and the optimizer (a bucket runs its
    pipelines; home syncs and steps once)."""
    return score.step_time - score.sync_time - score.optimizer_time


def home_resident(cluster: Cluster, home: Candidate) -> dict[str, float]:
    """device -> the bytes home keeps there whatever layout runs: its weights and gradients (float32) and its
    optimizer moments (ZeRO-1: their share)."""
    mm = MemoryModel(cluster)
    moments = mm.moments(home)
    out = {}
    for p, pipe in enumerate(home.pipelines):
        for s, st in enumerate(pipe.stages):
            params = mm.stage_params(st.group.tp, st.layers, s == 0, s == len(pipe.stages) - 1)
            for d in st.group.devices:
                out[d] = params * 8 + moments[p][s] * MOMENT_BYTES
    return out


class _Pricer:
    def __init__(self, cluster: Cluster, home: Candidate, home_score: Score):

        self.cluster, self.home, self.home_score = cluster, home, home_score
        self.global_batch = cluster.train.global_batch
        self.scores: dict[tuple, Score] = {}  # (plan, elastic, bound, rows, attention per row) -> its score

    def at(self, bound: int, rows: int | None = None, square: int | None = None) -> Cluster:
        """The cluster with rows of ``bound`` positions, ``rows`` of them a step (default: the global batch) and
        ``square`` positions squared of attention per row (default: the corpus', ``[plan.documents]``)."""
        c = attrs.evolve(
            self.cluster,
            model=attrs.evolve(self.cluster.model, seq_len=bound),
            train=attrs.evolve(self.cluster.train, global_batch=rows or self.global_batch),
        )
        if square is not None:  # one document length whose full rows have that square sum (documents.square_sum)
            c = attrs.evolve(c, documents=Documents(LENGTHS, (max(2, round(square / bound) + 1),), (1.0,)))
        return c

    def bucket_score(self, plan: Candidate, elastic: bool, bound: int, rows: int, square: int | None = None) -> Score:
        """``plan`` scored as a bucket runs it: on ``rows`` rows of ``bound`` positions (``rows_plan``), its
        attention ``square`` positions squared per row (None: the corpus')."""
        key = (plan, elastic, bound, rows, square)
        if key not in self.scores:
            self.scores[key] = PlannerCostModel(self.at(bound, rows, square)).score(rows_plan(plan, rows, elastic))
        return self.scores[key]

    def elastic_home(self, bound: int) -> Bucket | None:
        """Home's stages as an elastic bucket of rows up to ``bound``: each pipeline keeps its rows per microbatch
        and takes the fewest microbatches that keep home's proportions (rounded) and at least its stage count (what
        1F1B and ZB-H1 hold at most: no more activations than planned), so a step's rows pad to the sum of those
        shares, not to the global batch. Under another home schedule (GPipe, interleaved, dynamic) the bucket runs
        home's stages under 1F1B (one chunk): its in-flight microbatches bounded by the stage count. None where that
        is home itself or does not fit."""

        schedule = self.home.schedule if self.home.schedule in ("1f1b", "zbh1") else "1f1b"
        # the fewest microbatches that keep every pipeline at >= its stage count and home's proportions (rounded)
        f = max(len(p.stages) / p.microbatches for p in self.home.pipelines)
        counts = [max(len(p.stages), round(p.microbatches * f)) for p in self.home.pipelines]
        pipes = tuple(PipelineChoice(p.rows * m, m, p.stages) for p, m in zip(self.home.pipelines, counts))
        cand = attrs.evolve(self.home, pipelines=pipes, schedule=schedule, chunks=1)
        if cand == self.home or elastic_unit(cand) is None:
            return None
        score = self.bucket_score(cand, True, bound, sum(p.batch for p in pipes))
        return Bucket(bound, cand, score, "") if score.feasible else None

    def _compute(self, b: Bucket, rows: documents.PackedRows) -> float:
        """Seconds of bucket ``b``'s pipelines on its step's ``rows``: its plan (home's without one) at those rows and
        with their documents' attention (the sum of their squared lengths, per row)."""
        square = None  # [plan.documents] says attention spans the whole row (S^2): the corpus' pricing
        if not self.cluster.documents.per_row:
            square = round(float((rows.spans[:, 2].astype("float64") ** 2).sum()) / rows.num_rows)
        if b.plan is None:  # under the home layout: home's pipelines, their microbatches fixed
            return pipe_seconds(self.bucket_score(self.home, False, b.max_len, rows.num_rows, square))
        unit = elastic_unit(b.plan)  # the written bucket's shares (planner/output.bucket_specs)
        shares = attrs.evolve(
            b.plan,
            pipelines=tuple(
                PipelineChoice(p.batch // (unit or 1), p.microbatches // (unit or 1), p.stages)
                for p in b.plan.pipelines
            ),
        )
        return pipe_seconds(self.bucket_score(shares, unit is not None, b.max_len, rows.num_rows, square))

    def price(self, buckets: tuple[Bucket, ...]) -> Priced:
        # the layout as written, compiled without the runtime's checks of what it runs yet (GPU devices, a
        # bucket's cp): the price is the plan's, whichever runtime trains it
        lay = planned_layout(self.cluster, self.home, buckets)
        home_plan = compile_plan(lay)
        plans = list(home_plan.buckets)
        links = self._links(lay)
        compute = switches = 0.0
        steps = max(1, min(STEPS, self.cluster.train.steps))
        for step in range(steps):
            rows_of = bucketing.bucket_rows(lay, step_documents(self.cluster, step))
            for b, rows in zip(buckets, rows_of):
                if rows is not None:
                    compute += self._compute(b, rows)
            switches += sum(s for _, _, s in step_switches(lay, home_plan, plans, rows_of, links, *self._copy()))
        copies, peak, over = self._memory(buckets)
        if not over and not math.isfinite(compute):
            over = "a bucket's microbatches at its step's rows"
        home_s = self.home_score.sync_time + self.home_score.optimizer_time
        return Priced(buckets, compute / steps, switches / steps, home_s, copies, peak, over)

    def _copy(self) -> tuple[float, float]:
        """(bytes/s of a block copy, seconds per block): on GPUs the slowest kind's achieved memory bandwidth over
        2 (a copy reads and writes each byte), else ``predict.COPY_BANDWIDTH`` (a host's, as the CPU bench
        measured it)."""
        if any(d == "cpu" for n in self.cluster.spec.nodes for d in n.devices):
            return COPY_BANDWIDTH, 0.0
        return min(n.kind.mem_bw_gbs * n.kind.mem_fraction for n in self.cluster.nodes) * 1e9 / 2, 0.0

    def _links(self, lay) -> dict[str, tuple[float, float]]:
        """The switch links: ``predict.link_costs`` (the layout's domains and cross-domain network), a node's
        link at the slowest device kind's ``link_gbps`` plus the cluster's ``p2p_latency_us``."""

        links = dict(link_costs(lay))
        slowest = min(n.kind.link_gbps for n in self.cluster.nodes)
        latency = max(NODE_LINK[0], self.cluster.limits.p2p_latency_us * 1e-6)
        links["node"] = (latency, slowest * 1e9 / 8)
        return links

    def _memory(self, buckets: tuple[Bucket, ...]) -> tuple[float, float, str]:
        """(most bucket-layout shard bytes on a device, most bytes on a device, the first device over its memory or
        ""), counted as held (module doc): one shared storage, not a copy per bucket layout."""

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
        layouts = []  # device -> its numbers, of each planned bucket layout
        for b in buckets:
            if b.plan is not None and b.score is not None:
                layouts.append(per_device(b.plan, b.score, MemoryModel(self.at(b.max_len))))
        capacity = {
            d: mm.capacity(st.group) for pipe in self.home.pipelines for st in pipe.stages for d in st.group.devices
        }
        most_copies = most = 0.0
        over = ""
        for d, (params, moments, act) in home.items():
            # the one buffer a device keeps for the bucket layouts with a plan of their own (the runtime's
            # Switcher.storage: a layout whose shards equal home's there gets its views too, not home's tensors)
            own = [lay[d][0] for lay in layouts if d in lay]
            copies = max(own, default=0.0) * FLOAT32_BYTES
            resident = params * 8 + moments * MOMENT_BYTES  # home's weights, gradients, moments
            # the buffer is allocated once (the runtime's Switcher.storage) and held while home runs too; a bucket
            # layout runs beside it, with its gradients and activations
            running = [copies + act] + [copies + lay[d][0] * FLOAT32_BYTES + lay[d][2] for lay in layouts if d in lay]
            peak = resident + max(running)
            most_copies, most = max(most_copies, copies), max(most, peak)
            if peak > capacity[d] and not over:
                over = f"{d}: {peak / 1e9:.3g} GB of {capacity[d] / 1e9:.3g}"
        return most_copies, most, over
