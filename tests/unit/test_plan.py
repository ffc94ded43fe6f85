"""Plan arithmetic against hand-computed expectations: rank numbering, layer ranges, batch shares,
stage-boundary routes and gradient-sync buckets (the common refinement of differently sharded
parameters). Pure and single-process: layouts are written inline and compiled without torch.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter

import attrs
import pytest
from helpers_plan import TP_MIX, make

from hetero_llm import schedule as sched
from hetero_llm.layout import SHM, Schedule, loads
from hetero_llm.model.params import all_params
from hetero_llm.plan import Group, Route, SyncBlocks, compile_plan
from hetero_llm.plan.describe import describe
from hetero_llm.plan.rank import GradSyncKey, P2PKey, TPKey
from hetero_llm.schedule import Direction

RANK_TABLE_HEADER = "rank  device      node      pipeline  stage  tp     layers   batch share"

RANKS_LAYOUT = """
[model]
layers = 4
hidden = 16
heads = 4
vocab = 32
seq_len = 8
[train]
steps = 1
global_batch = 6
[data]
grammar_vocab = 16
[cluster]
[[cluster.nodes]]
name = "a"
devices = ["cpu", "cpu"]
[[cluster.nodes]]
name = "b"
devices = ["cuda:0", "cuda:1", "cuda:2"]

[[pipelines]]
batch = 4
microbatches = 2
[[pipelines.stages]]
layers = 1
devices = ["a:1", "a:0"]
[[pipelines.stages]]
layers = 3
devices = ["b:0"]

