"""Every rank's ``RankPlan``: checked against the whole plan for the shipped layouts, frozen, free of the
layout, and printed exactly by ``hetero-launch L.toml --dry-run --rank R``. Torch-free."""

from __future__ import annotations

import ast
from pathlib import Path

import attrs
import pytest
from helpers_plan import TP_MIX, make

from harness import LAYOUT_FILES, LAYOUTS, invoke_cli
from hetero_llm import _properties
from hetero_llm import layout as layout_mod
from hetero_llm.layout import Layout
from hetero_llm.plan import compile_plan, describe
from hetero_llm.plan.rank import WORLD, P2PKey, TPKey
from hetero_llm.schedule import Direction, Kind

ROOT = Path(__file__).resolve().parents[2]

SHIPPED = [p.relative_to(LAYOUTS).as_posix() for p in LAYOUT_FILES if p.name != "mixed_1024gpu.toml"]


@pytest.fixture(scope="module", params=SHIPPED)
def plan(request):
    return compile_plan(layout_mod.load(LAYOUTS / request.param))


def test_there_is_a_rank_plan_per_rank_and_it_agrees_with_the_plan(plan):
    assert len(plan.rank_plans) == plan.world_size
    for rp in plan.rank_plans:
        assert rp is plan.rank_plan(rp.rank)
        assert rp.info == plan.ranks[rp.rank] and rp.stage == plan.stage_of(rp.rank)
        assert rp.actions == plan.actions(rp.rank) and rp.world_size == plan.world_size
        assert rp.params_of() == plan.params_of(rp.rank)
        assert (rp.batch.offset, rp.batch.size) == plan.batch_share(rp.pipeline)
        assert rp.groups == plan.groups and rp.world == plan.world
        assert rp.sync_blocks == tuple(b for b in plan.sync_blocks if rp.rank in b.group)
        assert rp.split_backward == any(a.kind.value == "I" for a in rp.actions)


def test_every_group_a_rank_uses_is_one_it_belongs_to(plan):
    keys = {g.key: g for g in plan.groups}
    for rp in plan.rank_plans:
        member = {g.key for g in rp.member_groups}
        assert member == {WORLD} | {g.key for g in plan.groups if rp.rank in g.ranks}
        used = [key for _, key in rp.routes.groups] + [b.key for b in rp.sync_blocks]
        if rp.tp_group is not None:
            used.append(rp.tp_group)
            assert keys[rp.tp_group].ranks == rp.stage.tp_ranks(rp.cp_index)
        else:
            assert rp.stage.tp == 1 and TPKey(rp.pipeline, rp.stage.stage) not in keys
        assert set(used) <= member, (rp.rank, set(used) - member)
        assert {key for key, _ in rp.network.envs} == member  # created under its settings: every group it is in
        for kind, key in rp.routes.groups:  # a route travels in the group of its own boundary and direction
            routes = getattr(rp.routes, kind.value.lower()) or getattr(rp.routes, f"{kind.value.lower()}_runs", ())
            for route in routes if isinstance(routes, tuple) else (routes,):
                assert isinstance(key, P2PKey) and key == plan.route_group(key.direction, route)
                assert {route.src, route.dst} <= set(keys[key].ranks)


def test_each_pipeline_counts_its_loss_once_and_one_rank_reports(plan):
    counted = [(rp.pipeline, rp.cp_index) for rp in plan.rank_plans if rp.counts_loss]  # each CP rank its tokens
    assert sorted(counted) == [
        (pi, c) for pi, pipe in enumerate(plan.layout.pipelines) for c in range(pipe.stages[-1].cp)
    ]
    assert [rp.rank for rp in plan.rank_plans if rp.reports] == [0]
    for rp in plan.rank_plans:
        assert rp.counts_loss == (rp.stage.last and rp.tp_index == 0)


