"""The control plane at scale (issue 33): the plan's indexes give exactly what plain scans over the whole plan gave
(the algorithms before them, written out here as the reference), the dry run's summary and ``--full``, and host
checks resolved concurrently within a bounded wait. Torch-free; bench/launch/control_plane.py measures the speed."""

from __future__ import annotations

import threading
from collections import Counter, defaultdict

import pytest

from bench.launch import control_plane
from harness import LAYOUTS, ROOT, assert_one_error_line, invoke_cli
from hetero_llm import layout as layout_mod
from hetero_llm.comm import rendezvous
from hetero_llm.errors import LayoutError
from hetero_llm.launch import hosts, node
from hetero_llm.model.params import shard_range, stage_params
from hetero_llm.plan import compile_plan, describe, zero1_slices
from hetero_llm.plan.rank import StageRoutes, SyncBlocks, ZeroUnit
from hetero_llm.schedule import Kind

ZERO1 = ("--set", "train.optimizer=adamw_zero1")


def _layouts():
    yield layout_mod.load(LAYOUTS / "papers" / "hexiscale_three_pipelines.toml", ZERO1[1:])  # TP 4 | 2,2 | 1,1,1,1
    yield layout_mod.load(LAYOUTS / "planned" / "holmes_two_domains.toml", ZERO1[1:])
    yield layout_mod.load(LAYOUTS / "examples" / "context_parallel.toml", ZERO1[1:])
    # two pipeline shapes cut differently, interleaved x2, ZeRO-1, three domains (the benchmark's layout)
    yield layout_mod.loads(layout_mod.dumps(control_plane.scale_layout("scale.toml", 32)), "scale.toml")


@pytest.fixture(scope="module", params=range(4), ids=["hexiscale3", "holmes", "context_parallel", "scale32"])
def plan(request):
    return compile_plan(list(_layouts())[request.param])


# -------------------------------------------------------------------------- the reference: scans over the plan


def _scanned_stage(plan, rank):
    r = plan.ranks[rank]
    return next(s for s in plan.stages if s.pipeline == r.pipeline and s.stage == r.stage)


def _scanned_params(st, model):
    out = []
    for c in range(len(st.chunk_ranges)):
        out += [info for info in stage_params(model, *st.chunk_shape(c)) if info not in out]
    return out


