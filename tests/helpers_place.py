"""Helpers shared by tests/unit/test_place.py and tests/integration/test_place_processes.py; not a test module."""

from __future__ import annotations

from hetero_llm.layout import CROSS_DOMAIN, DomainKind, DomainSpec
from hetero_llm.plan import compile_plan


def domain(name: str, kind: str = "ib") -> DomainSpec:
    return DomainSpec(name=name, kind=DomainKind(kind), bandwidth_gbps=100.0, latency_us=2.0, gloo_ifname="dom0")


def check_rules(lay) -> None:
    """The rules every placed layout obeys, checked on the compiled plan."""
    plan = compile_plan(lay)
    c = lay.cluster
    for st in plan.stages:  # TP inside a node
        assert len({plan.ranks[r].node for r in st.ranks}) == 1, st
    for g in plan.groups:  # DP (and TP) inside a domain; stage boundaries cross domains only where they change
        if g.name.startswith("p2p"):
            domains = {c.domain_of(plan.ranks[r].node) for r in g.ranks}
            assert (g.transport == CROSS_DOMAIN) == (len(domains) > 1), g
        else:
            assert g.transport != CROSS_DOMAIN, g
    domains_used = {c.domain_of(plan.ranks[r].node) for r in range(plan.world_size)}
    for pi in range(len(lay.pipelines)):  # one cross-domain boundary per domain change
        seq = [c.domain_of(plan.ranks[s.ranks[0]].node) for s in plan.stages if s.pipeline == pi]
        crossings = sum(a != b for a, b in zip(seq, seq[1:]))
        assert crossings == len(domains_used) - 1 and seq == sorted(seq, key=seq.index), seq
