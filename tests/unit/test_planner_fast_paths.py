"""The planner's fast paths against the plain code they replaced, on random inputs: the vectorised gradient sync
and ZeRO-1 moments (planner/spans.py) bit for bit, the sweep's prepared dealing of TP groups to pipelines
(sweep.Dealer) group for group. The search ranks plans by these floats and structures, so the same input must
give the same plan. Torch-free."""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter
from pathlib import Path

import attrs
import pytest

from hetero_llm.layout import Optimizer
from hetero_llm.planner import moves
from hetero_llm.planner.candidates import Candidate, PipelineChoice, StageChoice, TPGroup
from hetero_llm.planner.catalogue import DDP_BUCKET_BYTES
from hetero_llm.planner.cluster import load_cluster
from hetero_llm.planner.cost import OPTIMIZER_BYTES, PlannerCostModel
from hetero_llm.planner.search import Planner
from hetero_llm.planner.spans import Spans
from hetero_llm.planner.structure import Structure
from hetero_llm.planner.sweep import Dealer, tp_menus

CLUSTERS = Path(__file__).resolve().parents[2] / "layouts" / "clusters"


def loop_grad_sync_time(m: PlannerCostModel, cand: Candidate) -> float:
    """cost.grad_sync_time as a loop over spans and holders (before planner/spans.py)."""
    P = len(cand.pipelines)
    if P == 1:
        return 0.0
    boundaries = {0, m.L}
    for pipe in cand.pipelines:
        lo = 0
        for s in pipe.stages:
            lo += s.layers
            boundaries.add(lo)
    cuts = sorted(boundaries)
    owner: list[list[TPGroup]] = [[] for _ in cuts[:-1]]
    for pipe in cand.pipelines:
        seg, hi = 0, 0
        for s in pipe.stages:
            hi += s.layers
            while seg < len(cuts) - 1 and cuts[seg + 1] <= hi:
                owner[seg].append(s.group)
                seg += 1
    ring = 2 * (P - 1) / P
    per_rank = {}
    nic: dict[str, float] = {}
    users: dict[str, set[str]] = {}
    intra: dict[str, float] = {}
    held: dict[str, float] = {}
    cross = False
    for (lo, hi), groups in zip(zip(cuts, cuts[1:]), owner):
        nodes = {g.node for g in groups}
        domains = {g.domain for g in groups}
        cross |= len(domains) > 1
        local = Counter(g.node for g in groups) if not m.gloo else None
        for g in groups:
            t = len(g.devices)
            if t not in per_rank:
                per_rank[t] = sum(m.layer_params(t))
            extra = (m.embed_params(t) if lo == 0 else 0) + (m.head_params(t) if hi == m.L else 0)
            shard = (per_rank[t] * (hi - lo) + extra) * m.grad_bytes
            held[g.devices[0]] = held.get(g.devices[0], 0.0) + shard
            nbytes = ring * shard
            if len(nodes) == 1:
                intra[g.node] = intra.get(g.node, 0.0) + nbytes / m.intra_bw(g)
            else:
                bw = m.domain_bw[g.domain] if len(domains) == 1 else m.cross_bw
                share = nbytes * t / bw
                nic[g.node] = nic.get(g.node, 0.0) + (share / local[g.node] if local else share)
                users.setdefault(g.node, set()).update(g.devices)
    busiest = [v / min(m.nics.get(n, 1), len(users[n])) for n, v in nic.items()]
    lat = (m.cluster.network.cross_latency if cross else max(m.domain_lat.values())) + m.p2p_latency
    buckets = len({tuple(id(g) for g in groups) for groups in owner})
    sync = max(busiest + list(intra.values()) + [0.0]) + buckets * 2 * (P - 1) * lat
    if not m.grad_overlap:
        return sync
    window = min(
        m.stage_times(p.stages[0].group, p.stages[0].layers, len(p.stages) == 1, p.rows, p.stages[0].recompute)[1]
        for p in cand.pipelines
    )
    tail = sync * min(1.0, DDP_BUCKET_BYTES / max(held.values()))
    return max(sync - window, tail)


