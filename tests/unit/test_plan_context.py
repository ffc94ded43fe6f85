"""Context parallelism in the planner (plan.max_cp, a stage's cp): ring traffic, overlap, memory and gradient
sync against hand-computed numbers; the search against the exhaustive reference with CP allowed; --evaluate and
the written layout with cp stages; the one-line errors. Torch-free, one process."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
from test_planner import SMALL

from bench.planner.plan_exhaustive import reference
from hetero_llm import layout as layout_mod
from hetero_llm.errors import LayoutError
from hetero_llm.planner import context, plan_cluster
from hetero_llm.planner.candidates import Candidate, PipelineChoice, StageChoice, TPGroup
from hetero_llm.planner.cluster import load_cluster
from hetero_llm.planner.cost import PlannerCostModel
from hetero_llm.planner.evaluate import evaluate
from hetero_llm.planner.output import layout_text, to_json
from hetero_llm.planner.search import Planner

ROOT = Path(__file__).resolve().parents[2]
LLAMA_32K = ROOT / "layouts" / "clusters" / "llama7b_32k.toml"


def small(tmp_path, seq_len: int = 256, max_cp: int = 2, extra: str = "") -> Path:
    text = SMALL.read_text().replace("seq_len = 16", f"seq_len = {seq_len}")
    text = text.replace("max_tp = 2\n", f"max_tp = 2\nmax_cp = {max_cp}\n{extra}", 1)
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return path


def cp_wins(tmp_path) -> Path:
    """small_cpu.toml where a CP 2 stage is the optimum: 1024 tokens, one row a step."""
    path = small(tmp_path, seq_len=1024)
    path.write_text(path.read_text().replace("global_batch = 8", "global_batch = 1"))
    return path


def group(cluster, node: str, n: int, cp: int) -> TPGroup:
    nd = cluster.node(node)
    return TPGroup(nd.name, nd.domain, tuple(f"{node}:{i}" for i in range(n)), nd.kind, cp)


def test_ring_traffic_and_overlap_by_hand():
    """Llama-7B at 32K, TP 4 x CP 2 on an A100 node: each ring step sends 2 x 16384 tokens x 8 KV heads x 128 x 2
    bytes = 64 MiB over NVLink (2400 Gbit/s at its NCCL fraction); forward, the one step hides behind a block
    of half the rank's attention when that is longer; backward the K/V hide behind the first block, their
    float32 gradients (twice the bytes of bf16) behind the second, and the last gradients come home exposed."""
    c = load_cluster(LLAMA_32K)
    cost = PlannerCostModel(c)
    g = group(c, "a0", 8, 2)
    assert g.tp == 4
    assert context.ring_bytes(cost, g, 1) == 2 * 16384 * 8 * 128 * 2 == 64 * 2**20
    kind = g.kind
    bw = 2400e9 * kind.link_fraction / 8
    attn_f, attn_b = cost.roofline.attention(kind, 1, 4, 2)
    f, b = context.ring_exposed(cost, g, 1)
    kv, dkv = 64 * 2**20 / bw + cost.p2p_latency, 128 * 2**20 / bw + cost.p2p_latency
    assert f == pytest.approx(max(0.0, kv - attn_f / 2))
    assert b == pytest.approx(max(0.0, kv - attn_b / 2) + max(0.0, dkv - attn_b / 2) + dkv)
    # at 32K the attention's blocks hide the ring on NVLink but the last gradients; over a link 1000x slower not
    assert f == 0.0 and b == pytest.approx(dkv)
    slow = attrs.evolve(g, kind=attrs.evolve(kind, link_gbps=2.4))
    f, b = context.ring_exposed(cost, slow, 1)
    assert f == pytest.approx(64 * 2**20 / (2.4e9 * kind.link_fraction / 8) + cost.p2p_latency - attn_f / 2)
    assert context.ring_exposed(cost, group(c, "a0", 8, 1), 1) == (0.0, 0.0)
    # cp_overlap = false: every transfer waited for (backward the K/V and the gradients at once, then the last)
    off = context.ring_exposed(cost, attrs.evolve(g, overlap=False), 1)
    assert off == pytest.approx((kv, kv + dkv - cost.p2p_latency + dkv))


def test_ring_overlap_at_cp_4_by_hand():
    """CP 4 over a slow link: forward 3 K/V steps past their blocks; backward the first block hides the next K/V,
    the two middle ones the K/V and the previous gradients together, the last one the gradients, and the last
    gradients come home; without overlap 3 forward transfers, 3 K/V + gradients and the last gradients."""
    c = load_cluster(LLAMA_32K)
    cost = PlannerCostModel(c)
    g = group(c, "a0", 8, 4)
    g = attrs.evolve(g, kind=attrs.evolve(g.kind, link_gbps=24))
    bw, lat = 24e9 * g.kind.link_fraction / 8, cost.p2p_latency
    nbytes = context.ring_bytes(cost, g, 1)
    kv, dkv = nbytes / bw + lat, 2 * nbytes / bw + lat
    attn_f, attn_b = cost.roofline.attention(g.kind, 1, g.tp, 4)
    bf, bb = attn_f / 4, attn_b / 4
    f, b = context.ring_exposed(cost, g, 1)
    assert f == pytest.approx(3 * max(0.0, kv - bf))
    middle = max(0.0, kv + dkv - lat - bb)
    assert b == pytest.approx(max(0.0, kv - bb) + 2 * middle + max(0.0, dkv - bb) + dkv)
    assert context.ring_exposed(cost, attrs.evolve(g, overlap=False), 1) == pytest.approx(
        (3 * kv, 3 * (kv + dkv - lat) + dkv)
    )
    assert f < 3 * kv and b < 3 * (kv + dkv - lat) + dkv  # overlap hides some of it


def test_cp_stage_time_on_a_flop_priced_kind_by_hand(tmp_path):
    """A FLOP-priced stage of 2 devices as CP 2 (TP 1): half the forward FLOPs of its rows per device, no TP
    all-reduce, and the ring's exposed steps: (2 - 1) x max(0, K/V bytes / link - half the attention), over a
    link slow enough (10 Mbit/s) that the attention does not hide it."""
    c = load_cluster(small(tmp_path, seq_len=64))
    cost = PlannerCostModel(c)
    g = group(c, "fast0", 2, 2)
    g = attrs.evolve(g, kind=attrs.evolve(g.kind, link_gbps=0.01))
    rows, layers = 4, 3
    f, b, w, comm = cost.stage_times(g, layers, False, rows, False)
    speed = 2 * 0.01e12  # two devices of the cpu2x kind
    H, S = 32, 64
    nbytes = 2 * rows * S / 2 * 4 * 8 * 4  # K and V of 4 heads of 8, float32
    link = 0.01e9 / 8
    attn = rows * 2 * S * S * H / speed
    ring_f = max(0.0, nbytes / link - attn / 2)
    ring_b = 2 * max(0.0, nbytes / link - 2 * attn / 2) + nbytes / link  # float32: gradients as many bytes as K/V
    assert f == pytest.approx(rows * layers * cost.layer_forward_flops() / speed + layers * ring_f)
    assert b == pytest.approx(2 * rows * layers * cost.layer_forward_flops() / speed + layers * ring_b)
    assert comm == pytest.approx(layers * (ring_f + ring_b)) and comm > 0


def test_cp_memory_and_gradient_sync_by_hand():
    """A CP 2 stage holds half the activations (and logits) of its TP group alone, the same parameters; its CP
    ranks all-reduce the stage's gradients over NVLink."""
    c = load_cluster(LLAMA_32K)
    cost = PlannerCostModel(c)
    g2, g1 = group(c, "a0", 8, 2), group(c, "a0", 4, 1)
    assert g2.tp == g1.tp == 4
    layers, rows = 4, 1
    per_token = cost.layer_activation_bytes(4)

    def mem(g, in_flight: float, last=False):  # ``in_flight`` whole microbatches held, nothing put off, no gradients
        return cost.stage_memory(g, layers, False, last, rows, False, ((in_flight, 0.0, 0.0),))

    # two more microbatches in flight: 2 x layers x tokens x bytes per token, the tokens halved by CP
    assert mem(g1, 3.0) - mem(g1, 1.0) == pytest.approx(2 * layers * 32768 * per_token)
    assert mem(g2, 3.0) - mem(g2, 1.0) == pytest.approx(2 * layers * 16384 * per_token)
    # the last stage: the same parameters, half the activations, half the head's saved tensors and half the logits'
    # gradients (float32 and bf16)
    head = cost.head_activation_bytes(4) + 32000 * (4 + 2)
    assert mem(g1, 1.0, True) - mem(g2, 1.0, True) == pytest.approx((layers * per_token + head) * 32768 / 2)
    cand = Candidate((PipelineChoice(4, 4, (StageChoice(g2, 32),)),))
    nbytes = cost.stage_params(4, 32, True, True) * 4
    assert context.cp_sync_time(cost, cand) == pytest.approx(nbytes / (2400e9 * g2.kind.link_fraction / 8))
    sync, _ = cost.sync_and_optimizer(cand)
    assert sync == pytest.approx(context.cp_sync_time(cost, cand))  # one pipeline: no sync between pipelines


