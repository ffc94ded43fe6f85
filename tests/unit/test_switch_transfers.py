"""The hot-switch planner, checked by executing its transfers on numpy arrays.

For a pair of layouts over the same devices: parameters laid out by the source plan, moved by the
switch plan, must equal the target plan's shards of the same full tensors; per-stage gradient
partials moved by it must keep their sum, and the copies inside each target stage must stay equal.
Then the choice of senders: a local copy when the block is already there, the same node first, the
same domain next, the least-loaded among equals.
"""

from __future__ import annotations

import numpy as np
import pytest

from harness import sections
from hetero_llm import layout as layout_mod
from hetero_llm.model.params import all_params
from hetero_llm.plan import compile_plan
from hetero_llm.switching.predict import switch_seconds
from hetero_llm.switching.transfers import LINKS, holders, plan_switch

MODEL = """[model]
layers = 4
hidden = 24
heads = 6
vocab = 64
seq_len = 8
ffn = 48
[train]
steps = 1
global_batch = 12
"""


def make_plan(pipelines: list, nodes: dict[str, int], domains: dict[str, str] | None = None):
    """A plan over ``nodes`` (name -> devices) with pipelines [(batch, [(layers, devices)])] (a stage may add its
    ``cp``: (layers, devices, cp))."""
    model, train, data = sections(MODEL)
    kinds = sorted(set((domains or {}).values()))
    cluster = layout_mod.ClusterSpec(
        nodes=tuple(
            layout_mod.NodeSpec(name=name, devices=("cpu",) * n, domain=(domains or {}).get(name, ""))
            for name, n in nodes.items()
        ),
        domains=tuple(
            layout_mod.DomainSpec(name=kind, kind=layout_mod.DomainKind.ETHERNET, bandwidth_gbps=10.0, latency_us=50.0)
            for kind in kinds
        ),
    )
    pipes = tuple(
        layout_mod.PipelineSpec(
            batch=batch,
            microbatches=1,
            stages=tuple(
                layout_mod.StageSpec(layers=st[0], devices=tuple(st[1]), cp=st[2] if len(st) > 2 else 1)
                for st in stages
            ),
        )
        for batch, stages in pipelines
    )
    made = layout_mod.Layout(file="<string>", model=model, train=train, data=data, cluster=cluster, pipelines=pipes)
    return compile_plan(layout_mod.loads(layout_mod.dumps(made)))


FOUR = {"n0": 2, "n1": 2}
DP4 = [(3, [(4, ["n0:0"])]), (3, [(4, ["n0:1"])]), (3, [(4, ["n1:0"])]), (3, [(4, ["n1:1"])])]
TP2_DP2 = [(6, [(4, ["n0:0", "n0:1"])]), (6, [(4, ["n1:0", "n1:1"])])]
PP2_TP2 = [(12, [(2, ["n0:0", "n0:1"]), (2, ["n1:0", "n1:1"])])]
TP3 = [(12, [(4, ["n0:0", "n0:1", "n1:0"])])]
TP2_ON_TWO_NODES = [(12, [(4, ["n0:1", "n1:1"])])]
ASYMMETRIC = [(8, [(1, ["n0:0"]), (3, ["n1:0", "n1:1"])]), (4, [(4, ["n0:1"])])]
CP2_TP2 = [(12, [(4, ["n0:0", "n0:1", "n1:0", "n1:1"], 2)])]  # CP rank 0 on n0, rank 1 on n1: partials of each
CP4 = [(12, [(4, ["n0:0", "n0:1", "n1:0", "n1:1"], 4)])]
LAYOUTS = {
    "cp2 x tp2": CP2_TP2,
    "cp4": CP4,
    "dp4": DP4,
    "tp2 x dp2": TP2_DP2,
    "pp2 x tp2": PP2_TP2,
    "tp3": TP3,
    "tp2 over nodes": TP2_ON_TWO_NODES,
    "asymmetric": ASYMMETRIC,
}
PAIRS = [
    ("dp4", "tp2 x dp2"),
    ("tp2 x dp2", "pp2 x tp2"),
    ("pp2 x tp2", "dp4"),
    ("tp2 x dp2", "tp3"),
    ("tp3", "tp2 x dp2"),
    ("asymmetric", "tp3"),
    ("dp4", "asymmetric"),
    ("tp2 over nodes", "dp4"),
    ("dp4", "dp4"),
    ("dp4", "cp2 x tp2"),  # context-parallel ranks hold the stage's parameters like replicas and their own partials
    ("cp2 x tp2", "tp3"),
    ("cp4", "pp2 x tp2"),
    ("cp2 x tp2", "cp4"),
]


