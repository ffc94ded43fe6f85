"""Layouts with NIC domains on the emulated testbed (bench/comm/holmes_bench.py): each group's traffic goes
over its transport's interface. Needs root and network namespaces (skipped otherwise, with the reason).

Counted in bytes each node sent: a NIC-aware layout (DP inside domains, the pipeline boundary across)
sends its gradient sync over dom0 and only activations over xdom; a naive one (DP across domains, each
pipeline inside one domain) sends the gradient sync over xdom and its activations over dom0. This is
what the per-group GLOO_SOCKET_IFNAME binding in ``groups.init`` buys; without it every byte would take
the default group's interface.
"""

from __future__ import annotations

import pytest

from bench import testbed
from bench.comm import holmes_bench
from hetero_llm import layout
from hetero_llm.planner.place import PlaceOptions, place_file

pytestmark = [pytest.mark.netns, pytest.mark.multiprocess]


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    ok, why = testbed.available()
    if not ok:
        pytest.skip(f"needs root and Linux network namespaces; runs on the CI machine and developer machines ({why})")
    d = tmp_path_factory.mktemp("holmes")
    src = d / "cluster.toml"
    src.write_text(
        holmes_bench.cluster_file(
            hidden=128,
            layers=2,
            heads=4,
            seq_len=16,
            batch=4,
            steps=2,
            domain_gbps=1.0,
            domain_us=50,
            cross_gbps=0.2,
            cross_us=500,
        )
    )
    place_file(src, d / "aware.toml", PlaceOptions())
    holmes_bench.naive_layout(src, d / "naive.toml", 2)
    return d / "aware.toml", d / "naive.toml"


def test_testbed_is_built_from_the_layout(layouts):
    spec = holmes_bench.testbed_spec(layout.load(layouts[0]))
    assert [(d.name, d.fabric) for d in spec.domains] == [
        ("ib", testbed.FabricSpec("1000mbit", "50us")),
        ("roce", testbed.FabricSpec("1000mbit", "50us")),
    ]
    assert spec.cross == testbed.FabricSpec("200mbit", "500us")
    assert [(n.name, n.domain) for n in spec.nodes] == [
        ("node0", "ib"),
        ("node1", "ib"),
        ("node2", "roce"),
        ("node3", "roce"),
    ]
    fast = holmes_bench.testbed_spec(layout.load(layouts[0]), cross_like_domains=True)
    assert fast.cross == fast.domains[0].fabric


def test_gradient_sync_takes_the_domain_fabric_only_when_dp_stays_in_domains(layouts, tmp_path):
    aware, naive = layouts
    lay = layout.load(aware)
    with testbed.Testbed(holmes_bench.testbed_spec(lay)) as tb:
        a = holmes_bench.run_layout(tb, aware, tmp_path / "a", steps=2, warmup=0, port=29660)
        b = holmes_bench.run_layout(tb, naive, tmp_path / "b", steps=2, warmup=0, port=29661)
    # every parameter is summed once per step across the two pipelines: ~ its bytes, both ways
    params_mb = 4 * sum(_numel(p.shape) for p in _all_params(lay)) / 1e6
    assert a.sent_mb["dom0"] > params_mb and a.sent_mb["xdom"] < params_mb / 4, a.sent_mb
    # naive: the gradient sync crosses domains; each pipeline's stage boundary stays in its domain, so dom0
    # carries the ib pipeline's activations and their gradients (2 steps, both directions) and nothing more
    naive = layout.load(naive)
    m = naive.model
    boundary_mb = 2 * 2 * naive.pipelines[0].batch * m.seq_len * m.hidden * 4 / 1e6
    assert b.sent_mb["xdom"] > params_mb and boundary_mb <= b.sent_mb["dom0"] < 2 * boundary_mb, (
        b.sent_mb,
        boundary_mb,
    )
    assert a.tokens_per_s > 0 and b.tokens_per_s > 0
    assert "warning: " not in a.stderr + b.stderr  # dom0 and xdom exist in the namespaces: no fallback


def _all_params(lay):
    from hetero_llm.model.params import all_params

    return all_params(lay.model)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