def test_search_agrees_with_the_exhaustive_reference_with_cp_allowed(tmp_path):
    """small_cpu.toml at 1024 tokens, one row a step, with plan.max_cp = 2: the reference enumerates every group's
    TP x CP shape, and its optimum (a CP 2 stage: TP 2's all-reduces of the whole row cost more than the ring's
    exposed gradients and the CP gradient sync; with 8 rows data parallelism wins) is the search's."""
    c = load_cluster(cp_wins(tmp_path))
    structures = Planner(c).all_structures(10**6, subsets=True)
    assert structures is not None and any(g.cp == 2 for st in structures for p in st.pipelines for g in p)
    optimum, _ = reference(c)
    res = plan_cluster(c)
    assert res.score.step_time == pytest.approx(optimum, rel=1e-9)
    assert any(s.group.cp == 2 for p in res.best.pipelines for s in p.stages)
    assert all(len({s.group.cp for s in p.stages}) == 1 for p in res.best.pipelines)


def test_default_max_cp_enumerates_no_cp():
    pl = Planner(load_cluster(SMALL))
    structures = pl.all_structures(10**6, subsets=True)
    assert structures is not None and all(g.cp == 1 for st in structures for p in st.pipelines for g in p)
    assert pl.cp_sizes(2) == [1]


