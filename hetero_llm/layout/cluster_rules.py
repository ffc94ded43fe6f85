"""Layout validation of ``[cluster]``: nodes, the rendezvous master, network domains and the communication
library. On its own for placement (``cluster_file``: a cluster file has no pipelines yet), and called by
``rules.validate`` at its place in the fixed order of all rules. Imports no torch.
"""

from __future__ import annotations

import difflib

from hetero_llm.errors import LayoutError
from hetero_llm.layout.cluster_schema import P2P, Backend, ClusterSpec, CommLib, DomainKind
from hetero_llm.layout.fields import check_own


def validate_cluster(f: str, c: ClusterSpec) -> None:
    """The ``[cluster]`` checks, on their own: placement validates a cluster file that has no pipelines yet."""
    names = [n.name for n in c.nodes]
    seen_nodes: set[str] = set()
    for i, node in enumerate(c.nodes):
        at = f"cluster.nodes[{i}]"
        check_own(f, node, at, "name")
        if node.name in seen_nodes:
            raise LayoutError(f, f"{at}.name", f"node '{node.name}' is declared twice (give each node its own name)")
        seen_nodes.add(node.name)
        check_own(f, node, at, "devices", "host")
        if node.p2p is P2P.SHM and c.backend is not Backend.GLOO:
            raise LayoutError(
                f,
                f"{at}.p2p",
                f"'shm' moves host memory, but backend is '{c.backend.value}' "
                "(NCCL keeps boundaries on the GPU and uses its own paths inside a node: set p2p = 'auto')",
            )
    if c.master and c.master not in names:
        close = difflib.get_close_matches(c.master, names, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise LayoutError(f, "cluster.master", f"'{c.master}' is not a node ({hint}nodes: {', '.join(names)})")
    check_own(f, c, "cluster", "port", "timeout_s")
    _validate_domains(f, c)


def _validate_domains(f: str, c: ClusterSpec) -> None:
    domain_names = [d.name for d in c.domains]
    for i, d in enumerate(c.domains):
        at = f"cluster.domains[{i}]"
        check_own(f, d, at, "name")
        if d.name in domain_names[:i]:
            raise LayoutError(f, f"{at}.name", f"domain '{d.name}' is declared twice (give each domain its own name)")
        check_own(f, d, at, "bandwidth_gbps", "latency_us", "gloo_ifname", "nccl")
        if d.kind is DomainKind.ETHERNET:
            env = d.nccl_env
            ib = [k for k in env if k.startswith("NCCL_IB_")]
            if ib or env.get("NCCL_NET", "").lower() == "ib":
                what = ib[0] if ib else "NCCL_NET = 'IB'"
                raise LayoutError(
                    f,
                    f"{at}.nccl.{ib[0] if ib else 'NCCL_NET'}",
                    f"{what} needs RDMA verbs, but kind is 'ethernet' (remove it, or set kind = 'roce' or 'ib')",
                )
    check_own(f, c.cross_domain, "cluster.cross_domain", "bandwidth_gbps", "latency_us", "gloo_ifname", "nccl")
    for i, node in enumerate(c.nodes):
        at = f"cluster.nodes[{i}]"
        check_own(f, node, at, "speed", "memory_gb")
        if not c.domains and node.domain:
            raise LayoutError(
                f,
                f"{at}.domain",
                f"'{node.domain}' is not declared: the cluster has no [[cluster.domains]] "
                f"(add one named '{node.domain}', or remove domain)",
            )
        if c.domains and not node.domain:
            raise LayoutError(
                f,
                f"{at}.domain",
                f"missing: the cluster declares domains, so every node names its own "
                f"(domains: {', '.join(domain_names)})",
            )
        if c.domains and node.domain not in domain_names:
            close = difflib.get_close_matches(node.domain, domain_names, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise LayoutError(
                f, f"{at}.domain", f"'{node.domain}' is not a domain ({hint}domains: {', '.join(domain_names)})"
            )
    if c.comm is CommLib.CUPY:
        for node in c.nodes:
            if "cpu" in node.devices:
                raise LayoutError(
                    f,
                    "cluster.comm",
                    f"'cupy' needs CUDA devices, but node '{node.name}' lists 'cpu' "
                    "(list 'cuda:N' devices, or use comm = 'torch')",
                )
