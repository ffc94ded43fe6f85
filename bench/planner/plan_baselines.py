"""Baseline planners for bench/planner/plan_bench.py, each returning candidates our cost model scores.

- ``hexiscale``: a re-implementation of HexiScale's planner as its public code (Relaxed-System-Lab/FlashFlex,
  ``experimental/``) does it: METIS
  (pymetis) splits the GPUs into pipelines on a complete graph (vertex weight TFLOPS, edge weight
  1e10 / bandwidth), then each pipeline into K = 1 + Binomial(2, 0.2) stages (edge weight bandwidth);
  stages are ordered by its greedy top-3 path search (taking the *minimum*-weight path across starts,
  as its code does); each stage's GPUs are split by machine and refined with its fixed TP menu;
  layers are dealt round-robin capped by each stage's share of memory; a random walk moves the
  pipeline count by +-1 within [n/L + 1, n/5]; plans are ranked by its own cost model with its
  fudge factors (1.8 x pipeline, 1.1 x data-parallel). Batch: an equal share per pipeline, one
  sequence per microbatch (its cost model's MB = 1).
- ``metis_style``: Metis (ATC'24)-style: every replica has the same stages (the same layer
  boundaries), stage s of every pipeline on the s-th row of TP groups, layers in proportion to the
  row's slowest group; the best over TP size, pipeline count and microbatch rows by our simulator.
- hetero-place: ``hetero_llm.planner.place_seeds`` (Holmes' rules), best by our cost model.

Nothing here is copied from those projects; it follows their published design.
"""

from __future__ import annotations

import math
import random

import attrs
import pymetis

from hetero_llm.planner.candidates import Candidate, PipelineChoice, StageChoice, TPGroup
from hetero_llm.planner.cluster import Cluster
from hetero_llm.planner.cost import PlannerCostModel

TP_MENU = {
    1: [[1]],
    2: [[2], [1, 1]],
    3: [[2, 1], [1, 1, 1]],
    4: [[4], [2, 2], [2, 1, 1]],
    5: [[4, 1], [2, 2, 1]],
    6: [[4, 2], [2, 2, 2]],
    7: [[4, 2, 1], [2, 2, 2, 1]],
    8: [[8], [4, 4], [4, 2, 2]],
}


@attrs.frozen
class Gpu:
    node: str
    index: int
    domain: str
    kind: object  # DeviceKind


def gpus(cluster: Cluster) -> list[Gpu]:
    return [Gpu(n.name, i, n.domain, n.kind) for n in cluster.nodes for i in range(n.devices)]


def bandwidth(cluster: Cluster, a: Gpu, b: Gpu) -> float:
    """Bytes/s between two GPUs, as our cost model sees the links (HexiScale takes one inter_bw)."""
    net = cluster.network
    if a.node == b.node:
        return min(a.kind.link_gbps, b.kind.link_gbps) * 1e9 / 8
    if a.domain == b.domain:
        return dict(net.domain_bw)[a.domain]
    return net.cross_bw


def _metis(members: list[int], parts: int, vw, ew) -> list[list[int]]:
    """Partition a complete graph on ``members`` into ``parts`` with METIS; empty parts are dropped."""
    if parts <= 1 or len(members) <= 1:
        return [members]
    parts = min(parts, len(members))
    xadj, adjncy, eweights = [0], [], []
    for i, a in enumerate(members):
        for j, b in enumerate(members):
            if i != j:
                adjncy.append(j)
                eweights.append(max(1, int(ew(a, b))))
        xadj.append(len(adjncy))
    opts = pymetis.Options(contig=True, seed=0)
    _, labels = pymetis.part_graph(
        parts, xadj=xadj, adjncy=adjncy, vweights=[max(1, int(vw(a))) for a in members], eweights=eweights, options=opts
    )
    out = [[m for m, lab in zip(members, labels) if lab == p] for p in range(parts)]
    return [p for p in out if p]


