"""NIC domains (Holmes): the layout schema, which transport every plan group gets, and the environment
each rank creates a group under. Pure and single-process (the CuPy test needs CUDA and CuPy).

Rule under test: a group whose members are all in one domain uses that domain's transport; a group
spanning domains uses the cross-domain network; without declared domains every group uses the defaults.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import attrs
import pytest
from click.testing import CliRunner

from hetero_llm import layout
from hetero_llm.cli.launch import main
from hetero_llm.layout import CROSS_DOMAIN, DEFAULT_TRANSPORT, P2P, SHM, CommLib, DomainKind, loads
from hetero_llm.plan import compile_plan
from hetero_llm.plan.describe import describe

ROOT = Path(__file__).resolve().parents[2]

HOLMES = ROOT / "layouts" / "planned" / "holmes_two_domains.toml"

MODEL = """
[model]
layers = 4
hidden = 32
heads = 4
vocab = 64
seq_len = 8
[train]
steps = 1
global_batch = {batch}
"""

DOMAINS = """
[[cluster.domains]]
name = "ib0"
kind = "ib"
bandwidth_gbps = 200
latency_us = 2
gloo_ifname = "ib0if"
nccl = { NCCL_NET = "IB", NCCL_IB_HCA = "mlx5_0", NCCL_IB_GID_INDEX = 3 }
[[cluster.domains]]
name = "eth"
kind = "ethernet"
bandwidth_gbps = 25
latency_us = 10
gloo_ifname = "eth1"
nccl = { NCCL_NET = "Socket", NCCL_SOCKET_IFNAME = "eth1" }
[cluster.cross_domain]
bandwidth_gbps = 10
latency_us = 40
gloo_ifname = "eth0"
nccl = { NCCL_NET = "Socket", NCCL_SOCKET_IFNAME = "eth0" }
"""


def make(nodes: dict[str, tuple[str, int]], pipes: list[tuple[int, list[list[str]]]], domains: str = DOMAINS):
    """``nodes``: name -> (domain or '', devices); ``pipes``: (batch, [[device ids of each stage]])."""
    lines = [MODEL.format(batch=sum(b for b, _ in pipes)), "[cluster]", domains]
    for name, (domain, n) in nodes.items():
        lines += ["[[cluster.nodes]]", f'name = "{name}"', f"devices = {['cpu'] * n}".replace("'", '"')]
        if domain:
            lines.append(f'domain = "{domain}"')
    for batch, stages in pipes:
        lines += ["[[pipelines]]", f"batch = {batch}", "microbatches = 1"]
        for devs in stages:
            lines += ["[[pipelines.stages]]", f"layers = {4 // len(stages)}", f"devices = {devs}".replace("'", '"')]
    return loads("\n".join(lines) + "\n", file="inline.toml")


def transports(lay) -> dict[str, str]:
    plan = compile_plan(lay)
    return {g.name: g.transport for g in (plan.world,) + plan.groups}


def test_domains_load_into_typed_specs():
    lay = layout.load(HOLMES)
    c = lay.cluster
    assert [d.name for d in c.domains] == ["ib0", "roce0"]
    assert [d.kind for d in c.domains] == [DomainKind.IB, DomainKind.ROCE]
    assert c.domains[1].nccl_env == {
        "NCCL_NET": "IB",
        "NCCL_IB_HCA": "mlx5_2",
        "NCCL_IB_GID_INDEX": "3",
    }  # ints as text
    assert c.cross_domain.gloo_ifname == "xdom" and c.cross_domain.nccl_env["NCCL_NET"] == "Socket"
    assert [c.domain_of(n.name) for n in c.nodes] == ["ib0", "ib0", "roce0", "roce0"]
    assert c.comm is CommLib.TORCH


def test_layouts_without_domains_are_one_implicit_domain():
    lay = layout.load(ROOT / "layouts" / "examples" / "two_pipelines.toml")
    assert lay.cluster.domains == () and lay.cluster.domain_of("node0") == DEFAULT_TRANSPORT
    assert set(transports(lay).values()) == {DEFAULT_TRANSPORT, SHM}  # stage boundaries inside a node: shm
    plan = compile_plan(lay)
    assert all(plan.group_env(r.rank, g) == {} for r in plan.ranks for g in (plan.world,) + plan.groups)


@pytest.mark.parametrize(
    "item, check",
    [
        ("cluster.domains[0].nccl.NCCL_IB_HCA=mlx5_3", lambda c: c.domains[0].nccl_env["NCCL_IB_HCA"] == "mlx5_3"),
        ("cluster.domains[1].nccl.NCCL_IB_TC=106", lambda c: c.domains[1].nccl_env["NCCL_IB_TC"] == "106"),
        ("cluster.cross_domain.gloo_ifname=eth9", lambda c: c.cross_domain.gloo_ifname == "eth9"),
        ("cluster.nodes[2].speed=0.5", lambda c: c.nodes[2].speed == 0.5),
    ],
)
def test_set_reaches_domain_keys(item, check):
    assert check(layout.load(HOLMES, [item]).cluster)


@pytest.mark.parametrize(
    "item, message",
    [
        (
            "cluster.domains[0].nccl.NCCL_IB_HCX=mlx5_3",
            "cluster.domains[0].nccl.NCCL_IB_HCX: unknown NCCL variable 'NCCL_IB_HCX' (did you mean 'NCCL_IB_HCA'?)",
        ),
        (
            "cluster.cross_domain.ifname=eth0",
            "--set cluster.cross_domain.ifname: unknown key 'ifname' (did you mean 'gloo_ifname'?)",
        ),
        (
            "cluster.domains[0].nccl.NCCL_NET.x=1",
            "--set cluster.domains[0].nccl.NCCL_NET.x: 'cluster.domains[0].nccl.NCCL_NET' "
            "is a value, not a table (set 'cluster.domains[0].nccl.NCCL_NET' itself)",
        ),
    ],
)
def test_set_checks_domain_keys(item, message):
    with pytest.raises(layout.LayoutError) as info:
        layout.load(HOLMES, [item])
    assert str(info.value) == f"{HOLMES}: {message}"


def test_schema_lists_domain_keys():
    table = layout.schema_markdown()
    for key in (
        "cluster.domains[].kind",
        "cluster.domains[].nccl",
        "cluster.cross_domain.gloo_ifname",
        "cluster.nodes[].domain",
        "cluster.nodes[].speed",
        "cluster.comm",
    ):
        assert f"| `{key}` |" in table


TWO_BY_TWO = {"a0": ("ib0", 1), "a1": ("ib0", 1), "b0": ("eth", 1), "b1": ("eth", 1)}


def test_holmes_layout_keeps_gradient_sync_inside_domains():
    """DP inside domains, pipeline boundaries across: grad sync per domain, stage boundaries cross-domain."""
    lay = make(TWO_BY_TWO, [(2, [["a0:0"], ["b0:0"]]), (2, [["a1:0"], ["b1:0"]])])
    assert transports(lay) == {
        "world": CROSS_DOMAIN,
        "grad_sync[0,2]": "ib0",
        "grad_sync[1,3]": "eth",
        "p2p_fwd[p0.s0->p0.s1]": CROSS_DOMAIN,
        "p2p_bwd[p0.s1->p0.s0]": CROSS_DOMAIN,
        "p2p_fwd[p1.s0->p1.s1]": CROSS_DOMAIN,
        "p2p_bwd[p1.s1->p1.s0]": CROSS_DOMAIN,
    }


def test_naive_layout_syncs_gradients_across_domains():
    """One pipeline per domain: DP groups span domains, so every grad-sync group goes cross-domain (and each
    pipeline's stage boundary stays inside its domain)."""
    lay = make(TWO_BY_TWO, [(2, [["a0:0"], ["a1:0"]]), (2, [["b0:0"], ["b1:0"]])])
    assert transports(lay) == {
        "world": CROSS_DOMAIN,
        "grad_sync[0,2]": CROSS_DOMAIN,
        "grad_sync[1,3]": CROSS_DOMAIN,
        "p2p_fwd[p0.s0->p0.s1]": "ib0",
        "p2p_bwd[p0.s1->p0.s0]": "ib0",
        "p2p_fwd[p1.s0->p1.s1]": "eth",
        "p2p_bwd[p1.s1->p1.s0]": "eth",
    }


def test_stage_boundaries_inside_a_domain_use_it_and_only_the_crossing_goes_cross_domain():
    """One pipeline over four nodes, two per domain: a0 -> a1 (ib0) -> b0 (across) -> b1 (eth)."""
    lay = make(TWO_BY_TWO, [(2, [["a0:0"], ["a1:0"], ["b0:0"], ["b1:0"]])])
    got = {name: t for name, t in transports(lay).items() if name.startswith("p2p")}
    assert got == {
        "p2p_fwd[p0.s0->p0.s1]": "ib0",
        "p2p_bwd[p0.s1->p0.s0]": "ib0",
        "p2p_fwd[p0.s1->p0.s2]": CROSS_DOMAIN,
        "p2p_bwd[p0.s2->p0.s1]": CROSS_DOMAIN,
        "p2p_fwd[p0.s2->p0.s3]": "eth",
        "p2p_bwd[p0.s3->p0.s2]": "eth",
    }


def test_tp_groups_inside_a_node_use_its_domain_and_a_tp_group_across_domains_does_not():
    nodes = {"a0": ("ib0", 2), "b0": ("eth", 2)}
    lay = make(nodes, [(2, [["a0:0", "a0:1"], ["b0:0", "b0:1"]])])
    assert transports(lay) == {
        "world": CROSS_DOMAIN,
        "tp[p0.s0]": "ib0",
        "tp[p0.s1]": "eth",
        "p2p_fwd[p0.s0->p0.s1]": CROSS_DOMAIN,
        "p2p_bwd[p0.s1->p0.s0]": CROSS_DOMAIN,
    }
    lay = make(nodes, [(2, [["a0:0", "b0:0"], ["a0:1", "b0:1"]])])
    assert {name: t for name, t in transports(lay).items() if not name.startswith("p2p")} == {
        "world": CROSS_DOMAIN,
        "tp[p0.s0]": CROSS_DOMAIN,
        "tp[p0.s1]": CROSS_DOMAIN,
    }


def test_everything_in_one_domain_uses_that_domain_even_the_world():
    nodes = {"a0": ("ib0", 2), "a1": ("ib0", 2)}
    lay = make(nodes, [(2, [["a0:0", "a0:1"]]), (2, [["a1:0", "a1:1"]])])
    assert set(transports(lay).values()) == {"ib0"}


def test_mixed_asymmetric_layout_gets_one_transport_per_group():
    """Pipeline 0 (TP 2 then 1) in ib0, pipeline 1 spans both domains: blocks held in ib0 only sync there."""
    nodes = {"a0": ("ib0", 3), "a1": ("ib0", 1), "b0": ("eth", 1)}
    lay = make(nodes, [(2, [["a0:0", "a0:1"], ["a0:2"]]), (2, [["a1:0"], ["b0:0"]])])
    got = transports(lay)
    assert got["world"] == CROSS_DOMAIN and got["tp[p0.s0]"] == "ib0"
    plan = compile_plan(lay)
    for g in plan.groups:
        nodes_in = {plan.ranks[r].node for r in g.ranks}
        domains = {lay.cluster.domain_of(n) for n in nodes_in}
        if g.name.startswith("p2p") and len(nodes_in) == 1:  # a stage boundary inside one node
            assert g.transport == SHM, g
            continue
        assert g.transport == (domains.pop() if len(domains) == 1 else CROSS_DOMAIN), g
    assert any(g.transport == "ib0" for g in plan.groups if g.name.startswith("grad_sync"))
    assert any(g.transport == CROSS_DOMAIN for g in plan.groups if g.name.startswith("grad_sync"))


def test_a_shared_memory_boundary_keeps_its_nodes_domain_settings_for_its_process_group():
    """The group beside the rings (the network fallback) is created like any group inside the node's domain."""
    lay = make({"a0": ("ib0", 2), "b0": ("eth", 2)}, [(2, [["a0:0"], ["a0:1"], ["b0:0"], ["b0:1"]])])
    plan = compile_plan(lay)
    inside = next(g for g in plan.groups if g.name == "p2p_fwd[p0.s0->p0.s1]")
    assert inside.transport == SHM
    assert plan.group_env(0, inside) == {
        "NCCL_NET": "IB",
        "NCCL_IB_HCA": "mlx5_0",
        "NCCL_IB_GID_INDEX": "3",
        "GLOO_SOCKET_IFNAME": "ib0if",
    }
    assert (
        transports(
            attrs.evolve(
                lay,
                cluster=attrs.evolve(
                    lay.cluster, nodes=tuple(attrs.evolve(n, p2p=P2P.NETWORK) for n in lay.cluster.nodes)
                ),
            )
        )["p2p_fwd[p0.s0->p0.s1]"]
        == "ib0"
    )


def test_group_env_is_own_domain_overridden_by_the_group_transport():
    lay = make(TWO_BY_TWO, [(2, [["a0:0"], ["b0:0"]]), (2, [["a1:0"], ["b1:0"]])])
    plan = compile_plan(lay)
    grad = next(g for g in plan.groups if g.transport == "ib0")
    assert plan.group_env(0, grad) == {
        "NCCL_NET": "IB",
        "NCCL_IB_HCA": "mlx5_0",
        "NCCL_IB_GID_INDEX": "3",
        "GLOO_SOCKET_IFNAME": "ib0if",
    }
    # The world is cross-domain: Socket over eth0, but this rank's IB settings stay as the base, since
    # NCCL initializes its IB device list once per process (at the first communicator).
    assert plan.group_env(0, plan.world) == {
        "NCCL_NET": "Socket",
        "NCCL_IB_HCA": "mlx5_0",
        "NCCL_IB_GID_INDEX": "3",
        "NCCL_SOCKET_IFNAME": "eth0",
        "GLOO_SOCKET_IFNAME": "eth0",
    }
    assert plan.group_env(1, plan.world)["GLOO_SOCKET_IFNAME"] == "eth0"


def test_plan_and_transports_are_deterministic():
    lay = make(TWO_BY_TWO, [(2, [["a0:0"], ["b0:0"]]), (2, [["a1:0"], ["b1:0"]])])
    assert compile_plan(lay).groups == compile_plan(lay).groups


def test_dry_run_prints_domains_and_each_groups_transport():
    result = CliRunner().invoke(main, [str(HOLMES), "--dry-run", "--full"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "  world                        ranks [0, 1, 2, 3]  via cross_domain" in lines
    assert "  grad_sync[0,2]               ranks [0, 2]  via ib0" in lines
    assert "  grad_sync[1,3]               ranks [1, 3]  via roce0" in lines
    assert any(line.startswith("  roce0          roce") and "NCCL_IB_GID_INDEX=3" in line for line in lines)
    assert any(line.startswith("  cross_domain") and "xdom" in line for line in lines)


def test_dry_run_without_domains_has_no_domain_table():
    text = describe(compile_plan(layout.load(ROOT / "layouts" / "examples" / "two_pipelines.toml")))
    assert "network domains" not in text  # only the shared-memory boundaries say how they travel
    assert all(line.endswith("  via shm") for line in text.splitlines() if " via " in line)
    assert "  p2p_fwd[p0.s0->p0.s1]        ranks [0, 1]  via shm" in text.splitlines()


def test_missing_interface_falls_back_to_the_default(monkeypatch):
    pytest.importorskip("torch", reason="groups imports torch; runs wherever the test extras are installed (CI)")
    from hetero_llm.comm import groups

    plan = compile_plan(layout.load(HOLMES))
    grad = next(g for g in plan.groups if g.name == "grad_sync[0,2]")
    assert not groups.has_interface("dom0")  # not on a plain host (the testbed's namespaces have it)
    rp = plan.rank_plan(0)
    assert "GLOO_SOCKET_IFNAME" not in groups.group_env(rp, grad)
    assert groups.group_env(rp, grad)["NCCL_IB_HCA"] == "mlx5_0,mlx5_1"
    monkeypatch.setattr(groups, "has_interface", lambda name: True)
    assert groups.group_env(rp, grad)["GLOO_SOCKET_IFNAME"] == "dom0"
    assert groups.group_env(rp, grad) == plan.group_env(0, grad)  # what the plan resolved for the rank


def test_network_env_is_restored(monkeypatch):
    pytest.importorskip("torch")
    from hetero_llm.comm import groups

    plan = compile_plan(layout.load(HOLMES))
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    monkeypatch.delenv("NCCL_IB_HCA", raising=False)
    monkeypatch.setattr(groups, "has_interface", lambda name: True)
    grad = next(g for g in plan.groups if g.name == "grad_sync[0,2]")
    with groups._network_env(plan.rank_plan(0), grad):
        assert os.environ["GLOO_SOCKET_IFNAME"] == "dom0" and os.environ["NCCL_IB_HCA"] == "mlx5_0,mlx5_1"
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo" and "NCCL_IB_HCA" not in os.environ
    with groups._network_env(plan.rank_plan(1), grad):  # rank 1 is not in grad_sync[0,2]: nothing to set
        assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"


@pytest.mark.parametrize(
    "uid", [tuple(range(-3, 125)), bytes(range(128))], ids=["cupy 13: tuple of ints", "cupy 14: bytes"]
)
def test_cupy_groups_share_one_unique_id_through_the_store(monkeypatch, uid):
    """The id exchange and the environment around NCCL's init, with a stand-in for cupy.cuda.nccl
    (the real communicator is the GPU test above). Each CuPy gets back the type it gave: CuPy 14's
    communicator refuses a tuple (seen on an H200 with cupy-cuda13x 14.2)."""
    import sys
    import threading
    import types

    import torch.distributed as dist

    from hetero_llm.comm.groups import make_cupy_group

    made = []

    class FakeComm:
        def __init__(self, n, uid, rank):
            made.append((n, uid, rank, os.environ.get("NCCL_NET")))

    nccl = types.SimpleNamespace(get_unique_id=lambda: uid, NcclCommunicator=FakeComm)
    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(nccl=nccl)
    cuda = types.ModuleType("cupy.cuda")
    cuda.nccl = nccl
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
    monkeypatch.delenv("NCCL_NET", raising=False)
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=10))
    groups = {}

    def member(rank):
        groups[rank] = make_cupy_group(store, "grad_sync[3,5]", (3, 5), rank, {"NCCL_NET": "IB"})

    threads = [threading.Thread(target=member, args=(r,)) for r in (5, 3)]  # the non-first member waits
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted((n, rank, net) for n, _, rank, net in made) == [(2, 0, "IB"), (2, 1, "IB")]
    assert made[0][1] == made[1][1] == uid and type(made[0][1]) is type(uid)
    assert "NCCL_NET" not in os.environ and groups[3].ranks == (3, 5)


def test_the_snapshots_replica_group_is_made_on_the_worlds_interface(monkeypatch):
    """The gloo group the elastic snapshots' replicas travel over (train/checkpointing.py) binds its sockets where
    the plan's own groups do: to the world's gloo_ifname (cross-domain here). Without it gloo took the hostname's
    address, 127.0.0.1 in the netns testbed's namespaces, and the first round's replica exchange never connected."""
    from hetero_llm.comm import groups
    from hetero_llm.train import checkpointing

    lay = make({"a": ("ib0", 1), "b": ("eth", 1)}, [(2, [["a:0"], ["b:0"]])])
    rp = compile_plan(lay).rank_plan(0)
    monkeypatch.setattr(groups, "has_interface", lambda name: True)  # this host has no 'eth0'
    made = []
    monkeypatch.setattr(
        groups.dist,
        "new_group",
        lambda ranks, **kw: made.append((ranks, kw["backend"], os.environ.get("GLOO_SOCKET_IFNAME"))),
    )
    checkpointing._replica_group(rp)
    assert made == [([0, 1], "gloo", "eth0")]
    assert os.environ.get("GLOO_SOCKET_IFNAME") != "eth0"  # restored after
