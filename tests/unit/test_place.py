"""NIC-aware placement (hetero_llm/planner/place.py) against its written rules, on several clusters, and one
placed layout trained against the single-process reference (layout invariance).

Rules: TP inside a node; every stage's DP group (the same layers in every pipeline) inside one domain;
a pipeline crosses domains exactly (domains - 1) times; layers by speed, capped by memory; rows by
pipeline throughput.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
from click.testing import CliRunner
from helpers_place import check_rules, domain

from harness import LAYOUTS
from hetero_llm import layout
from hetero_llm.cli.place import main as place_main
from hetero_llm.errors import LayoutError
from hetero_llm.layout import ClusterSpec, CrossDomainSpec, DataSpec, ModelSpec, NodeSpec, Schedule, TrainSpec
from hetero_llm.planner.place import PlaceOptions, pipeline_specs, place, place_file


def cluster_text(
    nodes: list[tuple[str, str, int, float, float]], domains=("A", "B"), *, layers=4, batch=8, schedule="1f1b", chunks=1
) -> str:
    """``nodes``: (name, domain, devices, speed, memory_gb)."""
    model = ModelSpec(layers=layers, hidden=32, heads=4, vocab=64, seq_len=8)
    train = TrainSpec(steps=1, global_batch=batch, schedule=Schedule(schedule), chunks=chunks)
    cluster = ClusterSpec(
        nodes=tuple(
            NodeSpec(
                name=name, devices=("cpu",) * n, speed=float(speed), memory_gb=float(mem), domain=dom if domains else ""
            )
            for name, dom, n, speed, mem in nodes
        ),
        domains=tuple(domain(d) for d in domains),
        cross_domain=CrossDomainSpec(gloo_ifname="xdom"),
    )
    return layout.dumps_cluster({"model": model, "train": train, "data": DataSpec(), "cluster": cluster})


def placed(tmp_path: Path, text: str, **options):
    src = tmp_path / "cluster.toml"
    src.write_text(text)
    p = place_file(src, tmp_path / "placed.toml", PlaceOptions(**options))
    return p, layout.load(tmp_path / "placed.toml")


def test_two_domains_of_two_nodes(tmp_path):
    nodes = [("a0", "A", 1, 1.0, 0), ("a1", "A", 1, 1.0, 0), ("b0", "B", 1, 1.0, 0), ("b1", "B", 1, 1.0, 0)]
    p, lay = placed(tmp_path, cluster_text(nodes))
    check_rules(lay)
    assert [[s.devices for s in pipe.stages] for pipe in lay.pipelines] == [
        [("a0:0",), ("b0:0",)],
        [("a1:0",), ("b1:0",)],
    ]
    assert [[s.layers for s in pipe.stages] for pipe in lay.pipelines] == [[2, 2], [2, 2]]
    assert [pipe.batch for pipe in lay.pipelines] == [4, 4]
    assert [pipe.microbatches for pipe in lay.pipelines] == [4, 4]  # 2 x stages, dividing 4
    assert p.domains == ("A", "B") and p.notes == ()


def test_uneven_gpu_counts_with_tp(tmp_path):
    """A: 4 + 2 devices, B: 2 + 3 devices, TP 2: 3 groups in A, 2 in B (one device of b1 idle) -> 2 pipelines."""
    nodes = [("a0", "A", 4, 1.0, 0), ("a1", "A", 2, 1.0, 0), ("b0", "B", 2, 1.0, 0), ("b1", "B", 3, 1.0, 0)]
    p, lay = placed(tmp_path, cluster_text(nodes, layers=6), tp=2)
    check_rules(lay)
    devices = [[s.devices for s in pipe.stages] for pipe in lay.pipelines]
    assert devices == [[("a0:0", "a0:1"), ("a0:2", "a0:3"), ("b0:0", "b0:1")], [("a1:0", "a1:1"), ("b1:0", "b1:1")]]
    # A holds the same layers in both pipelines (4 = its share by speed); pipeline 0 splits them 2 + 2
    assert [[s.layers for s in pipe.stages] for pipe in lay.pipelines] == [[2, 2, 2], [4, 2]]
    # pipeline 0's slowest stage is twice as fast: rows minimize the slower pipeline's time (6/2 and 5/3
    # both take 12 layer-rows; ties go to the earlier pipeline)
    assert [pipe.batch for pipe in lay.pipelines] == [6, 2]
    assert p.notes == ("b1: 1 of its 3 devices left unused (TP 2 groups stay inside a node)",)


def test_layers_follow_speed_across_and_inside_domains(tmp_path):
    # A is twice as fast as B: A gets 2/3 of the layers
    nodes = [("a0", "A", 1, 2.0, 0), ("a1", "A", 1, 2.0, 0), ("b0", "B", 1, 1.0, 0), ("b1", "B", 1, 1.0, 0)]
    _, lay = placed(tmp_path, cluster_text(nodes, layers=6))
    check_rules(lay)
    assert [[s.layers for s in pipe.stages] for pipe in lay.pipelines] == [[4, 2], [4, 2]]
    # one pipeline; inside A a node 3x as fast as its neighbour gets 3x the layers
    nodes = [("a0", "A", 1, 3.0, 0), ("a1", "A", 1, 1.0, 0), ("b0", "B", 1, 4.0, 0)]
    _, lay = placed(tmp_path, cluster_text(nodes, layers=16), pipelines=1)
    assert [s.layers for s in lay.pipelines[0].stages] == [6, 2, 8]


def test_memory_caps_a_stage(tmp_path):
    """A is 3x as fast, but its devices hold only 2 layers each (16 bytes per parameter, embedding on the first)."""
    model = layout.loads(
        cluster_text([("a0", "A", 1, 1.0, 0), ("b0", "B", 1, 1.0, 0)])
        + "[[pipelines]]\nbatch = 8\nmicrobatches = 1\n[[pipelines.stages]]\nlayers = 2\n"
        'devices = ["a0:0"]\n[[pipelines.stages]]\nlayers = 2\ndevices = ["b0:0"]\n'
    ).model
    from hetero_llm.model.params import embedding_params, layer_params
    from hetero_llm.planner.place import BYTES_PER_PARAM, _device_params

    need = _device_params(model, embedding_params(model), 1) + 2.5 * _device_params(model, layer_params(model, 0), 1)
    gb = need * BYTES_PER_PARAM / 1e9
    nodes = [("a0", "A", 1, 3.0, gb), ("b0", "B", 1, 1.0, 0)]
    _, lay = placed(tmp_path, cluster_text(nodes, layers=8))
    assert [s.layers for s in lay.pipelines[0].stages] == [2, 6]
    _, lay = placed(tmp_path, cluster_text([("a0", "A", 1, 3.0, 0), ("b0", "B", 1, 1.0, 0)], layers=8))
    assert [s.layers for s in lay.pipelines[0].stages] == [6, 2]  # uncapped: by speed


def test_interleaved_gets_layers_in_multiples_of_chunks(tmp_path):
    nodes = [("a0", "A", 1, 2.0, 0), ("b0", "B", 1, 1.0, 0)]
    _, lay = placed(tmp_path, cluster_text(nodes, layers=8, schedule="interleaved", chunks=2))
    assert all(s.layers % 2 == 0 for s in lay.pipelines[0].stages)
    assert lay.pipelines[0].microbatches % 2 == 0


def test_a_domain_too_small_for_every_pipeline_is_left_out(tmp_path):
    nodes = [("a0", "A", 1, 1.0, 0), ("a1", "A", 1, 1.0, 0), ("b0", "B", 1, 1.0, 0)]
    p, lay = placed(tmp_path, cluster_text(nodes), pipelines=2)
    check_rules(lay)
    assert p.domains == ("A",) and {d for pipe in lay.pipelines for s in pipe.stages for d in s.devices} == {
        "a0:0",
        "a1:0",
    }
    assert "domain B left out" in p.notes[0]


def test_without_domains_every_tp_group_is_a_pipeline(tmp_path):
    nodes = [("n0", "", 2, 1.0, 0), ("n1", "", 2, 1.0, 0)]
    _, lay = placed(tmp_path, cluster_text(nodes, domains=()))
    assert [[s.devices for s in pipe.stages] for pipe in lay.pipelines] == [
        [("n0:0",)],
        [("n0:1",)],
        [("n1:0",)],
        [("n1:1",)],
    ]
    _, lay = placed(tmp_path, cluster_text(nodes, domains=()), pipelines=1)
    assert len(lay.pipelines[0].stages) == 4


@pytest.mark.parametrize(
    "options, where, message",
    [
        (dict(tp=3), "--tp", "TP size 3 does not divide heads (4) and the MLP width (128) (pick a common divisor)"),
        (dict(tp=4), "--tp", "no node has 4 devices (the most is 1; TP stays inside a node)"),
        (
            dict(pipelines=3),
            "--pipelines",
            "no domain has 3 TP groups of 1 device(s) (the most is 2, in A): use --pipelines 2 or fewer",
        ),
    ],
)
def test_bad_options(tmp_path, options, where, message):
    nodes = [("a0", "A", 1, 1.0, 0), ("a1", "A", 1, 1.0, 0), ("b0", "B", 1, 1.0, 0), ("b1", "B", 1, 1.0, 0)]
    src = tmp_path / "cluster.toml"
    src.write_text(cluster_text(nodes))
    with pytest.raises(LayoutError) as info:
        place_file(src, tmp_path / "out.toml", PlaceOptions(**options))
    assert str(info.value) == f"{src}: {where}: {message}"
    assert not (tmp_path / "out.toml").exists()


def test_a_layout_with_pipelines_is_not_a_cluster_file():
    with pytest.raises(LayoutError) as info:
        layout.read_cluster_file(LAYOUTS / "planned" / "holmes_two_domains.toml", "placement")
    assert info.value.path == "pipelines"


def test_example_layout_is_the_placement_of_its_cluster_file(tmp_path):
    src = LAYOUTS / "clusters" / "two_domains.toml"
    _, _, sec = layout.read_cluster_file(src, "placement")
    p = place("two_domains.toml", sec["model"], sec["train"], sec["cluster"], PlaceOptions())
    committed = layout.load(LAYOUTS / "planned" / "holmes_two_domains.toml")
    assert committed.pipelines == pipeline_specs(p)
    check_rules(committed)
    out = tmp_path / "placed.toml"  # the whole written layout, not only its pipelines, is the committed one
    place_file(src, out, PlaceOptions())
    assert layout.load(out) == attrs.evolve(committed, file=str(out))
    assert out.read_text().startswith("# Placed by hetero-place from two_domains.toml: 2 pipeline(s), TP 1, ")


def test_cli_prints_the_placement_and_writes_the_layout(tmp_path):
    out = tmp_path / "placed.toml"
    result = CliRunner().invoke(place_main, [str(LAYOUTS / "clusters" / "two_domains.toml"), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "stages visit domains ib0 -> roce0 (1 cross-domain boundary per pipeline)" in result.output
    assert "  layers 0-2 in ib0: node0:0 node1:0" in result.output
    assert layout.load(out).pipelines == layout.load(LAYOUTS / "planned" / "holmes_two_domains.toml").pipelines
    bad = CliRunner().invoke(place_main, [str(LAYOUTS / "clusters" / "two_domains.toml"), "-o", str(out), "--tp", "3"])
    assert bad.exit_code == 2 and bad.output.startswith("error: ") and "--tp: TP size 3" in bad.output