def test_shards_of_a_parameter_cover_it_once_per_pipeline(plan):
    model = plan.layout.model
    for pi in range(len(plan.layout.pipelines)):
        rows: dict[str, list[tuple[int, int]]] = {}
        replicated: dict[str, int] = {}
        sizes = {}
        for rp in (rp for rp in plan.rank_plans if rp.pipeline == pi):
            twin = plan.rank_plans[rp.stage.tp_ranks(0)[rp.tp_index]]  # its TP index on CP rank 0 of the stage
            assert rp.shards == twin.shards  # the CP ranks of a stage hold the same shards
            if rp.cp_index:
                continue
            for s in rp.shards:
                sizes[s.name] = s.info.shape[s.info.shard_dim or 0]
                if s.info.shard_dim is None:
                    assert (s.lo, s.hi, s.replicas) == (0, s.info.shape[0], rp.stage.tp)
                    replicated[s.name] = replicated.get(s.name, 0) + 1 / s.replicas
                else:
                    assert s.replicas == 1
                    rows.setdefault(s.name, []).append((s.lo, s.hi))
        for name, ranges in rows.items():  # disjoint and gap-free: [0, n) exactly once
            ranges.sort()
            assert ranges[0][0] == 0 and ranges[-1][1] == sizes[name], name
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), name
        tied = {"embed.tok"} if model.tie_embeddings else set()  # a tied head: first and last stage hold it
        for name, copies in replicated.items():
            assert copies == pytest.approx(2 if name in tied and len(plan.layout.pipelines[pi].stages) > 1 else 1)
        assert set(rows) | set(replicated) == {
            p.name for st in plan.stages if st.pipeline == pi for p in st.params(model)
        }


def _fields(value, seen=None):
    """Every value reachable through attrs fields, tuples and dicts."""
    seen = set() if seen is None else seen
    if id(value) in seen:
        return
    seen.add(id(value))
    yield value
    if attrs.has(type(value)):
        for f in attrs.fields(type(value)):
            yield from _fields(getattr(value, f.name), seen)
    elif isinstance(value, (tuple, list, frozenset, set)):
        for v in value:
            yield from _fields(v, seen)
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _fields(k, seen)
            yield from _fields(v, seen)


def test_rank_plans_are_frozen_and_hold_no_layout(plan):
    for rp in plan.rank_plans[:4]:
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            rp.rank = 7  # type: ignore[misc]
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            rp.routes.recv_f = None  # type: ignore[misc]
        found = list(_fields(rp))
        assert not any(isinstance(v, Layout) for v in found)
        assert not any(isinstance(v, (list, dict, set)) for v in found)  # nothing mutable inside either
        hash(rp.routes), hash(rp.network), hash(rp.shards)


def test_group_keys_read_as_the_names_people_see():
    plan = compile_plan(make(TP_MIX))  # ranks: p0 = 0 1 | 2 ; p1 = 3 4 5
    assert [g.name for g in plan.groups][:4] == [
        "tp[p0.s0]",
        "tp[p1.s0]",
        "p2p_fwd[p0.s0->p0.s1]",
        "p2p_bwd[p0.s1->p0.s0]",
    ]
    rp = plan.rank_plan(2)
    assert rp.routes.groups == (
        (Kind.RECV_F, P2PKey(Direction.FWD, (0, 0), (0, 1))),
        (Kind.SEND_B, P2PKey(Direction.BWD, (0, 1), (0, 0))),
    )
    assert plan.rank_plan(0).tp_group == TPKey(0, 0) and rp.tp_group is None


RANK_2 = """\
rank 2 of 6 (inline.toml)
  device      n0:2 on node n0 (cpu)
  stage       pipeline 0 stage 1 of 2, layers 1-1 (1 chunk)
  tp          index 0 of 1, ranks [2]
  batch share rows 0-3 of 6 in 2 microbatches
  compute     precision fp32, recompute none, compile none
  schedule    1f1b
  loss        counted here (last stage, TP rank 0); reports nothing

actions (8, in order):
  RECV_F0 F0 B0 SEND_B0 RECV_F1 F1 B1 SEND_B1

routes (stage-boundary pieces):
  recv_f  piece 0 of 1  rank 0 -> rank 2  in p2p_fwd[p0.s0->p0.s1]
  send_b  piece 0 of 2  rank 2 -> rank 0  in p2p_bwd[p0.s1->p0.s0]
  send_b  piece 1 of 2  rank 2 -> rank 1  in p2p_bwd[p0.s1->p0.s0]

groups this rank creates, in order (* = a member):
  * world                        ranks [0, 1, 2, 3, 4, 5]  via default
    tp[p0.s0]                    ranks [0, 1]  via default
    tp[p1.s0]                    ranks [3, 4, 5]  via default
  * p2p_fwd[p0.s0->p0.s1]        ranks [0, 1, 2]  via shm
  * p2p_bwd[p0.s1->p0.s0]        ranks [0, 1, 2]  via shm
"""