def loop_moments(m: PlannerCostModel, cand: Candidate) -> tuple[tuple[float, ...], ...]:
    """memory.moments as a loop over spans and holders (before planner/spans.py)."""
    if not m.zero1:
        return tuple(
            tuple(m.stage_params(s.group.tp, s.layers, i == 0, i == len(p.stages) - 1) for i, s in enumerate(p.stages))
            for p in cand.pipelines
        )
    spans: list[list[tuple[int, int, int]]] = [[] for _ in cand.pipelines]
    boundaries = {0, m.L}
    for pi, pipe in enumerate(cand.pipelines):
        lo = 0
        for si, s in enumerate(pipe.stages):
            spans[pi].append((lo, lo + s.layers, si))
            lo += s.layers
            boundaries.add(lo)
    cuts = sorted(boundaries)
    out = [[0.0] * len(p.stages) for p in cand.pipelines]

    def share(holders: list[tuple[int, int]], elements: float) -> None:
        groups = [cand.pipelines[pi].stages[si].group for pi, si in holders]
        mems = [m.node_memory.get(g.node, 0.0) for g in groups]
        if not all(x > 0 for x in mems):
            mems = [1.0] * len(groups)
        total = sum(g.tp * x for g, x in zip(groups, mems))
        for (pi, si), x in zip(holders, mems):
            out[pi][si] += elements * x / total

    layer = sum(m.layer_params(1))
    for lo, hi in zip(cuts, cuts[1:]):
        holders = [next((pi, si) for a, b, si in spans[pi] if a <= lo < b) for pi in range(len(cand.pipelines))]
        share(holders, layer * (hi - lo))
    share([(pi, 0) for pi in range(len(cand.pipelines))], m.embed_params())
    share([(pi, len(p.stages) - 1) for pi, p in enumerate(cand.pipelines)], m.head_params())
    return tuple(tuple(x) for x in out)


def loop_optimizer_time(m: PlannerCostModel, cand: Candidate) -> float:
    worst = 0.0
    for pipe, moments in zip(cand.pipelines, loop_moments(m, cand)):
        for s, n in zip(pipe.stages, moments):
            bw = s.group.kind.mem_bw_gbs * s.group.kind.mem_fraction * 1e9
            worst = max(worst, n * OPTIMIZER_BYTES / bw)
    return worst


def random_candidate(rng: random.Random, planner: Planner) -> Candidate:
    """TP groups of a random menu, a random subset dealt into random pipelines, random layer splits."""
    L = planner.L
    kinds = sorted({n.kind.name for n in planner.cluster.nodes})
    menu = {k: rng.choice(planner.tp_sizes(8)) for k in kinds}
    groups = planner.groups(menu)
    rng.shuffle(groups)
    groups = groups[: rng.randint(1, min(len(groups), 4 * L))]
    P = rng.randint(1, min(len(groups), 40))
    pipes: list[list[TPGroup]] = [[] for _ in range(P)]
    for i, g in enumerate(groups):
        pipes[i if i < P else rng.randrange(P)].append(g)
    out = []
    for gs in pipes:
        gs = gs[:L]
        cuts = sorted(rng.sample(range(1, L), len(gs) - 1))
        layers = [b - a for a, b in zip([0, *cuts], [*cuts, L])]
        mb = rng.randint(1, 4)
        stages = tuple(StageChoice(g, n, rng.random() < 0.2) for g, n in zip(gs, layers))
        out.append(PipelineChoice(mb * rng.randint(1, 3), mb, stages))
    return Candidate(tuple(out))


@pytest.mark.parametrize("name", ["mixed_1024gpu", "holmes_64gpu", "hexiscale_40gpu", "two_domains"])
@pytest.mark.parametrize("zero1", [False, True])
def test_vectorised_sync_and_moments_equal_the_loops_bit_for_bit(name, zero1):
    cluster = load_cluster(CLUSTERS / f"{name}.toml")
    if zero1:
        cluster = attrs.evolve(cluster, train=attrs.evolve(cluster.train, optimizer=Optimizer.ADAMW_ZERO1))
    planner = Planner(cluster)
    rng = random.Random(f"{name}{zero1}")
    for trial in range(60):
        cand = random_candidate(rng, planner)
        # the branches the clusters' own settings do not reach: nodes with and without memory_gb (ZeRO-1's
        # weights), several NICs, the overlapped sync (a fresh model: it memoises what it derives from them)
        m = PlannerCostModel(cluster)
        m.node_memory = {n.name: rng.choice([0.0, 80.0, 40.0, 24.0]) for n in cluster.nodes}
        if trial % 3 == 0:
            m.node_memory = {n.name: rng.choice([80.0, 40.0, 24.0]) for n in cluster.nodes}
        m.nics = {n.name: rng.choice([1, 2, 8]) for n in cluster.nodes}
        m.grad_overlap = trial % 4 == 1
        spans = m.spans(cand)
        assert m.grad_sync_time(cand, spans) == loop_grad_sync_time(m, cand)
        assert m.grad_sync_time(cand) == loop_grad_sync_time(m, cand)
        assert m.moments(cand) == loop_moments(m, cand)
        assert m.optimizer_time(cand, spans) == loop_optimizer_time(m, cand)