[[pipelines]]
batch = 2
microbatches = 1
[[pipelines.stages]]
layers = 4
devices = ["b:2", "b:1"]
"""


def test_rank_numbering_follows_pipelines_then_stages_then_devices():
    plan = compile_plan(loads(RANKS_LAYOUT))
    got = [(r.rank, r.pipeline, r.stage, r.tp_index, r.node, r.device_id, r.device) for r in plan.ranks]
    assert got == [
        (0, 0, 0, 0, "a", "a:1", "cpu"),  # device order inside a stage, not node order, numbers ranks
        (1, 0, 0, 1, "a", "a:0", "cpu"),
        (2, 0, 1, 0, "b", "b:0", "cuda:0"),
        (3, 1, 0, 0, "b", "b:2", "cuda:2"),
        (4, 1, 0, 1, "b", "b:1", "cuda:1"),
    ]
    assert plan.world_size == 5
    assert [(s.label, s.ranks, s.layer_lo, s.layer_hi, s.first, s.last) for s in plan.stages] == [
        ("p0.s0", (0, 1), 0, 1, True, False),
        ("p0.s1", (2,), 1, 4, False, True),
        ("p1.s0", (3, 4), 0, 4, True, True),
    ]
    assert [plan.stage_of(r).label for r in range(5)] == ["p0.s0", "p0.s0", "p0.s1", "p1.s0", "p1.s0"]
    assert plan.batch_share(0) == (0, 4) and plan.batch_share(1) == (4, 2)
    # rank 0 reports; the last stage's TP rank 0 of each pipeline counts its loss
    assert [plan.rank_plan(r).reports for r in range(5)] == [True, False, False, False, False]
    assert [plan.rank_plan(r).counts_loss for r in range(5)] == [False, False, True, True, False]


def test_actions_are_the_pipeline_schedule_of_the_stage():
    plan = compile_plan(loads(RANKS_LAYOUT))
    p0 = sched.build("1f1b", 2, 2)
    p1 = sched.build("1f1b", 1, 1)
    assert [list(plan.actions(r)) for r in range(5)] == [p0[0], p0[0], p0[1], p1[0], p1[0]]


def test_layer_ranges_and_batch_shares():
    # three pipelines of 1, 2 and 3 stages, batch shares 6 / 4 / 2 of a global batch of 12
    plan = compile_plan(make([(6, 2, [(6, 1)]), (4, 4, [(5, 1), (1, 1)]), (2, 1, [(1, 1), (1, 1), (4, 1)])]))
    ranges = [(plan.stage_of(r.rank).layer_lo, plan.stage_of(r.rank).layer_hi) for r in plan.ranks]
    assert ranges == [(0, 6), (0, 5), (5, 6), (0, 1), (1, 2), (2, 6)]
    assert [plan.batch_share(p) for p in range(3)] == [(0, 6), (6, 4), (10, 2)]
    rows = describe(plan).splitlines()
    table = rows[rows.index(RANK_TABLE_HEADER) + 1 :][:6]
    assert [" ".join(r.split()[6:]) for r in table] == [
        "0-5 rows 0-5 in 2 mb",
        "0-4 rows 6-9 in 4 mb",
        "5-5 rows 6-9 in 4 mb",
        "0-0 rows 10-11 in 1 mb",
        "1-1 rows 10-11 in 1 mb",
        "2-5 rows 10-11 in 1 mb",
    ]


def test_params_of_a_tp_rank_are_its_slices():
    plan = compile_plan(make([(2, 1, [(2, 2)]), (2, 1, [(2, 3)])]))  # hidden 24, ffn 96
    got = {(p.name, lo, hi) for p, lo, hi in plan.params_of(3)}  # pipeline 1, tp index 1 of 3
    assert ("layers.0.attn.wq", 8, 16) in got
    assert ("layers.1.attn.wo", 8, 16) in got  # along dim 1 (row-parallel)
    assert ("layers.1.mlp.w1", 32, 64) in got
    assert ("layers.0.attn_norm.weight", 0, 24) in got  # replicated: the whole tensor
    assert ("embed.tok", 0, 32) in got


HAND_ROUTES = {
    # (a, b): (forward routes, backward routes); sending ranks 0..a-1, receiving ranks a..a+b-1
    (1, 1): ([Route(0, 1, 0, 1)], [Route(1, 0, 0, 1)]),
    (2, 1): ([Route(0, 2, 0, 1)], [Route(2, 0, 0, 2), Route(2, 1, 1, 2)]),
    (1, 4): ([Route(0, 1, 0, 4), Route(0, 2, 1, 4), Route(0, 3, 2, 4), Route(0, 4, 3, 4)], [Route(1, 0, 0, 1)]),
    (4, 2): (
        [Route(0, 4, 0, 2), Route(1, 5, 1, 2)],
        [Route(4, 0, 0, 4), Route(5, 1, 1, 4), Route(4, 2, 2, 4), Route(5, 3, 3, 4)],
    ),
    (2, 3): ([Route(0, 2, 0, 3), Route(1, 3, 1, 3), Route(0, 4, 2, 3)], [Route(2, 0, 0, 2), Route(3, 1, 1, 2)]),
}


def _two_stage(a: int, b: int):
    return compile_plan(make([(2, 1, [(1, a), (1, b)])], hidden=48, heads=12))


@pytest.mark.parametrize("a, b", list(HAND_ROUTES), ids=[f"{a}->{b}" for a, b in HAND_ROUTES])
def test_boundary_routes_by_hand(a: int, b: int):
    plan = _two_stage(a, b)
    fwd, bwd = HAND_ROUTES[(a, b)]
    assert list(plan.routes_f) == fwd
    assert list(plan.routes_b) == bwd


def _check_crosses_once(routes, senders, receivers):
    """The tensor replicated on ``senders`` crosses once: one piece per receiver, senders spread."""
    pieces = len(receivers)
    assert sorted(r.piece for r in routes) == list(range(pieces))
    assert all(r.pieces == pieces for r in routes)
    assert sorted(r.dst for r in routes) == list(receivers)
    assert all(r.src in senders for r in routes)
    assert max(Counter(r.src for r in routes).values()) <= math.ceil(pieces / len(senders))


@pytest.mark.parametrize("a, b", list(itertools.product([1, 2, 3, 4], repeat=2)))
def test_boundary_routes_rules(a: int, b: int):
    plan = _two_stage(a, b)
    s0, s1 = plan.stages
    _check_crosses_once(plan.routes_f, s0.ranks, s1.ranks)
    _check_crosses_once(plan.routes_b, s1.ranks, s0.ranks)  # backward: the mirror image


def test_routes_stay_inside_pipelines():
    plan = compile_plan(make([(2, 1, [(1, 1), (1, 2), (2, 1)]), (2, 2, [(3, 2), (1, 1)])]))
    # ranks: p0 = 0 | 1 2 | 3 ; p1 = 4 5 | 6
    assert list(plan.routes_f) == [Route(0, 1, 0, 2), Route(0, 2, 1, 2), Route(1, 3, 0, 1), Route(4, 6, 0, 1)]
    assert list(plan.routes_b) == [
        Route(1, 0, 0, 1),
        Route(3, 1, 0, 2),
        Route(3, 2, 1, 2),
        Route(6, 4, 0, 2),
        Route(6, 5, 1, 2),
    ]


def _by_group(plan) -> dict[tuple[int, ...], set[tuple[str, int, int, int]]]:
    return {b.group: set(b.entries) for b in plan.sync_blocks}


def _check_refinement(plan):
    """Every bucket block is summed among exactly the ranks holding it, and each parameter's blocks
    tile it: no element is summed twice or left out (when every parameter has two or more holders)."""
    held = {}  # name -> [(rank, lo, hi)]
    dims = {}
    for r in plan.ranks:
        for info, lo, hi in plan.params_of(r.rank):
            held.setdefault(info.name, []).append((r.rank, lo, hi))
            dims[info.name] = info.shard_dim or 0
    tiles = {}
    for b in plan.sync_blocks:
        for name, dim, lo, hi in b.entries:
            assert dim == dims[name] and lo < hi
            holders = tuple(sorted(r for r, a, z in held[name] if a <= lo and hi <= z))
            assert holders == b.group, (name, lo, hi)
            overlapping = {r for r, a, z in held[name] if a < hi and lo < z}
            assert overlapping == set(holders), (name, lo, hi)  # a block never straddles a shard edge
            tiles.setdefault(name, []).append((lo, hi))
    for blocks in tiles.values():
        blocks.sort()
        assert blocks[0][0] == 0 and all(x[1] == y[0] for x, y in zip(blocks, blocks[1:]))
    return tiles


LAYER_PARAMS = [
    "attn_norm.weight",
    "attn_norm.bias",
    "attn.wq",
    "attn.wk",
    "attn.wv",
    "attn.wo",
    "mlp_norm.weight",
    "mlp_norm.bias",
    "mlp.w1",
    "mlp.w2",
]  # layernorm + gelu


def _names(*layers: int, embed: bool = False, head: bool = False) -> set[str]:
    out = {f"layers.{i}.{p}" for i in layers for p in LAYER_PARAMS}
    out |= {"embed.tok", "embed.pos"} if embed else set()
    return out | ({"final_norm.weight", "final_norm.bias", "lm_head.weight"} if head else set())


def test_grad_buckets_two_partitions():
    # p0: layers 0 | 1 2 3 on ranks 0 | 1; p1: layers 0 1 | 2 3 on ranks 2 | 3; every TP size 1
    plan = compile_plan(make([(2, 1, [(1, 1), (3, 1)]), (2, 1, [(2, 1), (2, 1)])], hidden=16, heads=4))
    dim = {p.name: p.shard_dim or 0 for p in all_params(plan.layout.model)}
    size = {p.name: p.shape[dim[p.name]] for p in all_params(plan.layout.model)}
    assert (dim["layers.0.attn.wo"], dim["layers.0.mlp.w2"], dim["layers.0.attn.wq"], dim["embed.tok"]) == (1, 1, 0, 0)

    def whole(names):  # TP 1 everywhere: each tensor is one block, along its (unsplit) shard dim
        return {(n, dim[n], 0, size[n]) for n in names}

    assert _by_group(plan) == {
        (0, 2): whole(_names(0, embed=True)),
        (1, 2): whole(_names(1)),
        (1, 3): whole(_names(2, 3, head=True)),
    }
    assert [b.group for b in plan.sync_blocks] == [(0, 2), (1, 2), (1, 3)]
    _check_refinement(plan)


def test_grad_buckets_tp2_vs_tp1():
    # p0: one stage, TP 2 (ranks 0, 1); p1: one stage, TP 1 (rank 2). hidden 16, ffn 64
    plan = compile_plan(make([(2, 1, [(1, 2)]), (2, 1, [(1, 1)])], hidden=16, heads=4))
    groups = _by_group(plan)
    assert list(groups) == [(0, 1, 2), (0, 2), (1, 2)]
    # column-parallel (rows, dim 0) and row-parallel (columns, dim 1): two blocks each
    assert {e for e in groups[(0, 2)] if e[0].startswith("layers.0.attn.")} == {
        ("layers.0.attn.wq", 0, 0, 8),
        ("layers.0.attn.wk", 0, 0, 8),
        ("layers.0.attn.wv", 0, 0, 8),
        ("layers.0.attn.wo", 1, 0, 8),
    }
    assert {e for e in groups[(1, 2)] if e[0].startswith("layers.0.attn.")} == {
        ("layers.0.attn.wq", 0, 8, 16),
        ("layers.0.attn.wk", 0, 8, 16),
        ("layers.0.attn.wv", 0, 8, 16),
        ("layers.0.attn.wo", 1, 8, 16),
    }
    assert ("layers.0.mlp.w1", 0, 0, 32) in groups[(0, 2)] and ("layers.0.mlp.w1", 0, 32, 64) in groups[(1, 2)]
    assert ("layers.0.mlp.w2", 1, 0, 32) in groups[(0, 2)] and ("layers.0.mlp.w2", 1, 32, 64) in groups[(1, 2)]
    # TP-replicated tensors are held whole by all three ranks
    assert groups[(0, 1, 2)] == {
        ("embed.tok", 0, 0, 32),
        ("embed.pos", 0, 0, 8),
        ("layers.0.attn_norm.weight", 0, 0, 16),
        ("layers.0.attn_norm.bias", 0, 0, 16),
        ("layers.0.mlp_norm.weight", 0, 0, 16),
        ("layers.0.mlp_norm.bias", 0, 0, 16),
        ("final_norm.weight", 0, 0, 16),
        ("final_norm.bias", 0, 0, 16),
        ("lm_head.weight", 0, 0, 32),
    }
    _check_refinement(plan)


def test_grad_buckets_tp2_vs_tp3_common_refinement():
    # heads 6, hidden 24, ffn 96. p0: TP 2 (ranks 0, 1); p1: TP 3 (ranks 2, 3, 4)
    plan = compile_plan(make([(2, 1, [(1, 2)]), (2, 1, [(1, 3)])], hidden=24, heads=6))
    groups = _by_group(plan)
    assert list(groups) == [(0, 1, 2, 3, 4), (0, 2), (0, 3), (1, 3), (1, 4)]
    # cuts at 0, 1/3, 1/2, 2/3, 1 of the split dim; block k is held by one TP-2 and one TP-3 rank
    for name, dim, n in [("attn.wq", 0, 24), ("attn.wo", 1, 24), ("mlp.w1", 0, 96), ("mlp.w2", 1, 96)]:
        full = f"layers.0.{name}"
        blocks = {g: [e[2:] for e in es if e[0] == full] for g, es in groups.items()}
        assert blocks == {
            (0, 1, 2, 3, 4): [],
            (0, 2): [(0, n // 3)],
            (0, 3): [(n // 3, n // 2)],
            (1, 3): [(n // 2, 2 * n // 3)],
            (1, 4): [(2 * n // 3, n)],
        }, name
        assert all(e[1] == dim for es in groups.values() for e in es if e[0] == full)
    tiles = _check_refinement(plan)
    assert sorted(tiles["layers.0.attn.wq"]) == [(0, 8), (8, 12), (12, 16), (16, 24)]


def test_single_pipeline_tp1_has_no_buckets():
    plan = compile_plan(make([(4, 2, [(1, 1), (2, 1), (1, 1)])]))
    assert plan.sync_blocks == ()
    # one node of CPU ranks: the boundaries go through shared memory (cluster.nodes[].p2p = 'auto')
    assert plan.groups == (
        Group(P2PKey(Direction.FWD, (0, 0), (0, 1)), (0, 1), SHM),
        Group(P2PKey(Direction.BWD, (0, 1), (0, 0)), (0, 1), SHM),
        Group(P2PKey(Direction.FWD, (0, 1), (0, 2)), (1, 2), SHM),
        Group(P2PKey(Direction.BWD, (0, 2), (0, 1)), (1, 2), SHM),
    )
    assert [g.name for g in plan.groups] == [
        "p2p_fwd[p0.s0->p0.s1]",
        "p2p_bwd[p0.s1->p0.s0]",
        "p2p_fwd[p0.s1->p0.s2]",
        "p2p_bwd[p0.s2->p0.s1]",
    ]
    assert "  (none: a single pipeline holds every parameter once)" in describe(plan)
    one = compile_plan(make([(4, 2, [(4, 1)])]))
    assert one.groups == () and "  (none besides the world group)" in describe(one)


def test_groups_in_one_deterministic_order():
    plan = compile_plan(make(TP_MIX))
    assert plan == compile_plan(make(TP_MIX))  # compile twice (from a fresh load) -> identical
    names = [g.name for g in plan.groups]
    assert len(set(names)) == len(names)
    # TP groups in stage order, the p2p groups of each boundary (activations, gradients), then one group
    # per bucket in sorted rank order
    assert list(plan.groups[:2]) == [Group(TPKey(0, 0), (0, 1)), Group(TPKey(1, 0), (3, 4, 5))]
    assert names[:2] == ["tp[p0.s0]", "tp[p1.s0]"]
    assert list(plan.groups[2:4]) == [
        Group(P2PKey(Direction.FWD, (0, 0), (0, 1)), (0, 1, 2), SHM),
        Group(P2PKey(Direction.BWD, (0, 1), (0, 0)), (0, 1, 2), SHM),
    ]
    assert list(plan.groups[4:]) == [Group(GradSyncKey(b.group), b.group) for b in plan.sync_blocks]
    assert names[4:] == ["grad_sync[" + ",".join(map(str, b.group)) + "]" for b in plan.sync_blocks]
    assert [b.group for b in plan.sync_blocks] == sorted(b.group for b in plan.sync_blocks)
    assert all(isinstance(b, SyncBlocks) and len(b.group) > 1 for b in plan.sync_blocks)
    _check_refinement(plan)


def test_interleaved_wrap_gets_its_own_p2p_groups():
    """Two stages, two chunks: activations flow s0 -> s1 and (the wrap) s1 -> s0, gradients back both ways."""
    lay = make([(4, 2, [(2, 1), (2, 1)])])
    plan = compile_plan(attrs.evolve(lay, train=attrs.evolve(lay.train, schedule=Schedule.INTERLEAVED, chunks=2)))
    assert [g.name for g in plan.groups] == [
        "p2p_fwd[p0.s0->p0.s1]",
        "p2p_bwd[p0.s1->p0.s0]",
        "p2p_fwd[p0.s1->p0.s0]",
        "p2p_bwd[p0.s0->p0.s1]",
    ]


def test_describe_has_rank_table_groups_and_schedule_grids():
    plan = compile_plan(make(TP_MIX))
    text = describe(plan)
    lines = text.splitlines()
    assert lines[0] == "layout inline.toml: 6 ranks, 2 pipeline(s), global batch 6, schedule 1f1b"
    assert RANK_TABLE_HEADER in lines
    for g in plan.groups:  # no domains declared: only shared-memory boundaries say how they travel
        assert f"  {g.name:<28} ranks {list(g.ranks)}" + ("  via shm" if g.transport == SHM else "") in lines
    for pi, pipe in enumerate(plan.schedules):
        grid = sched.format_grid([list(a) for a in pipe])
        assert f"pipeline {pi} schedule:\n{grid}" in text