# ---------------------------------------------------------------------------------------------- executing a plan


def _region(dim: int, lo: int, hi: int, ndim: int) -> tuple:
    return (slice(None),) * dim + (slice(lo, hi),) + (slice(None),) * (ndim - dim - 1)


def _shards(plan, full_of_stage) -> dict[tuple[str, str], np.ndarray]:
    """(device, name) -> that device's shard, cut from ``full_of_stage(stage label, name)``."""
    out = {}
    for name, hs in holders(plan).items():
        info = next(i for i in all_params(plan.layout.model) if i.name == name)
        for h in hs:
            full = full_of_stage(h.stage, name)
            out[(h.device, name)] = full[_region(info.shard_dim or 0, h.lo, h.hi, full.ndim)].copy()
    return out


def execute(switch, source, target, before: dict, fill: float) -> dict:
    """Run the transfers: target shards (start at ``fill``) written or accumulated from source shards."""
    starts = {(h.device, name): h.lo for name, hs in holders(source).items() for h in hs}
    after_starts = {(h.device, name): h.lo for name, hs in holders(target).items() for h in hs}
    shapes = {i.name: i.shape for i in all_params(source.layout.model)}
    after = {}
    for name, hs in holders(target).items():
        dim = next(i.shard_dim or 0 for i in all_params(source.layout.model) if i.name == name)
        for h in hs:
            shape = list(shapes[name])
            shape[dim] = h.hi - h.lo
            after[(h.device, name)] = np.full(shape, fill)
    for t in switch.transfers:
        src, s0 = before[(t.src, t.name)], starts[(t.src, t.name)]
        dst, d0 = after[(t.dst, t.name)], after_starts[(t.dst, t.name)]
        block = src[_region(t.dim, t.lo - s0, t.hi - s0, src.ndim)]
        where = _region(t.dim, t.lo - d0, t.hi - d0, dst.ndim)
        if t.accumulate:
            dst[where] += block
        else:
            assert np.isnan(dst[where]).all(), f"{t}: written twice"
            dst[where] = block
    return after


@pytest.mark.parametrize("a,b", PAIRS, ids=[f"{a} -> {b}" for a, b in PAIRS])
def test_parameters_arrive_where_the_target_layout_holds_them(a, b):
    source, target = make_plan(LAYOUTS[a], FOUR), make_plan(LAYOUTS[b], FOUR)
    rng = np.random.default_rng(0)
    full = {i.name: rng.standard_normal(i.shape) for i in all_params(source.layout.model)}
    switch = plan_switch(source, target, grads=False)
    after = execute(switch, source, target, _shards(source, lambda s, n: full[n]), fill=np.nan)
    want = _shards(target, lambda s, n: full[n])
    assert set(after) == set(want)
    for key, got in after.items():
        np.testing.assert_array_equal(got, want[key], err_msg=str(key))  # every element written, exactly


@pytest.mark.parametrize("a,b", PAIRS, ids=[f"{a} -> {b}" for a, b in PAIRS])
def test_gradient_sums_are_preserved_and_stage_copies_stay_equal(a, b):
    source, target = make_plan(LAYOUTS[a], FOUR), make_plan(LAYOUTS[b], FOUR)
    rng = np.random.default_rng(1)
    infos = all_params(source.layout.model)
    stages = {h.stage for hs in holders(source).values() for h in hs}
    partial = {(s, i.name): rng.standard_normal(i.shape) for s in stages for i in infos}
    switch = plan_switch(source, target)
    after = execute(attrs_grads(switch), source, target, _shards(source, lambda s, n: partial[(s, n)]), fill=0.0)
    for info in infos:
        want = sum(partial[(s, info.name)] for s in {h.stage for h in holders(source)[info.name]})
        total = np.zeros(info.shape)
        per_stage: dict[str, np.ndarray] = {}
        dim = info.shard_dim or 0
        for h in holders(target)[info.name]:
            full = per_stage.setdefault(h.stage, np.full(info.shape, np.nan))
            region = _region(dim, h.lo, h.hi, len(info.shape))
            got = after[(h.device, info.name)]
            seen = ~np.isnan(full[region])
            np.testing.assert_array_equal(full[region][seen], got[seen], err_msg=f"{info.name}: TP copies differ")
            full[region] = got
        for full in per_stage.values():
            assert not np.isnan(full).any()
            total += full
        np.testing.assert_allclose(total, want, rtol=1e-12, atol=1e-12, err_msg=info.name)


def attrs_grads(switch):
    """The switch with its gradient transfers only (the parameter ones would write the wrong arrays)."""
    import attrs

    return attrs.evolve(switch, params=())


# ---------------------------------------------------------------------------------------------- senders