def test_spans_refuse_a_pipeline_without_every_layer():
    planner = Planner(load_cluster(CLUSTERS / "two_domains.toml"))
    g = planner.groups({})[0]
    cand = Candidate((PipelineChoice(1, 1, (StageChoice(g, planner.L - 1),)),))
    with pytest.raises(ValueError, match="does not hold the model's"):
        Spans.of(cand, planner.L, planner.cost.pipeline_rows)


def loop_deal(planner: Planner, groups: list[TPGroup], P: int, balanced: bool) -> tuple[tuple[TPGroup, ...], ...]:
    """sweep's dealing as it was (before sweep.Dealer): per call, on the groups themselves."""
    pipes: list[list[TPGroup]] = [[] for _ in range(P)]
    load = [0.0] * P
    by_domain: dict[str, list[TPGroup]] = {}
    for g in groups:
        by_domain.setdefault(g.domain, []).append(g)
    for d in sorted(by_domain, key=lambda d: planner.domain_order.get(d, 0)):
        gs = by_domain[d]
        if balanced:
            least = [(load[i], i) for i in range(P)]
            heapq.heapify(least)
            for g in sorted(gs, key=lambda g: (-g.flops, planner.node_order[g.node], g.devices)):
                _, i = heapq.heappop(least)
                pipes[i].append(g)
                load[i] += g.flops
                heapq.heappush(least, (load[i], i))
        else:
            base, extra = divmod(len(gs), P)
            lo = 0
            for rank, i in enumerate(sorted(range(P), key=lambda i: (load[i], i))):
                n = base + (rank < extra)
                pipes[i] += gs[lo : lo + n]
                load[i] += sum(g.flops for g in gs[lo : lo + n])
                lo += n
    position = {g: i for i, g in enumerate(planner.order(groups))}
    return tuple(tuple(sorted(p, key=position.__getitem__)) for p in pipes if p)


@pytest.mark.parametrize("name", ["mixed_1024gpu", "holmes_64gpu", "hexiscale_40gpu"])
def test_prepared_dealing_equals_the_plain_deal(name):
    planner = Planner(load_cluster(CLUSTERS / f"{name}.toml"))
    rng = random.Random(name)
    menus = tp_menus(planner)
    for _ in range(12):
        groups = planner.groups(rng.choice(menus))
        groups = rng.sample(groups, rng.randint(1, len(groups)))  # any subset, in any order
        dealer = Dealer(planner, groups)
        for P in rng.sample(range(1, len(groups) + 3), min(6, len(groups) + 2)):
            for balanced in (False, True):
                assert dealer.deal(P, balanced) == loop_deal(planner, groups, P, balanced)


@pytest.mark.parametrize("name", ["mixed_1024gpu", "holmes_64gpu", "hexiscale_40gpu"])
@pytest.mark.parametrize("zero1", [False, True])
def test_estimate_and_bound_from_the_realized_splits_equal_those_from_the_stages(name, zero1):
    """search.estimate and search.bound of a candidate the planner realized (its stage times kept from the layer
    split) against the same candidate as a new object (priced stage by stage); the cost model's memos."""
    cluster = load_cluster(CLUSTERS / f"{name}.toml")
    if zero1:
        cluster = attrs.evolve(cluster, train=attrs.evolve(cluster.train, optimizer=Optimizer.ADAMW_ZERO1))
    planner = Planner(cluster)
    rng = random.Random(name)
    menus = tp_menus(planner)
    checked = tries = 0
    while checked < 12 and tries < 400:
        tries += 1
        groups = planner.groups(rng.choice(menus))
        groups = rng.sample(groups, rng.randint(1, len(groups)))
        pipes = Dealer(planner, groups).deal(rng.randint(1, len(groups)), rng.random() < 0.5)
        rows = rng.choice([d for d in range(1, 9) if planner.global_batch % d == 0])
        cand = planner.realize(Structure(pipes, rows, rng.choice(["1f1b", "zbh1", "gpipe"])))
        if cand is None:
            continue
        checked += 1
        copy = attrs.evolve(cand)
        assert planner.estimate(cand) == planner.estimate(copy)
        bound = planner.bound(copy)
        assert planner.bound(cand) == bound
        for cutoff in (bound / 2, bound * 0.999, bound * 2):  # compute alone may reach the cutoff
            assert planner.bound(cand, cutoff) == planner.bound(copy, cutoff)
        assert planner.cand_key(cand) == planner.cand_key(copy) == cand.key()  # memoised by the stages' tuples
        plain = (loop_grad_sync_time(planner.cost, cand), loop_optimizer_time(planner.cost, cand))
        for c in (cand, copy, cand):  # memoised by the stages' tuples, then by what they hold
            assert planner.cost.sync_and_optimizer(c) == plain
        for p in cand.pipelines:  # the memoised pipeline times (the second call finds the first's)
            for _ in range(2):
                assert planner.cost.pipeline_time(p, cand.schedule, cand.chunks) == planner.cost._pipeline_time(
                    p, cand.schedule, cand.chunks
                )
    assert checked == 12


