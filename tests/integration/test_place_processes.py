"""The tests of tests/unit/test_place.py that start processes or train for real (the integration tier).

NIC-aware placement (hetero_llm/planner/place.py) against its written rules, on several clusters, and one
placed layout trained against the single-process reference (layout invariance).

Rules: TP inside a node; every stage's DP group (the same layers in every pipeline) inside one domain;
a pipeline crosses domains exactly (domains - 1) times; layers by speed, capped by memory; rows by
pipeline throughput.
"""

from __future__ import annotations

import pytest
from helpers_place import check_rules, domain

from harness import LAYOUTS, assert_same_model, common_sections, launch, sections
from hetero_llm import layout
from hetero_llm.layout import ClusterSpec, CrossDomainSpec, NodeSpec
from hetero_llm.planner.place import PlaceOptions, place_file


@pytest.mark.multiprocess
def test_placed_layout_with_uneven_speeds_trains_the_reference_model(tmp_path, shared_launch):
    """A fast two-device node in one domain, two slower nodes in the other: 4 ranks, layers 4 + 2."""
    model, train, data = sections(common_sections(LAYOUTS / "reference" / "reference.toml"))
    cluster = ClusterSpec(
        nodes=(
            NodeSpec(name="f0", devices=("cpu", "cpu"), speed=2.0, domain="fast"),
            NodeSpec(name="s0", domain="slow"),
            NodeSpec(name="s1", domain="slow"),
        ),
        domains=(domain("fast"), domain("slow", "roce")),
        cross_domain=CrossDomainSpec(gloo_ifname="xdom"),
    )
    (tmp_path / "cluster.toml").write_text(
        layout.dumps_cluster({"model": model, "train": train, "data": data, "cluster": cluster})
    )
    place_file(tmp_path / "cluster.toml", tmp_path / "placed.toml", PlaceOptions())
    lay = layout.load(tmp_path / "placed.toml")
    assert [[s.layers for s in pipe.stages] for pipe in lay.pipelines] == [[4, 2], [4, 2]]
    check_rules(lay)
    ref = shared_launch(LAYOUTS / "reference" / "reference.toml")  # the run other modules compare with too
    run = launch(tmp_path / "placed.toml", tmp_path / "run")
    assert_same_model(run, ref)
    # no dom0/xdom on this host: each node says once that its groups use the default interface
    warnings = [line for line in run.stderr.splitlines() if line.startswith("warning: ")]
    assert sorted(w.split(":")[1].strip() for w in warnings) == ["f0", "s0", "s1"], run.stderr