def test_the_same_layout_switches_by_local_copies_only():
    plan = make_plan(TP2_DP2, FOUR)
    switch = plan_switch(plan, plan)
    assert all(t.local for t in switch.transfers)
    assert switch.messages() == {} and switch.bytes_by_link()["node"] == 0


def test_a_block_already_on_the_device_is_copied_locally():
    """DP 4 -> TP 2 x DP 2: every parameter a TP rank needs is on its device already (a DP replica)."""
    switch = plan_switch(make_plan(DP4, FOUR), make_plan(TP2_DP2, FOUR))
    assert all(t.local for t in switch.params)
    # Gradients: the other DP replica's partial crosses the network, inside the node.
    links = {switch.link_of[(t.src, t.dst)] for t in switch.grads}
    assert links == {"local", "node"}


def test_sender_on_the_same_node_first_then_the_same_domain():
    nodes = {"a": 2, "b": 2, "c": 2}
    domains = {"a": "ib", "b": "ib", "c": "eth"}
    # Source: replicas on b:0 (same domain as a) and c:0 (other domain), and a:0 (same node as a:1).
    source = make_plan([(4, [(4, ["c:0"])]), (4, [(4, ["b:0"])]), (4, [(4, ["a:0"])])], nodes, domains)
    target = make_plan([(12, [(4, ["a:1"])])], nodes, domains)
    switch = plan_switch(source, target, grads=False)
    assert {t.src for t in switch.params} == {"a:0"}  # same node
    source = make_plan([(6, [(4, ["c:0"])]), (6, [(4, ["b:0"])])], nodes, domains)
    switch = plan_switch(source, target, grads=False)
    assert {t.src for t in switch.params} == {"b:0"}  # same domain beats the other domain
    assert switch.bytes_by_link()["cross_domain"] == 0 and switch.bytes_by_link()["domain"] > 0


def test_senders_share_the_load():
    """Two full replicas on n0, two receivers on n1 needing everything: the bytes split about evenly."""
    source = make_plan([(6, [(4, ["n0:0"])]), (6, [(4, ["n0:1"])])], FOUR)
    target = make_plan([(6, [(4, ["n1:0"])]), (6, [(4, ["n1:1"])])], FOUR)
    switch = plan_switch(source, target, grads=False)
    sent = {d: s for d, (s, _) in switch.bytes_by_device().items() if s}
    assert set(sent) == {"n0:0", "n0:1"}
    largest = max(t.nbytes for t in switch.params)
    assert abs(sent["n0:0"] - sent["n0:1"]) <= largest
    model_bytes = sum(4 * int(np.prod(i.shape)) for i in all_params(source.layout.model))
    assert {d: r for d, (_, r) in switch.bytes_by_device().items() if r} == {"n1:0": model_bytes, "n1:1": model_bytes}


def test_gradient_partials_go_to_the_stage_on_their_own_devices():
    """TP 2 -> DP 2 on the same two devices: each TP shard's partial lands on its own device, no traffic."""
    source = make_plan([(12, [(4, ["n0:0", "n0:1"])])], FOUR)
    target = make_plan([(6, [(4, ["n0:0"])]), (6, [(4, ["n0:1"])])], FOUR)
    switch = plan_switch(source, target)
    assert all(t.local for t in switch.grads)
    assert not all(t.local for t in switch.params)  # parameters do move: each replica needs the whole model


def test_layouts_of_different_models_are_refused():
    a = make_plan(DP4, FOUR)
    other = compile_plan(
        layout_mod.loads(
            MODEL.replace("layers = 4", "layers = 2") + "[cluster]\n[[cluster.nodes]]\n"
            'name = "n0"\ndevices = ["cpu"]\n[[pipelines]]\nbatch = 12\n'
            'microbatches = 1\n[[pipelines.stages]]\nlayers = 2\ndevices = ["n0:0"]\n'
        )
    )
    with pytest.raises(ValueError, match="same \\[model\\]"):
        plan_switch(a, other)


def test_describe_names_the_links_and_the_busiest_device():
    switch = plan_switch(make_plan(TP3, FOUR), make_plan(DP4, FOUR), source_name="tp3", target_name="dp4")
    text = switch.describe()
    assert text.startswith("switch tp3 -> dp4: ")
    assert "cross_domain 0.00 MiB" in text and "busiest device" in text