def test_describe_says_what_one_rank_does():
    plan = compile_plan(make(TP_MIX))
    text = describe.describe_rank(plan.rank_plan(2))
    assert text.startswith(RANK_2)
    rest = text[len(RANK_2) :].splitlines()
    buckets = [b for b in plan.sync_blocks if 2 in b.group]
    assert rest[: len(plan.groups) - 4] == [
        f"  {'*' if 2 in b.group else ' '} {b.name:<28} ranks {list(b.group)}  via default" for b in plan.sync_blocks
    ]
    shards = rest.index("parameter shards (13):")
    assert rest[shards + 1 : shards + 4] == [
        "  layers.1.attn_norm.weight    [24]  replicated",
        "  layers.1.attn_norm.bias      [24]  replicated",
        "  layers.1.attn.wq             [24, 24]  dim 0: 0-23 of 24",
    ]
    assert rest[-len(buckets) - 1 :] == ["gradient sync buckets:"] + [
        f"  {b.name:<28} {len(b.entries)} blocks" for b in buckets
    ]
    tp = describe.describe_rank(plan.rank_plan(4)).splitlines()
    assert tp[3] == "  tp          index 1 of 3, ranks [3, 4, 5], group tp[p1.s0]"
    assert "  layers.0.attn.wq             [24, 24]  dim 0: 8-15 of 24" in tp
    assert "  batch share rows 4-5 of 6 in 1 microbatch" in tp
    assert "  loss        not counted here; reports progress and metrics" in describe.describe_rank(plan.rank_plan(0))


def test_dry_run_with_rank_prints_that_rank_only(tmp_path):
    path = LAYOUTS / "papers" / "hexiscale_two_pipelines.toml"
    plan = compile_plan(layout_mod.load(path))
    result = invoke_cli(path, "--dry-run", "--rank", "5")
    assert result.exit_code == 0, result.output
    assert result.output.startswith(describe.describe_rank(plan.rank_plan(5)) + "\n\nrendezvous: ")
    assert len(result.output.splitlines()) == len(describe.describe_rank(plan.rank_plan(5)).splitlines()) + 2
    plain = invoke_cli(path, "--dry-run", "--full")
    assert plain.exit_code == 0 and "rank  device      node      pipeline  stage  tp" in plain.output
    assert "rank 5 of 8" not in plain.output
    bad = invoke_cli(path, "--dry-run", "--rank", "8")
    assert bad.exit_code == 2 and "--rank: rank 8 is not in this layout (ranks 0..7)" in bad.stderr


RUNTIME_SIDE = _properties.runtime_side()  # declared once, in hetero_llm/_properties.py


@pytest.mark.parametrize("module", sorted(RUNTIME_SIDE))
def test_the_runtime_side_cannot_reach_the_layout(module):
    """These modules take a RankPlan (or pieces of one): they import neither ``Plan`` nor ``Layout`` and read no
    ``.layout`` of anything."""
    tree = ast.parse(RUNTIME_SIDE[module].read_text())
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert not names & {"Plan", "Layout", "compile_plan", "load", "loads"}, names
    assert not [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr == "layout"]