class HexiScale:
    """One seed of HexiScale's planner."""

    def __init__(self, cluster: Cluster, seed: int, niter: int = 20):
        self.c, self.rng, self.niter = cluster, random.Random(seed), niter
        self.g = gpus(cluster)
        m = cluster.model
        self.H, self.S, self.V, self.L = m.hidden, m.seq_len, m.vocab, m.layers
        self.B = 2  # their bytes per element
        self.bw = {}

    def bw_of(self, i: int, j: int) -> float:
        key = (i, j) if i < j else (j, i)
        if key not in self.bw:
            self.bw[key] = bandwidth(self.c, self.g[i], self.g[j])
        return self.bw[key]

    # ---------------------------------------------------------------- their cost model (fudge factors included)
    def stage_cost(self, devs: list[int], layers: int) -> float:
        H, S, V, L = self.H, self.S, self.V, self.L
        tp = len(devs)
        tflops = min(self.g[d].kind.tflops for d in devs)
        comp = 72 * S * H * H * (1 + S / (6 * H) + V / (16 * L * H)) / (tflops * 2**40 * tp)
        tpc = 0.0
        if tp > 1:
            tpc = 8 * max(sum(S * H * self.B / (tp * self.bw_of(i, j)) for j in devs if j != i) for i in devs)
        return layers * (comp + tpc)

    def pp_cost(self, pre: list[int], post: list[int]) -> float:
        a = self.S * self.H * self.B
        best = min(a / self.bw_of(p, q) for p in pre for q in post)
        bcast = sum(a / (len(post) * self.bw_of(post[0], q)) for q in post[1:])
        return 2 * (best + bcast)

    def pipeline_cost(self, stages: list[list[int]], layers: list[int], n_mb: int) -> float:
        k = len(stages)
        costs = [
            self.stage_cost(s, l) + (self.pp_cost(s, stages[i + 1]) if i + 1 < k else 0.0)
            for i, (s, l) in enumerate(zip(stages, layers))
        ]
        return sum(max(costs[s] for s in range(k) if 0 <= col - s < n_mb) for col in range(n_mb + k - 1))

    def dp_cost(self, plan: list[tuple[list[list[int]], list[int]]]) -> float:
        holders: list[list[list[int]]] = [[] for _ in range(self.L)]
        for stages, layers in plan:
            lo = 0
            for s, n in zip(stages, layers):
                for layer in range(lo, lo + n):
                    holders[layer].append(s)
                lo += n
        total = 0.0
        for sets in holders:
            if len(sets) < 2:
                continue
            min_tp = min(len(s) for s in sets)
            firsts = [s[0] for s in sets]
            total += 2 * max(
                sum(12 * self.H**2 * self.B / (min_tp * len(sets) * self.bw_of(i, j)) for j in firsts if j != i)
                for i in firsts
            )
        return total

    def memory_ok(self, devs: list[int], layers: int, first: bool, last: bool) -> bool:
        H, S, V, B = self.H, self.S, self.V, self.B
        tp = len(devs)
        params = (layers * 12 * H * H / tp + (H + V * H if last else 0) + (H * (V + S) if first else 0)) * B * 4
        acts = (layers * S * H / tp + 2 * S * H) * B
        return params + acts <= sum(self.g[d].kind.memory_gb for d in devs) * 1e9 / tp

    # ---------------------------------------------------------------- the phases
    def phase1(self, P: int) -> list[list[int]]:
        # their edge weight 1e10 / bandwidth, scaled to 1e4 / (GB/s) so METIS's 32-bit sums cannot overflow
        return _metis(
            list(range(len(self.g))),
            P,
            lambda a: self.g[a].kind.tflops * 10,
            lambda a, b: 1e4 / (self.bw_of(a, b) / 1e9),
        )

    def phase2(self, pipe: list[int]) -> list[list[int]]:
        k = 1 + sum(self.rng.random() < 0.2 for _ in range(2))
        return _metis(pipe, k, lambda a: self.g[a].kind.tflops * 10, lambda a, b: self.bw_of(a, b) / 1e9)

    def order(self, stages: list[list[int]], kway: int = 3) -> list[list[int]]:
        k = len(stages)
        if k <= 1:
            return stages
        w = [
            [sum(self.bw_of(a, b) for a in stages[i] for b in stages[j]) if i != j else 0.0 for j in range(k)]
            for i in range(k)
        ]
        best_per_start = []
        for start in range(k):
            best = (-1.0, [start])

            def walk(path, weight):
                nonlocal best
                if len(path) == k:
                    if weight > best[0]:
                        best = (weight, path)
                    return
                cands = sorted((j for j in range(k) if j not in path), key=lambda j: -w[path[-1]][j])[:kway]
                for j in cands:
                    walk(path + [j], weight + w[path[-1]][j])

            walk([start], 0.0)
            best_per_start.append(best)
        weight, path = sorted(best_per_start, key=lambda x: x[0])[0]  # their argsort(cum_weight)[0]: the minimum
        return [stages[i] for i in path]

    def refine(self, stages: list[list[int]], n_mb: int) -> list[list[int]]:
        """Split every stage's GPUs by machine; each machine's GPUs into the TP menu entry that costs least."""
        out: list[list[int]] = []
        for stage in stages:
            by_node: dict[str, list[int]] = {}
            for d in stage:
                by_node.setdefault(self.g[d].node, []).append(d)
            for devs in by_node.values():
                while devs:
                    chunk, devs = devs[:8], devs[8:]
                    best = None
                    for option in TP_MENU[len(chunk)]:
                        subs, lo = [], 0
                        for t in option:
                            subs.append(chunk[lo : lo + t])
                            lo += t
                        share = max(1, self.L // max(1, len(stages) * len(option)))
                        cost = self.pipeline_cost(subs, [share] * len(subs), n_mb)
                        if best is None or cost < best[0]:
                            best = (cost, subs)
                    out += best[1]
        return out

    def layers(self, stages: list[list[int]]) -> list[int] | None:
        mem = [sum(self.g[d].kind.memory_gb for d in s) for s in stages]
        total = sum(mem)
        quota = [0] * len(stages)
        left, i, stuck = self.L, 0, 0
        while left:
            if (quota[i] + 1) / self.L <= mem[i] / total or stuck >= len(stages):
                quota[i] += 1
                left -= 1
                stuck = 0
            else:
                stuck += 1
            i = (i + 1) % len(stages)
        if 0 in quota:
            return None
        return quota

    def build(self, P: int):
        plan = []
        share = self.c.train.global_batch // P
        for pipe in self.phase1(P):
            stages = self.order(self.phase2(pipe))
            stages = self.refine(stages, share)
            if len(stages) > self.L:
                return None
            layers = self.layers(stages)
            if layers is None:
                return None
            plan.append((stages, layers))
        return plan

    def total_time(self, plan) -> float:
        share = self.c.train.global_batch // len(plan)
        pp = max(self.pipeline_cost(s, l, share) for s, l in plan)
        return 1.8 * pp + 1.1 * self.dp_cost(plan)

    def run(self):
        n = len(self.g)
        lo = n // self.L + 1
        hi = max(lo, n // 5)
        P = self.rng.randint(lo, hi)
        best = None
        for _ in range(self.niter):
            P = min(max(P, lo), hi, self.c.train.global_batch)
            plan = self.build(P)
            if plan is not None:
                oom = any(
                    not self.memory_ok(s, l, i == 0, i == len(st) - 1)
                    for st, ls in plan
                    for i, (s, l) in enumerate(zip(st, ls))
                )
                t = self.total_time(plan) if not oom else math.inf
                if best is None or t < best[0]:
                    best = (t, plan)
            P += self.rng.choice((-1, 1))
        return None if best is None else best[1]


def to_candidate(cluster: Cluster, cost: PlannerCostModel, plan, g: list[Gpu]) -> Candidate | None:
    """A HexiScale plan as our candidate: equal batch shares, one sequence per microbatch, 1F1B (better on
    memory than its default GPipe); stages that do not fit recompute, as its alpha = 96 variant does."""
    G = cluster.train.global_batch
    P = len(plan)
    shares = [G // P + (i < G % P) for i in range(P)]
    pipes = []
    for (stages, layers), batch in zip(plan, shares):
        st = []
        for s, l in zip(stages, layers):
            gp = g[s[0]]
            node = cluster.node(gp.node)
            st.append(
                StageChoice(TPGroup(gp.node, gp.domain, tuple(f"{g[d].node}:{g[d].index}" for d in s), node.kind), l)
            )
        pipes.append(PipelineChoice(batch, batch, tuple(st)))
    cand = Candidate(tuple(pipes), "1f1b", 1)
    if not cost.score(cand).feasible:
        cand = attrs.evolve(
            cand,
            pipelines=tuple(
                attrs.evolve(p, stages=tuple(attrs.evolve(s, recompute=True) for s in p.stages)) for p in pipes
            ),
        )
    return cand


def hexiscale(cluster: Cluster, cost: PlannerCostModel, seed: int) -> Candidate | None:
    hs = HexiScale(cluster, seed)
    plan = hs.run()
    return None if plan is None else to_candidate(cluster, cost, plan, hs.g)


def metis_style(cluster: Cluster, cost: PlannerCostModel, planner) -> tuple[Candidate, object] | None:
    """Same stages in every replica; layers by the slowest group of each stage row; best by our cost model."""
    best = None
    G, L = cluster.train.global_batch, cluster.model.layers
    for tp in sorted({t for n in cluster.nodes for t in planner.tp_sizes(n.devices)}):
        groups = list(planner.order(planner.groups({n.kind.name: tp for n in cluster.nodes})))
        for P in range(1, len(groups) + 1):
            if len(groups) % P or G < P:
                continue
            S = len(groups) // P
            if S > L:
                continue
            rows = [groups[s * P : (s + 1) * P] for s in range(S)]
            speed = [min(g.flops for g in row) for row in rows]
            raw = [L * v / sum(speed) for v in speed]
            layers = [max(1, int(x)) for x in raw]
            while sum(layers) > L:
                i = max(range(S), key=lambda i: (layers[i] - raw[i], i))
                layers[i] -= 1
            while sum(layers) < L:
                i = max(range(S), key=lambda i: (raw[i] - layers[i], -i))
                layers[i] += 1
            if 0 in layers:
                continue
            shares = [G // P + (i < G % P) for i in range(P)]
            for mb_rows in (1, 2, 4):
                if any(b % mb_rows for b in shares):
                    continue
                for rc in (False, True):
                    pipes = tuple(
                        PipelineChoice(b, b // mb_rows, tuple(StageChoice(rows[s][p], layers[s], rc) for s in range(S)))
                        for p, b in enumerate(shares)
                    )
                    cand = Candidate(pipes, "1f1b", 1)
                    sc = cost.score(cand)
                    if sc.feasible:
                        if best is None or sc.step_time < best[1].step_time:
                            best = (cand, sc)
                        break
    return best