def test_written_layout_carries_cp_and_evaluate_prices_it(tmp_path):
    """The plan's layout says each stage's cp, loads as a layout (the runtime's validation), and --evaluate of
    it predicts the search's step time; with cp_overlap = false every ring transfer is priced exposed."""
    path = cp_wins(tmp_path)
    c = load_cluster(path)
    res = plan_cluster(c)
    text = layout_text(c, res.best, res.score, None)
    assert "cp = 2" in text
    out = tmp_path / "plan.toml"
    out.write_text(text)
    lay = layout_mod.load(out)
    assert {st.cp for p in lay.pipelines for st in p.stages} == {
        s.group.cp for p in res.best.pipelines for s in p.stages
    }
    ev = evaluate(c, lay, str(out))
    assert ev.score.step_time == pytest.approx(res.score.step_time, rel=1e-12)
    assert ev.devices == sum(len(s.group.devices) for p in res.best.pipelines for s in p.stages)
    stages = [s for p in to_json(res.best, res.score)["pipelines"] for s in p["stages"]]
    assert [s.get("cp", 1) for s in stages] == [s.group.cp for p in res.best.pipelines for s in p.stages]
    off = tmp_path / "off.toml"
    off.write_text(text.replace("cp = 2", "cp = 2\ncp_overlap = false"))
    lay_off = layout_mod.load(off)
    assert [st.cp_overlap for p in lay_off.pipelines for st in p.stages if st.cp > 1] == [False]
    ev_off = evaluate(c, lay_off, str(off))
    (group_off,) = [s.group for p in ev_off.candidate.pipelines for s in p.stages if s.group.cp > 1]
    cost = PlannerCostModel(c)
    hidden, exposed = (
        context.ring_exposed(cost, attrs.evolve(group_off, overlap=True), 1),
        context.ring_exposed(cost, group_off, 1),
    )
    assert exposed[0] > hidden[0] and exposed[1] > hidden[1]
    assert ev_off.score.step_time > ev.score.step_time