def test_context_parallel_plan_facts():
    """A stage's devices are TP x CP, CP-major; each CP rank holds zigzag chunks, talks to its ring neighbours,
    meets its own CP index across the boundary, and sums gradients with the other CP ranks of its stage."""
    plan = compile_plan(layout_mod.load(LAYOUTS / "examples" / "context_parallel.toml"))  # s0: tp 2 x cp 2; s1: cp 2
    assert [g.name for g in plan.groups][:5] == [
        "tp[p0.s0]",
        "tp[p0.s0.c1]",
        "cp[p0.s0.t0]",
        "cp[p0.s0.t1]",
        "cp[p0.s1.t0]",
    ]
    assert [(r.tp_index, r.cp_index) for r in plan.ranks] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 0), (0, 1)]
    contexts = [rp.context for rp in plan.rank_plans]
    assert all(c is not None for c in contexts)
    assert [c.ranks for c in contexts] == [(0, 2), (1, 3), (0, 2), (1, 3), (4, 5), (4, 5)]
    assert [c.chunks for c in contexts[:4:2]] == [((0, 4), (12, 16)), ((4, 8), (8, 12))]  # seq_len 16: 4 chunks
    assert (contexts[2].send_to, contexts[2].recv_from) == (0, 0)
    assert [rp.tp_group.name if rp.tp_group else None for rp in plan.rank_plans][:4] == [
        "tp[p0.s0]",
        "tp[p0.s0]",
        "tp[p0.s0.c1]",
        "tp[p0.s0.c1]",
    ]
    # activations go between the TP groups of the same CP rank: 0 -> 4, 2 -> 5; gradients back in two pieces
    assert [(r.src, r.dst) for r in plan.routes_f] == [(0, 4), (2, 5)]
    assert [(r.src, r.dst, r.piece) for r in plan.routes_b] == [(4, 0, 0), (4, 1, 1), (5, 2, 0), (5, 3, 1)]
    # the CP ranks of a stage hold the same shards with their own tokens' gradients: summed among them
    assert [b.group for b in plan.sync_blocks] == [(0, 1, 2, 3), (0, 2), (1, 3), (4, 5)]
    assert [rp.counts_loss for rp in plan.rank_plans] == [False] * 4 + [True, True]
    text = describe.describe(plan)
    assert "  cp[p0.s0.t1]         ring 1 -> 3 -> 1   rank 1: 0-3, 12-15  rank 3: 4-7, 8-11" in text
    assert "  cp          index 1 of 2, ring [1, 3] in cp[p0.s0.t1]: keys/values to rank 1, from rank 1; " in (
        describe.describe_rank(plan.rank_plans[3])
    )


def _cp_pair(tp_a: int, cp_a: int, tp_b: int, cp_b: int):
    n = tp_a * cp_a + tp_b * cp_b
    devices = [f'"node0:{i}"' for i in range(n)]
    return compile_plan(
        layout_mod.loads(
            f"""
[model]
layers = 2
hidden = 48
heads = 12
vocab = 64
seq_len = 24
[train]
steps = 1
global_batch = 2
[cluster]
[[cluster.nodes]]
name = "node0"
devices = [{", ".join(['"cpu"'] * n)}]
[[pipelines]]
batch = 2
microbatches = 1
[[pipelines.stages]]
layers = 1
devices = [{", ".join(devices[: tp_a * cp_a])}]
cp = {cp_a}
[[pipelines.stages]]
layers = 1
devices = [{", ".join(devices[tp_a * cp_a :])}]
cp = {cp_b}
"""
        )
    )


@pytest.mark.parametrize("tp_a,cp_a,tp_b,cp_b", [(1, 4, 1, 2), (2, 2, 1, 3), (1, 1, 3, 2), (3, 2, 2, 1), (1, 6, 2, 4)])
def test_rechunking_routes_give_each_receiver_its_positions_once(tp_a, cp_a, tp_b, cp_b):
    """Between stages of different cp, every rank receives each position it holds exactly once, in its local
    order, from a rank holding it there; both directions (gradients go back the same way)."""
    from hetero_llm.model import cp_chunks

    plan = _cp_pair(tp_a, cp_a, tp_b, cp_b)
    seq = plan.layout.model.seq_len
    a, b = plan.stages

    def held(rank: int) -> list[int]:
        st, info = plan.stage_of(rank), plan.ranks[rank]
        return cp_chunks.local_positions(seq, st.cp, info.cp_index).tolist()

    for routes, senders, receivers in ((plan.routes_f, a, b), (plan.routes_b, b, a)):
        assert all(r.runs and (r.piece, r.pieces) == (0, 1) for r in routes)
        for dst in receivers.ranks:
            got: dict[int, int] = {}
            for r in (r for r in routes if r.dst == dst):
                assert r.src in senders.ranks
                for s, d, n in r.runs:
                    for k in range(n):
                        assert d + k not in got
                        got[d + k] = held(r.src)[s + k]
            assert [got[k] for k in range(len(held(dst)))] == held(dst)
        for rp in (plan.rank_plan(r) for r in receivers.ranks):  # what the rank posts: one receive per sender
            runs = rp.routes.recv_f_runs if receivers is b else rp.routes.recv_b_runs
            assert {r.src for r in runs} == {r.src for r in routes if r.dst == rp.rank}