@pytest.mark.parametrize("name", ["holmes_64gpu", "hexiscale_40gpu", "small_cpu"])
def test_neighbours_are_made_as_taken_each_once(name):
    """moves.neighbours keys a move by its unchanged pipelines' parts, built once (Structure.key of the new
    structure): every structure it yields is distinct by Structure.key; and it yields them as they are made, so
    stopping early (the search takes the first better neighbour) gives the first of the same list."""
    planner = Planner(load_cluster(CLUSTERS / f"{name}.toml"))
    rng = random.Random(name)
    menus = tp_menus(planner)
    for _ in range(6):
        groups = planner.groups(rng.choice(menus))
        groups = rng.sample(groups, rng.randint(1, len(groups)))
        pipes = Dealer(planner, groups).deal(rng.randint(1, min(len(groups), 8)), rng.random() < 0.5)
        st = Structure(pipes, rng.choice([d for d in range(1, 9) if planner.global_batch % d == 0]))
        everything = list(moves.neighbours(planner, st))
        keys = [nb.key() for nb in everything]
        assert len(set(keys)) == len(keys) > 0
        taken = moves.neighbours(planner, st)
        first = [next(taken) for _ in range(min(5, len(everything)))]
        assert [nb.key() for nb in first] == keys[: len(first)]


def plain_split_layers(planner: Planner, groups, rows, schedule, chunks, m, others):
    """layers._split_layers as a loop over the units of each stage (the DP before numpy), on plain lists."""
    groups = [planner._rep.setdefault(planner._rep_key(g), g) for g in groups]
    k, unit = len(groups), chunks
    if planner.L % unit or planner.L // unit < k:
        return None
    peaks = planner.cost._peaks(schedule, k, m, chunks)
    n = planner.L // unit

    def cost(i: int, u: int) -> float:
        return planner._stage_cost(groups[i], u * unit, i == 0, i == k - 1, rows, peaks[i], others)[0]

    best = [math.inf] + [cost(k - 1, r) if r <= n - k + 1 else math.inf for r in range(1, n + 1)]
    choice = []
    for i in range(k - 2, -1, -1):
        new, pick = [math.inf] * (n + 1), [1] * (n + 1)
        for r in range(n + 1):
            for u in range(1, n - k + 2):  # the first u of the least max (np.argmin's tie-break)
                t = max(cost(i, u), best[r - u] if r - u > 0 else math.inf)
                if t < new[r]:
                    new[r], pick[r] = t, u
        best = new
        choice.append(pick)
    if not best[n] < math.inf:
        return None
    t, split, r = best[n], [], n
    for pick in reversed(choice):
        split.append(pick[r])
        r -= split[-1]
    split.append(r)
    split = [u * unit for u in split]
    flags = tuple(
        planner._stage_cost(g, l, i == 0, i == k - 1, rows, peaks[i], others)[1]
        for i, (g, l) in enumerate(zip(groups, split))
    )
    return tuple(split), flags, t


@pytest.mark.parametrize("name", ["hexiscale_40gpu", "holmes_64gpu", "small_cpu"])
def test_the_layer_split_equals_the_plain_dp(name):
    """The numpy min-max DP (layers._split_layers, on memoised numpy rows) against the loop over units: the same
    split, recompute flags and slowest-stage time, bit for bit, on random pipelines, schedules and chunks."""
    planner = Planner(load_cluster(CLUSTERS / f"{name}.toml"))
    rng = random.Random(name)
    menus = tp_menus(planner)
    found = 0
    for _ in range(40):
        groups = planner.groups(rng.choice(menus))
        groups = tuple(rng.sample(groups, rng.randint(1, min(len(groups), 10))))
        schedule = rng.choice(["1f1b", "gpipe", "zbh1", "interleaved"])
        chunks = rng.choice([c for c in (1, 2, 3, 4) if planner.L % c == 0]) if schedule == "interleaved" else 1
        rows, m = rng.choice([1, 2, 4]), rng.randint(1, 12)
        others = (0.0, 0.0) if rng.random() < 0.5 else (rng.uniform(0, 1e9), rng.uniform(0, 1e9))
        key = planner._memo_key(groups, rows, schedule, chunks, m, others)  # m as the memo caps it
        if key is None:  # interleaving one stage: refused before the DP
            continue
        m = key[4]
        got = planner._split_layers(groups, rows, schedule, chunks, m, others)
        assert got == plain_split_layers(planner, groups, rows, schedule, chunks, m, others)
        found += got is not None
    assert found >= 10  # most of them fit