def test_adjacent_blocks_merge_into_one_transfer():
    """TP 2 -> TP 3 cuts wq at rows 8, 12, 16 (of 24); a TP 3 rank whose third spans two source shards gets two
    pieces, but a whole replica sent to one receiver is one transfer per tensor."""
    tp2 = make_plan([(12, [(4, ["n0:0", "n0:1"])])], FOUR)
    tp3 = make_plan(TP3, FOUR)
    wq = [t for t in plan_switch(tp2, tp3, grads=False).params if t.name == "layers.0.attn.wq"]
    assert sorted((t.lo, t.hi, t.src, t.dst) for t in wq) == [
        (0, 8, "n0:0", "n0:0"),
        (8, 12, "n0:0", "n0:1"),
        (12, 16, "n0:1", "n0:1"),
        (16, 24, "n0:1", "n1:0"),
    ]
    one = make_plan([(12, [(4, ["n0:0"])])], FOUR)
    to_other = plan_switch(one, make_plan([(12, [(4, ["n1:0"])])], FOUR), grads=False)
    assert len(to_other.params) == len(all_params(one.layout.model))


def test_predicted_time_is_the_busiest_device_latency_and_bytes():
    """Two replicas on n0 send everything to two receivers on n1: each receiver takes the model's bytes
    (``switching.predict.switch_seconds`` with every link kind alike: 1 GB/s, 1 ms)."""
    one_link = {k: (1e-3, 1e9) for k in LINKS}
    source = make_plan([(6, [(4, ["n0:0"])]), (6, [(4, ["n0:1"])])], FOUR)
    target = make_plan([(6, [(4, ["n1:0"])]), (6, [(4, ["n1:1"])])], FOUR)
    switch = plan_switch(source, target, grads=False)
    model_bytes = sum(4 * int(np.prod(i.shape)) for i in all_params(source.layout.model))
    messages_of_receiver = sum(1 for _, dst in switch.messages() if dst == "n1:0")
    want = messages_of_receiver * 1e-3 + model_bytes / 1e9
    assert switch_seconds(switch, one_link) == pytest.approx(want)
    # with a copy bandwidth, a receiver also unpacks every byte it receives out of its flat messages, once
    assert switch_seconds(switch, one_link, copy_bandwidth=1e10) == pytest.approx(want + model_bytes / 1e10)
    same = plan_switch(source, source)  # local copies only: free, unless copies have a bandwidth
    assert switch_seconds(same, one_link) == 0.0
    assert switch_seconds(same, one_link, copy_bandwidth=1e10) == pytest.approx(2 * model_bytes / 1e10)
    blocks = sum(1 for t in same.transfers if t.dst == "n0:0")
    assert switch_seconds(same, one_link, block_overhead=1e-5) == pytest.approx(blocks * 1e-5)
    # a switch that moves gradients first allocates (and zeroes) a gradient buffer per target parameter tensor
    tensors = len(source.params_of(0))
    assert same.grad_buffers == {"n0:0": tensors, "n0:1": tensors}
    assert switch_seconds(same, one_link, buffer_overhead=1e-4) == pytest.approx(tensors * 1e-4)
    assert switch.grad_buffers == {} and switch_seconds(switch, one_link, buffer_overhead=1.0) == pytest.approx(want)


@pytest.mark.parametrize("a,b", [("cp2 x tp2", "dp4"), ("cp4", "tp2 x dp2")])
def test_every_context_parallel_ranks_partial_gradient_is_moved(a, b):
    """The CP ranks of a stage hold the gradients of their own positions: each TP group's partial (found from the
    plan's ranks, not from ``holders``' labels) reaches the target once, so the target's sum is the whole."""
    source, target = make_plan(LAYOUTS[a], FOUR), make_plan(LAYOUTS[b], FOUR)
    rng = np.random.default_rng(2)
    infos = {i.name: i for i in all_params(source.layout.model)}
    group_of = {r.device_id: (r.pipeline, r.stage, r.cp_index) for r in source.ranks}
    partial = {(g, n): rng.standard_normal(i.shape) for g in set(group_of.values()) for n, i in infos.items()}
    before = {}
    for name, hs in holders(source).items():
        for h in hs:
            full = partial[(group_of[h.device], name)]
            before[(h.device, name)] = full[_region(infos[name].shard_dim or 0, h.lo, h.hi, full.ndim)].copy()
    after = execute(attrs_grads(plan_switch(source, target)), source, target, before, fill=0.0)
    for name, info in infos.items():
        want = sum(partial[(g, name)] for g in set(group_of.values()))
        per_stage: dict[str, np.ndarray] = {}  # a target without cp: its TP copies of a block are equal
        for h in holders(target)[name]:
            full = per_stage.setdefault(h.stage, np.zeros(info.shape))
            full[_region(info.shard_dim or 0, h.lo, h.hi, len(info.shape))] = after[(h.device, name)]
        np.testing.assert_allclose(sum(per_stage.values()), want, rtol=1e-12, atol=1e-12, err_msg=name)
