"""The search: from a cluster to the layout with the least predicted step time. Torch-free, deterministic.

A candidate is built from a *structure* (which TP groups form which pipeline, in which stage order,
how many rows per microbatch, which schedule) by two exact steps:

1. layers (``layers``): two dynamic programs over contiguous splits give each pipeline its front of splits
   (the min-max split, whose slowest stage is fastest, then splits of less sum under every bound on a stage's
   time), every stage inside its memory (a stage that does not fit without recompute may recompute);
2. batch: microbatches go one at a time to the pipeline whose 1F1B time grows least (exact for
   this min-max of increasing costs), first with the min-max splits; then each pipeline takes the split of its
   front whose step at its share is shortest (``layers.pick``: closed form, confirmed by the simulator) and the
   batch is split again, until the picks hold (three rounds at most).

Structures come from a sweep over TP sizes per device kind, pipeline counts and two ways of
dealing TP groups to pipelines (contiguous per domain, as Holmes; or speed-balanced per domain), pruned
by the compute lower bound and ranked by a closed-form 1F1B estimate. The best few, plus
``hetero-place``'s plan, are scored with the simulator under every allowed schedule and improved by
local search (move or swap TP groups between pipelines, split or merge TP groups, pipelines +-1,
microbatch rows x2 or /2 or to the next divisor of the batch, another schedule with other rows at once, a
pipeline's first or last stages left idle at once). The best candidate's layer splits are then polished against the
simulated step itself (``polish``). The result is the best candidate ever scored, so never worse than the seed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import overload

import attrs

from hetero_llm.planner import exact, move_parts, moves, polish, sweep
from hetero_llm.planner.candidates import ByIdentity, Candidate, PipelineChoice, Score, StageChoice, TPGroup
from hetero_llm.planner.cluster import Cluster
from hetero_llm.planner.cost import PlannerCostModel
from hetero_llm.planner.layers import INF, LayerSplitter, StageTimes
from hetero_llm.planner.memory import ONE_IN_FLIGHT
from hetero_llm.planner.shares import batch_shares
from hetero_llm.planner.structure import Result, Structure
from hetero_llm.progress import Bar

PICK_MAX_DEVICES = 256  # the largest cluster whose every realized structure picks its splits from their fronts


class Planner(LayerSplitter):
    def __init__(self, cluster: Cluster, *, budget_s: float | None = None, max_evals: int | None = None):
        super().__init__(PlannerCostModel(cluster), cluster.model.layers)
        self.cluster = cluster
        self.model = cluster.model
        self.global_batch = cluster.train.global_batch
        self.limits = cluster.limits
        self.budget = cluster.limits.time_budget_s if budget_s is None else budget_s  # a safety net only
        # the budget, in work (so the plan is a function of the input only): candidates simulated (on generated
        # 16-GPU clusters more found nothing better; bigger clusters get more, up to 2500) and structures swept
        auto = min(400 + 8 * cluster.num_devices, 2500)
        self.max_evals = (cluster.limits.max_evals or auto) if max_evals is None else max_evals
        self.sweep_limit = max(20_000, 8 * self.max_evals)
        # every realized structure picks its pipelines' splits from their fronts (``layers.pick``) up to this many
        # devices; above, the min-max split (the pick's simulations made a 1,024-GPU search 6.6x slower: 226 s of
        # CPU against 34 s), and only the best plan's splits are polished against the step (``polish``)
        self.pick_splits = cluster.num_devices <= PICK_MAX_DEVICES
        self.cut_by_time = False
        self.progress: Bar | None = None  # plans simulated and the best so far, on a terminal (hetero-plan)
        self.best_so_far = INF
        self.domain_order = {d.name: i for i, d in enumerate(cluster.spec.domains)}
        self.node_order = {n.name: i for i, n in enumerate(cluster.nodes)}
        self.scored: dict[tuple, tuple[Candidate, Score]] = {}
        self.realized: dict[tuple, Candidate | None] = {}
        self._made: dict[tuple[str, int, int], TPGroup] = {}  # groups(): (node, first device, TP size) -> group
        self._reshaped: dict[tuple, TPGroup] = {}  # reshape(): (devices, CP size) -> group
        self._times_of = ByIdentity()  # by the candidates _realize made: their pipelines' StageTimes
        self._key_parts = ByIdentity()  # cand_key's, by a pipeline's stages' tuple
        self._busy_memo: dict[tuple, float] = {}
        self.start = time.perf_counter()

    # ---------------------------------------------------------------- TP groups
    def tp_sizes(self, devices: int) -> list[int]:
        cap = self.limits.max_tp or devices
        return [
            t for t in range(1, min(cap, devices) + 1) if self.model.heads % t == 0 and self.model.ffn_width % t == 0
        ]

    def cp_sizes(self, devices: int) -> list[int]:
        """The CP sizes a group of ``devices`` devices can take (``plan.max_cp``): each dividing the devices into
        TP groups of a size ``tp_sizes`` allows, and the sequence into 2 x cp chunks (the load-balanced ring)."""
        S, top = self.model.seq_len, min(self.limits.max_cp, devices)
        cps = [c for c in range(1, top + 1) if devices % c == 0 and (c == 1 or S % (2 * c) == 0)]
        return [c for c in cps if devices // c in self.tp_sizes(devices // c)]

    def group_sizes(self, devices: int) -> list[int]:
        """Sizes of a stage's group (TP x CP) up to ``devices`` (``tp_sizes`` when plan.max_cp is 1)."""
        return [n for n in range(1, devices + 1) if self.cp_sizes(n)]

    def reshape(self, g: TPGroup, cp: int) -> TPGroup:
        """``g``'s devices as TP x ``cp`` (the same object each time it is asked for)."""
        made = g if g.cp == cp else self._reshaped.get((g.devices, cp))
        if made is None:
            made = self._reshaped[g.devices, cp] = attrs.evolve(g, cp=cp)
        return made

    def groups(self, tp_by_kind: dict[str, int]) -> list[TPGroup]:
        """Each node's devices in TP groups of its kind's size in ``tp_by_kind`` (or the largest that fits). A group
        made before is returned again, the same object: the memos keyed by groups then find it by identity."""
        out = []
        for node in self.cluster.nodes:
            want = tp_by_kind.get(node.kind.name, 1)
            left, idx = node.devices, 0
            while left:
                t = max(s for s in self.tp_sizes(left) if s <= want)
                g = self._made.get((node.name, idx, t))
                if g is None:
                    devices = tuple(f"{node.name}:{i}" for i in range(idx, idx + t))
                    g = self._made[node.name, idx, t] = TPGroup(node.name, node.domain, devices, node.kind)
                out.append(g)
                idx, left = idx + t, left - t
        return out

    def order(self, groups) -> tuple[TPGroup, ...]:
        """Stage order inside a pipeline: by domain as declared, then node, then device."""
        return tuple(
            sorted(groups, key=lambda g: (self.domain_order.get(g.domain, 0), self.node_order[g.node], g.devices))
        )

    # ---------------------------------------------------------------- exact layer split
    # ---------------------------------------------------------------- batch shares
    def realize(self, st: Structure) -> Candidate | None:
        key = st.key()
        if key not in self.realized:
            self.realized[key] = self._realize(st)
        return self.realized[key]

    def _realize(self, st: Structure) -> Candidate | None:
        devices = [d for p in st.pipelines for g in p for d in g.devices]
        if self.global_batch % st.rows or len(set(devices)) != len(devices):
            return None
        if any(g.cp != p[0].cp for p in st.pipelines for g in p):  # the layout gives a pipeline's stages one cp
            return None
        chunks = st.n_chunks
        total = self.global_batch // st.rows
        fronts, fills = [], []  # per pipeline: its splits' front (layers.front_and_fills) and their fills and times
        others = self.zero1_others(st)
        for groups, other in zip(st.pipelines, others):
            # memory is checked for as many microbatches in flight as the schedule can hold (any share)
            front, fill = self.front_and_fills(groups, st.rows, st.schedule, chunks, total, other)
            if not front:
                return None
            fronts.append(front)
            fills.append(fill)
        unit = [len(g) if st.schedule == "interleaved" and len(g) > 1 else 1 for g in st.pipelines]
        chosen = [0] * len(fronts)  # the min-max splits first, then each pipeline's best at its share, again
        counts = batch_shares([f[0][0] for f in fills], [f[0].slowest for f in fronts], unit, total)
        for _ in range(3 if self.pick_splits else 0):
            if counts is None or all(len(f) == 1 for f in fronts):
                break
            again = [self.pick(*x, st.rows, st.schedule, chunks) for x in zip(st.pipelines, fronts, fills, counts)]
            if again == chosen:
                break
            chosen = again
            sums = [f[j][0] for f, j in zip(fills, chosen)]
            counts = batch_shares(sums, [f[j].slowest for f, j in zip(fronts, chosen)], unit, total)
        if counts is None:
            return None
        if self.cost.zero1 and not all(counts):  # fewer holders: each keeps more ZeRO-1 state
            return self._realize(attrs.evolve(st, pipelines=tuple(p for p, m in zip(st.pipelines, counts) if m)))
        pipes, times = [], []
        for groups, front, fill, j, m in zip(st.pipelines, fronts, fills, chosen, counts):
            if m == 0:
                continue
            pipes.append(PipelineChoice(m * st.rows, m, self.stage_tuple(groups, front[j].split, front[j].flags)))
            times.append(fill[j][1])
        cand = Candidate(tuple(pipes), st.schedule, chunks)
        self._times_of.put((cand,), times)
        return cand

    def _times(self, cand: Candidate) -> list[StageTimes] | None:
        """The ``StageTimes`` of ``cand``'s pipelines when this planner realized it (else None)."""
        return self._times_of.get((cand,))

    def estimate(self, cand: Candidate, cutoff: float = INF) -> float:
        """Closed-form 1F1B step time (for ranking structures before simulating). When the pipelines' compute
        alone reaches ``cutoff``, that (a lower bound of the estimate, at least ``cutoff``) is returned."""
        known = self._times(cand)
        if known is not None:  # realized here: its pipelines' stage times are known (the same sums as below)
            worst = 0.0
            for p, t in zip(cand.pipelines, known):
                worst = max(worst, t.total + (p.microbatches - 1) * t.slowest)
            if worst >= cutoff:  # sync and optimizer only add (both >= 0)
                return worst
            return worst + self.sync_and_optimizer(cand)
        worst = 0.0
        for p in cand.pipelines:
            n = len(p.stages)
            if not self.cost.zero1:
                times = [
                    self.stage_cost(s.group, s.layers, i == 0, i == n - 1, p.rows, ONE_IN_FLIGHT)[0]
                    for i, s in enumerate(p.stages)
                ]
            else:  # the stage's time as the split chose it (its ZeRO-1 memory depends on the other pipelines)
                times = [
                    sum(self.cost.stage_times(s.group, s.layers, i == n - 1, p.rows, s.recompute)[:2])
                    for i, s in enumerate(p.stages)
                ]
            worst = max(worst, sum(times) + (p.microbatches - 1) * max(times))
        if worst >= cutoff:
            return worst
        return worst + self.sync_and_optimizer(cand)

    def bound(self, cand: Candidate, cutoff: float = INF) -> float:
        """A lower bound of the simulated step: a stage's compute after the first microbatch's forward through
        the stages before it (the fill: a stage starts nothing before its first input; under interleaving the
        first chunks' share of their forwards), the slowest such stage's, + gradient sync + optimizer. When the
        compute alone reaches ``cutoff``, that (a lower bound too, at least ``cutoff``) is returned."""
        worst = 0.0
        known = self._times(cand)
        if known is not None:  # realized here: the same terms as below, kept from its layer split
            for p, t in zip(cand.pipelines, known):
                m = p.microbatches
                worst = max(worst, max(fill + m * busy for fill, busy in zip(t.before, t.busy)))
        else:
            for p in cand.pipelines:
                n, fill = len(p.stages), 0.0
                for i, s in enumerate(p.stages):
                    last = i == n - 1
                    busy = self._busy(s.group, s.layers, last, p.rows, s.recompute)
                    worst = max(worst, fill + p.microbatches * busy)
                    fill += self.cost.stage_times(s.group, s.layers, last, p.rows, s.recompute)[0] / cand.chunks
        if worst >= cutoff:  # sync and optimizer only add (both >= 0)
            return worst
        return worst + self.sync_and_optimizer(cand)

    def _busy(self, g: TPGroup, layers: int, last: bool, rows: int, recompute: bool) -> float:
        """Forward + backward seconds of one microbatch (``cost.stage_times``), memoised by kind and TP size."""
        key = (self._rep_key(g), layers, last, rows, recompute)
        t = self._busy_memo.get(key)
        if t is None:
            f, b, _, _ = self.cost.stage_times(g, layers, last, rows, recompute)
            t = self._busy_memo[key] = f + b
        return t

    def sync_and_optimizer(self, cand: Candidate) -> float:
        """Gradient sync + optimizer seconds (the cost model memoises them, under a key that holds what they
        depend on: with ``plan.grad_overlap`` the first stages' rows and recompute as well)."""
        sync, opt = self.cost.sync_and_optimizer(cand)
        return sync + opt

    # ---------------------------------------------------------------- scoring
    def cand_key(self, cand: Candidate) -> tuple:
        """``cand.key()``, each pipeline's part of it memoised by the pipeline's stages' tuple (``_realize``
        shares one between the candidates whose pipeline is the same)."""
        parts = []
        for p in cand.pipelines:
            part = self._key_parts.get((p.stages,))
            if part is None:
                part = self._key_parts.put(
                    (p.stages,), tuple((s.group.devices, s.layers, s.recompute, s.group.cp) for s in p.stages)
                )
            parts.append((p.batch, p.microbatches, part))
        return (cand.schedule, cand.chunks, cand.optimizer, tuple(parts))

    @overload
    def evaluate(self, cand: Candidate) -> Score: ...
    @overload
    def evaluate(self, cand: None) -> None: ...
    def evaluate(self, cand: Candidate | None) -> Score | None:
        if cand is None:
            return None
        key = self.cand_key(cand)
        if key not in self.scored:
            self.scored[key] = (cand, self.cost.score(cand))
            if self.progress is not None:
                self.best_so_far = min(self.best_so_far, self.scored[key][1].step_time)
                best = f"best {self.best_so_far:.4g} s" if self.best_so_far < INF else "nothing fits yet"
                self.progress.update(1, note=best)
        return self.scored[key][1]

    def out_of_time(self, fraction: float = 0.98) -> bool:
        """The safety net: past ``fraction`` of plan.time_budget_s (98% leaves time for what follows the search).
        Reaching it sets ``cut_by_time``: the plan then depends on the machine's speed, and the output says so."""
        cut = self.budget > 0 and time.perf_counter() - self.start > fraction * self.budget
        self.cut_by_time |= cut
        return cut

    def stop(self) -> bool:
        """The budget, ``max_evals`` candidates simulated, first: a search that spends it is not cut by time."""
        return len(self.scored) >= self.max_evals or self.out_of_time()

    # ---------------------------------------------------------------- local search
    def neighbours(self, st: Structure) -> Iterator[Structure]:
        """The structures one move away, made as they are taken (``moves.neighbours``)."""
        return moves.neighbours(self, st)

    @staticmethod
    def in_use(st: Structure, cand: Candidate | None) -> Structure:
        """The structure without the pipelines its candidate gave no microbatch (their groups are idle, so
        the moves that put idle groups to work see them, and merges pick among the working pipelines)."""
        if cand is None or len(cand.pipelines) == len(st.pipelines):
            return st
        return attrs.evolve(st, pipelines=tuple(tuple(s.group for s in p.stages) for p in cand.pipelines))

    def improve(self, st: Structure) -> tuple[Structure, float]:
        cand = self.realize(st)
        score = self.evaluate(cand)
        st = self.in_use(st, cand)
        best = score.step_time if score else INF
        improved = True
        while improved and not self.stop():
            improved = False
            for nb in self.neighbours(st):
                if self.stop():
                    break
                c = self.realize(nb)
                if c is None or (self.cand_key(c) not in self.scored and self.bound(c, best) >= best):
                    continue
                s = self.evaluate(c)
                if s is not None and s.step_time < best * (1 - 1e-9):
                    st, best, improved = self.in_use(nb, c), s.step_time, True
                    break
        return st, best

    def escape(self, st: Structure, best: float, width: int = 4) -> tuple[Structure, float]:
        """Leave a local optimum: descend from each of the ``width`` best neighbours; when one of those
        descents ends below ``best``, start again from there. Reaches plans two or more moves away whose
        intermediate steps are all worse (merge two pipelines, then change the schedule; split two TP groups,
        then put the idle device to work, then reorder), within the same evaluation budget."""
        tried: set[tuple] = set()
        while not self.stop():
            scored: list[tuple[float, int, Structure]] = []
            for nb in self.neighbours(st):
                if nb.key() in tried:
                    continue
                sc = self.evaluate(self.realize(nb))
                if sc is not None and sc.feasible:
                    scored.append((sc.step_time, len(scored), nb))
            scored.sort(key=lambda x: (x[0], x[1]))
            moved = False
            for _, _, alt in scored[:width]:
                if self.stop():
                    break
                tried.add(alt.key())
                end, t = self.improve(alt)
                if t < best * (1 - 1e-9):
                    st, best, moved = end, t, True
                    break
            if not moved:
                break
        return st, best

    # ---------------------------------------------------------------- the exhaustive reference (not the search)
    def all_structures(self, limit: int, subsets: bool = False) -> list[Structure] | None:
        """Every structure of the space (of every device subset with ``subsets``), or None when there are more
        than ``limit`` (see ``exact``): the reference the search is measured against."""
        return exact.all_structures(self, limit, subsets)

    def exact(self, structures: list[Structure]) -> None:
        """Score every structure whose lower bound beats the best so far (the reference's optimum)."""
        best = min((s.step_time for _, s in self.scored.values()), default=INF)
        for st in structures:
            if self.out_of_time(0.4):  # the safety net (a huge batch makes every simulation long)
                break
            cand = self.realize(st)
            if cand is None or self.bound(cand, best) >= best:
                continue
            best = min(best, self.evaluate(cand).step_time)
        polish.polish_best(self, 5)  # the reference's best layer splits against the step itself, as the search's

    # ---------------------------------------------------------------- driver
    def run(self, seeds: Sequence[Candidate] = (), top: int = 5, swept: bool = True) -> Result:
        """The search from the sweep's best structures (unless not ``swept``) and ``seeds``."""
        structures = sweep.sweep(self, keep=8) if swept else []
        structures += move_parts.with_cp(self, structures)
        seed_score = None
        for s in seeds:
            seed_sc = self.evaluate(s)
            seed_score = seed_sc if seed_score is None or seed_sc.step_time < seed_score.step_time else seed_score
            structures.append(
                Structure(tuple(tuple(x.group for x in p.stages) for p in s.pipelines), max(1, s.pipelines[0].rows))
            )
        starts: list[tuple[float, int, Structure]] = []
        for st in structures:
            for sched in self.limits.schedules:
                alt = attrs.evolve(st, schedule=sched)
                sc = self.evaluate(self.realize(alt))
                if sc is not None:
                    starts.append((sc.step_time, len(starts), alt))
        starts.sort(key=lambda x: (x[0], x[1]))
        found = []
        for _, _, st in starts[:8]:
            if self.stop():
                break
            found.append(self.improve(st))
        if found:
            here, t_here = min(found, key=lambda sb: sb[1])
            width = 4
            while not self.stop() and width <= 64:  # budget left: look further around the best (wider escapes)
                here, t = self.escape(here, t_here, width)
                width = 4 if t < t_here else width * 2
                t_here = t
        polish.polish_best(self, 1)  # the best plan's layer splits against the step itself (polish.py)
        ranked = sorted(self.scored.values(), key=lambda cs: (cs[1].step_time, cs[0].key()))
        if not ranked or not ranked[0][1].feasible:
            raise sweep.infeasible_error(self.cluster, self.cost, self.closest())
        best, score = ranked[0]
        distinct: list[tuple[Candidate, Score]] = []
        shapes: set[tuple] = set()
        for cand, sc in ranked:  # plans that differ only in which of interchangeable devices they use: once
            shape = cand.shape()
            if sc.feasible and shape not in shapes and len(distinct) < max(1, top):
                shapes.add(shape)
                distinct.append((cand, sc))
        elapsed = time.perf_counter() - self.start
        return Result(best, score, tuple(distinct), len(self.scored), elapsed, seed_score, self.cut_by_time)

    def closest(self) -> Candidate:
        """When nothing fits: the candidate least over memory, among those scored and the most frugal one
        (every device in one pipeline at its node's largest TP size, one sequence per microbatch, recompute,
        layers in proportion to memory)."""
        groups = self.order(self.groups({n.kind.name: n.devices for n in self.cluster.nodes}))[: self.L]
        room = [self.cost.capacity(g) * g.tp for g in groups]
        layers = [1] * len(groups)
        for _ in range(self.L - len(groups)):
            i = max(range(len(groups)), key=lambda i: (room[i] / (layers[i] + 1), -i))
            layers[i] += 1
        stages = tuple(StageChoice(g, l, True) for g, l in zip(groups, layers))
        frugal = Candidate((PipelineChoice(self.global_batch, self.global_batch, stages),))
        pool = [frugal] + [c for c, _ in self.scored.values()]

        def over(cand: Candidate) -> float:
            mems, caps = self.cost.memory(cand)
            return max(m / c for ms, cs in zip(mems, caps) for m, c in zip(ms, cs))

        return min(pool, key=over)