@pytest.mark.parametrize(
    "extra,edit,what",
    [
        (
            "",
            lambda t: t.replace("max_cp = 2", "max_cp = 0"),
            "plan.max_cp: must be >= 1 (1 = no context parallelism), got 0",
        ),
        (
            'attention = "unfused"\n',
            None,
            "plan.max_cp: context parallelism is priced for flash attention only, but plan.attention is 'unfused' "
            "(set plan.max_cp = 1, or plan.attention = 'flash')",
        ),
        (
            "",
            lambda t: t.replace("[train]\n", '[train]\ncompile = "blocks"\n', 1),
            "plan.max_cp: 2: train.compile = 'blocks' cannot compile the ring attention of context parallelism "
            "(set plan.max_cp = 1, or train.compile = 'none')",
        ),
    ],
)
def test_bad_cp_limits_are_one_line_errors(tmp_path, extra, edit, what):
    path = small(tmp_path, extra=extra)
    if edit:
        path.write_text(edit(path.read_text()))
    with pytest.raises(LayoutError) as e:
        load_cluster(path)
    assert str(e.value) == f"{path}: {what}"


def test_buckets_search_cp_and_the_static_baseline_uses_it_where_faster(tmp_path, monkeypatch):
    """``--buckets`` with plan.max_cp = 2 (issue 36): the static baseline the buckets are priced against is the best
    static plan with CP (faster than without it here), and every bucket's own search may use CP too."""
    from hetero_llm import api
    from hetero_llm.switching import propose

    path = cp_wins(tmp_path)
    path.write_text(path.read_text().replace('kind = "grammar"\n', 'kind = "grammar"\npacking = "documents"\n', 1))
    searched = []
    real = propose.plan_cluster
    monkeypatch.setattr(propose, "plan_cluster", lambda c, top: searched.append(c) or real(c, top=top))
    planned = api.plan_cluster(path, buckets="256")
    best = planned.result.best
    assert any(s.group.cp == 2 for p in best.pipelines for s in p.stages)
    assert planned.verdict.static_s == planned.result.score.step_time
    c = load_cluster(path)
    without = plan_cluster(attrs.evolve(c, limits=attrs.evolve(c.limits, max_cp=1)), top=1)
    assert without.score.step_time > planned.verdict.static_s
    assert searched and all(c.limits.max_cp == 2 and c.model.seq_len == 256 for c in searched)


def test_evaluate_refuses_cp_with_unfused_attention(tmp_path):
    """A layout with a CP stage, evaluated on a cluster file that prices unfused attention: one located line."""
    path = small(tmp_path, max_cp=1, extra='attention = "unfused"\n')
    text = path.read_text().split("[plan]")[0]
    pipes = '[[pipelines]]\nbatch = 8\nmicrobatches = 8\n[[pipelines.stages]]\nlayers = 8\ndevices = ["fast0:0", "fast0:1"]\ncp = 2\n'
    lay_path = tmp_path / "layout.toml"
    lay_path.write_text(text + pipes)
    lay = layout_mod.load(lay_path)
    with pytest.raises(LayoutError) as e:
        evaluate(load_cluster(path), lay, str(lay_path))
    assert str(e.value) == (
        f"{lay_path}: pipelines[0].stages[0].cp: 2: context parallelism is priced for flash attention only, but the "
        "cluster file's plan.attention is 'unfused' (evaluate it with cp = 1, or plan.attention = 'flash')"
    )