def _scanned_sync_blocks(plan):
    holders, infos, label = defaultdict(list), {}, {}
    for st in plan.stages:
        for info in _scanned_params(st, plan.layout.model):
            infos[info.name] = info
            for i, rank in enumerate(st.ranks):  # CP-major: TP index i % tp, context-parallel index i // tp
                holders[info.name].append((rank, *shard_range(info, st.tp, i % st.tp)))
                label[rank] = (st.label, i // st.tp)
    by_group = defaultdict(list)
    for name, held in holders.items():
        cuts = sorted({x for _, lo, hi in held for x in (lo, hi)})
        for lo, hi in zip(cuts, cuts[1:]):
            group = tuple(sorted(r for r, a, b in held if a <= lo and hi <= b))
            if len({label[r] for r in group}) > 1:
                by_group[group].append((name, infos[name].shard_dim or 0, lo, hi))
    return [SyncBlocks(g, tuple(e)) for g, e in sorted(by_group.items())]


def _scanned_routes(plan, rank):
    recv_f = next((r for r in plan.routes_f if r.dst == rank and not r.runs), None)
    recv_b = next((r for r in plan.routes_b if r.dst == rank and not r.runs), None)
    runs_f = tuple(r for r in plan.routes_f if r.dst == rank and r.runs)
    runs_b = tuple(r for r in plan.routes_b if r.dst == rank and r.runs)
    send_f = tuple(r for r in plan.routes_f if r.src == rank)
    send_b = tuple(r for r in plan.routes_b if r.src == rank)
    sides = (
        (Kind.RECV_F, recv_f or runs_f[:1]),
        (Kind.SEND_F, send_f[:1]),
        (Kind.RECV_B, recv_b or runs_b[:1]),
        (Kind.SEND_B, send_b[:1]),
    )
    groups = tuple(
        (kind, plan.route_group(kind.direction, route[0] if isinstance(route, tuple) else route))
        for kind, route in sides
        if route
    )
    return StageRoutes(recv_f, send_f, recv_b, send_b, groups, runs_f, runs_b)


def _scanned_units(plan):
    """zero1_slices.units as it was: every entry's weights from the holders' nodes and stages, found by scans."""
    infos = {p.name: p for st in plan.stages for p in _scanned_params(st, plan.layout.model)}
    memory = {n.name: n.memory_gb for n in plan.layout.cluster.nodes}

    def weights(ranks, info):
        mem = [memory[plan.ranks[r].node] for r in ranks]
        mem = mem if all(m > 0 for m in mem) else [1.0] * len(ranks)
        return [m * (_scanned_stage(plan, r).tp if info.shard_dim is not None else 1) for m, r in zip(mem, ranks)]

    def unit(key, ranks, entries, reduce):
        cuts = tuple(zero1_slices._cut(lo, hi, weights(ranks, infos[name])) for name, _, lo, hi in entries)
        sizes = tuple(zero1_slices._row_size(infos[name], dim) for name, dim, _, _ in entries)
        return ZeroUnit(key, ranks, entries, cuts, sizes, reduce)

    out = [unit(b.key, b.group, b.entries, True) for b in plan.sync_blocks]
    synced = {e[0] for b in plan.sync_blocks for e in b.entries}
    for st in plan.stages:
        replicated = tuple(
            (p.name, 0, 0, p.shape[0])
            for p in _scanned_params(st, plan.layout.model)
            if p.shard_dim is None and p.name not in synced
        )
        if st.tp > 1 and replicated:
            out.append(unit(plan.tp_group(st), st.ranks, replicated, False))
    return tuple(out)


# -------------------------------------------------------------------------- the plan is what the scans give


def test_stages_params_and_batch_shares_are_what_the_scans_give(plan):
    model = plan.layout.model
    for rank in range(plan.world_size):
        assert plan.stage_of(rank) is _scanned_stage(plan, rank)
    for st in plan.stages:
        assert st.params(model) == _scanned_params(st, model)
    for pi in range(len(plan.layout.pipelines)):
        assert plan.batch_share(pi) == (
            sum(p.batch for p in plan.layout.pipelines[:pi]),
            plan.layout.pipelines[pi].batch,
        )


def test_sync_blocks_routes_and_shards_are_what_the_scans_give(plan):
    assert list(plan.sync_blocks) == _scanned_sync_blocks(plan)
    for rp in plan.rank_plans:
        st = _scanned_stage(plan, rp.rank)
        assert rp.routes == _scanned_routes(plan, rp.rank)
        assert [(s.info, s.lo, s.hi) for s in rp.shards] == [
            (p, *shard_range(p, st.tp, rp.tp_index)) for p in _scanned_params(st, plan.layout.model)
        ]
        assert [s.replicas for s in rp.shards] == [st.tp if s.info.shard_dim is None else 1 for s in rp.shards]


def test_zero1_units_and_slices_are_what_the_scans_give(plan):
    units = _scanned_units(plan)
    assert zero1_slices.units(plan) == units
    for rp in plan.rank_plans:
        mine = [(u, u.slices(rp.rank)) for u in units if rp.rank in u.ranks]
        assert [(u, list(sl)) for u, sl in rp.optimizer_slices.units] == mine
        assert (mine, list(rp.optimizer_slices.local)) == zero1_slices.owned(plan, rp.rank)  # found without the index
    for u in units:
        assert u.chunk == max(
            sum((c[j + 1] - c[j]) * n for c, n in zip(u.cuts, u.row_sizes)) for j in range(len(u.ranks))
        )


def test_identical_pipelines_share_their_schedule_and_shards():
    plan = compile_plan(layout_mod.loads(layout_mod.dumps(control_plane.scale_layout("s.toml", 32)), "s.toml"))
    assert plan.schedules[0] is plan.schedules[2] and plan.schedules[0] == plan.schedules[1]  # shapes alternate
    assert plan.rank_plan(0).shards is plan.rank_plan(16).shards  # pipeline 2's first rank: same stage shape


# -------------------------------------------------------------------------- the dry run: a summary, --full


QUICKSTART = ROOT / "layouts" / "quickstart.toml"


def test_dry_run_prints_the_plan_counted(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    result = invoke_cli("layouts/quickstart.toml", "--dry-run")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.splitlines() == [
        "layout layouts/quickstart.toml: 2 ranks, 1 pipeline(s), global batch 16, schedule 1f1b",
        "",
        "nodes: 1 with 2 ranks each",
        "pipelines x stages: 1 x 2",
        "  pipeline 0: 2 stages, tp 1/1, layers 0-2/3-3, 16 rows in 4 mb",
        "",
        "communicators (created in this order on every rank): 3",
        "  world           1  of 2 ranks",
        "  p2p_fwd         1  of 2 ranks  via shm",
        "  p2p_bwd         1  of 2 ranks  via shm",
        "gradient sync buckets: none (a single pipeline holds every parameter once)",
        "schedules: 1 distinct grid over 1 pipeline, 16 actions per rank",
        "rendezvous: 127.0.0.1:29511 (node node0's host, cluster.port), served by rank 0 (node0:0)",
        "",
        "every rank, communicator, bucket and schedule grid: --dry-run --full; one rank: --dry-run --rank R",
    ]


def test_the_summary_counts_groups_by_kind_and_pipelines_by_shape():
    plan = compile_plan(layout_mod.loads(layout_mod.dumps(control_plane.scale_layout("s.toml", 64)), "s.toml"))
    text = describe.summary(plan)
    lines = text.splitlines()
    assert lines[2:6] == [
        "nodes: 9 with 4-8 ranks each",  # the stage positions' nodes take 24, 16, 12 and 12 GPUs
        "pipelines x stages: 8 x 4",
        "  pipelines 0,2,4,6: 4 stages, tp 2/2/2/2, layers 0-8,16-24/9-11,25-27/12-14,28-30/15-15,31-31, "
        "8 rows in 8 mb each",
        "  pipelines 1,3,5,7: 4 stages, tp 4/2/1/1, layers 0-7,16-23/8-11,24-27/12-13,28-29/14-15,30-31, "
        "8 rows in 8 mb each",
    ]
    counted = text.split("communicators (created in this order on every rank): ")[1].splitlines()
    assert counted[:6] == [
        "109",
        "  world           1  of 64 ranks  via cross_domain",
        "  tp             24  of 2-4 ranks  via eth (4), ib (12), roce (8)",
        "  p2p_fwd        32  of 2-6 ranks  via cross_domain (24), ib (8)",
        "  p2p_bwd        32  of 2-6 ranks  via cross_domain (24), ib (8)",
        "  grad_sync      20  of 8-24 ranks  via cross_domain (6), eth (3), ib (8), roce (3)",
    ]
    for line in counted[1:6]:  # against the plan's own groups
        kind, count = line.split()[:2]
        groups = [g for g in (plan.world,) + plan.groups if g.name.split("[")[0] == kind]
        assert int(count) == len(groups) and sum(Counter(g.transport for g in groups).values()) == len(groups)
    assert len(plan.groups) + 1 == 109
    assert lines[-2:] == [
        f"gradient sync buckets: 20, {sum(len(b.entries) for b in plan.sync_blocks)} blocks summed among exactly "
        "their holders",
        "schedules: 1 distinct grid over 8 pipelines, 82-98 actions per rank",  # both shapes: 4 stages, 8 mb
    ]


def test_dry_run_full_prints_every_table_and_needs_dry_run(tmp_path):
    path = LAYOUTS / "papers" / "hexiscale_two_pipelines.toml"
    plan = compile_plan(layout_mod.load(path))
    full = invoke_cli(path, "--dry-run", "--full")
    assert full.exit_code == 0, full.stderr
    assert full.stdout == describe.describe(plan) + "\n" + rendezvous.describe(plan) + "\n"
    zero = invoke_cli(path, "--dry-run", "--full", *ZERO1)
    assert zero.stdout.endswith("\n" + zero1_slices.describe(compile_plan(layout_mod.load(path, ZERO1[1:]))) + "\n")
    assert "rank  adamw MiB" not in invoke_cli(path, "--dry-run", *ZERO1).stdout  # the summary gives the range
    assert (
        invoke_cli(path, "--dry-run", "--full", "--rank", "5").stdout
        == invoke_cli(path, "--dry-run", "--rank", "5").stdout
    )
    assert_one_error_line(
        invoke_cli(path, "--full"), f"{path}: --full: needs --dry-run (it says what the dry run prints)"
    )


def test_the_zero1_summary_is_the_range_of_the_table():
    plan = compile_plan(layout_mod.load(LAYOUTS / "papers" / "hexiscale_three_pipelines.toml", ZERO1[1:]))
    rows = [line.split() for line in zero1_slices.describe(plan).splitlines()[2:]]
    plain, zero, factor = (sorted(float(r[i]) for r in rows) for i in (1, 2, 3))
    assert zero1_slices.describe(plan, full=False).splitlines()[1] == (
        f"  adamw {plain[0]:.3f}-{plain[-1]:.3f} MiB, adamw_zero1 {zero[0]:.3f}-{zero[-1]:.3f} MiB, "
        f"factor {factor[0]:.2f}-{factor[-1]:.2f}"
    )


# -------------------------------------------------------------------------- hosts resolved at once, a bounded wait


def test_hosts_resolve_concurrently():
    """Every lookup waits until four are under way at once: resolved one at a time, the barrier would break."""
    barrier = threading.Barrier(4, timeout=30)

    def resolve(host):
        barrier.wait()
        if host == "unknown":
            raise OSError("Name or service not known")
        return [(2, 1, 6, "", ("10.255.0.9", 0))]  # an address no socket here can bind

    names = ["a", "b", "unknown", "c", "a", "localhost"]
    assert hosts.local_hosts(names, "L.toml", resolve, local={"localhost"}) == [False] * 5 + [True]


def test_a_host_that_does_not_answer_is_named_in_one_line():
    answered, release = threading.Event(), threading.Event()

    def resolve(host):
        if host == "stuck.example":
            release.wait(30)  # released at the end of the test; a daemon thread in the meantime
        answered.set()
        raise OSError("unknown")

    try:
        with pytest.raises(LayoutError) as e:
            hosts.local_hosts(["n0.example", "stuck.example", "n2.example"], "L.toml", resolve, wait_s=0.5, local=set())
    finally:
        release.set()
    assert str(e.value) == (
        "L.toml: cluster.nodes[1].host: 'stuck.example' did not resolve within 0.5 s (check the name and this "
        "machine's DNS, or pass --node NAME or --rank R to say what to start here)"
    )
    assert answered.is_set()


def test_the_launcher_finds_its_nodes_by_resolving_every_host_once(monkeypatch):
    asked = []

    def resolve(host):
        asked.append(host)
        raise OSError("unknown")

    monkeypatch.setattr(hosts, "_getaddrinfo", resolve)
    monkeypatch.setattr(hosts, "local_addresses", lambda: {"127.0.0.1"})
    lay = layout_mod.load(QUICKSTART, ["cluster.nodes[0].host=node-a.example"])
    with pytest.raises(LayoutError, match="no node's host is an address of this machine"):
        node.local_ranks(compile_plan(lay), None)
    assert asked == ["node-a.example"]
