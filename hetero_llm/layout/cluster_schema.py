"""The ``[cluster]`` part of the layout schema: hosts, network domains and how ranks meet. Imports no torch.

Declared like the rest of the schema (``schema``; see ``fields``): each key once, with its
type, default, meaning and single-field rules. Also the names a plan group's transport can take besides a
domain's, and the NCCL variables a domain may set.
"""

from __future__ import annotations

import enum
import functools
import re

import attrs

from hetero_llm.layout.fields import IFNAME, NAME, Check, each, host_address, key, nccl_net, no_repeated_gpu


class Backend(str, enum.Enum):
    GLOO = "gloo"
    NCCL = "nccl"


class DomainKind(str, enum.Enum):
    """What a network domain's NICs are (``cluster.domains[].kind``)."""

    IB = "ib"  # InfiniBand verbs
    ROCE = "roce"  # RDMA over Converged Ethernet (verbs too: NCCL's IB transport, with a GID index)
    ETHERNET = "ethernet"  # TCP only: NCCL's Socket transport
    OTHER = "other"  # anything else (a vendor net plugin, ...): no consistency checks


class CommLib(str, enum.Enum):
    """Who owns the gradient-sync communicators (``cluster.comm``)."""

    TORCH = "torch"  # torch.distributed process groups (gloo or NCCL)
    CUPY = "cupy"  # cupy.cuda.nccl communicators, one per gradient-sync group, on CUDA tensors


class P2P(str, enum.Enum):
    """How a node's stage boundaries between its own ranks travel (``cluster.nodes[].p2p``)."""

    AUTO = "auto"  # shared memory when both sides of the boundary are CPU ranks of this node, else the network
    SHM = "shm"  # shared memory (hetero_llm/comm/shm.py) for every boundary inside this node; needs backend gloo
    NETWORK = "network"  # the boundary's process group (gloo over TCP, or NCCL), like a boundary between nodes


# Transport names a plan group can carry besides a domain name (so no domain may be called any of them).
DEFAULT_TRANSPORT = "default"  # no [[cluster.domains]]: the process's own network settings
CROSS_DOMAIN = "cross_domain"  # a group whose members are in more than one domain
SHM = "shm"  # a stage-boundary group inside one node that moves its tensors through shared memory

# NCCL variables a domain may set: the network-selection ones Holmes-style domains need, plus common
# tuning knobs. Anything else named NCCL_* is more likely a typo than a wish (did-you-mean).
NCCL_VARIABLES = (
    "NCCL_NET",
    "NCCL_NET_PLUGIN",
    "NCCL_IB_HCA",
    "NCCL_IB_GID_INDEX",
    "NCCL_IB_ROCE_VERSION_NUM",
    "NCCL_IB_TC",
    "NCCL_IB_SL",
    "NCCL_IB_TIMEOUT",
    "NCCL_IB_RETRY_CNT",
    "NCCL_IB_QPS_PER_CONNECTION",
    "NCCL_IB_PCI_RELAXED_ORDERING",
    "NCCL_IB_ADAPTIVE_ROUTING",
    "NCCL_IB_DISABLE",
    "NCCL_IB_MERGE_NICS",
    "NCCL_NET_GDR_LEVEL",
    "NCCL_NET_GDR_READ",
    "NCCL_SOCKET_IFNAME",
    "NCCL_SOCKET_FAMILY",
    "NCCL_SOCKET_NTHREADS",
    "NCCL_NSOCKS_PERTHREAD",
    "NCCL_CROSS_NIC",
    "NCCL_P2P_DISABLE",
    "NCCL_SHM_DISABLE",
    "NCCL_ALGO",
    "NCCL_PROTO",
    "NCCL_MIN_NCHANNELS",
    "NCCL_MAX_NCHANNELS",
    "NCCL_BUFFSIZE",
    "NCCL_DEBUG",
    "NCCL_DEBUG_SUBSYS",
    "NCCL_TOPO_FILE",
)

MIN_TIMEOUT_S = 1.0  # below this, ranks started together time out before they can meet

# Single-field rules of the cluster's keys.
OPTIONAL_MEASURE = Check(  # a bandwidth or latency that 0 leaves unset
    lambda v: v >= 0, "must be >= 0 (0 = not given), got {v:g}"
)
NODE_HAS_DEVICES = Check(bool, 'a node needs at least one device (e.g. devices = ["cpu"])')
LOCAL_DEVICE = Check(
    lambda v: re.fullmatch(r"cpu|cuda:(0|[1-9][0-9]*)", v) is not None, "unknown device '{v}' (use 'cpu' or 'cuda:N')"
)
NOT_A_TRANSPORT = Check(
    lambda v: v not in (DEFAULT_TRANSPORT, CROSS_DOMAIN, SHM),
    "'{v}' is reserved (it names a group's transport; pick another name)",
)
MEETING_TIME = Check(
    lambda v: v >= MIN_TIMEOUT_S,
    f"must be at least {MIN_TIMEOUT_S:g} s (the time ranks have to meet; the default is 60), got {{v:g}}",
)


@attrs.frozen
class NodeSpec:
    """``[[cluster.nodes]]``: one host."""

    name: str = key("node name used in device ids ('node0' -> 'node0:1')", check=NAME)
    host: str = key(
        "address other nodes reach this host at: a host name or IP address, no port (that is cluster.port)",
        default="127.0.0.1",
        check=host_address,
    )
    devices: tuple[str, ...] = key(
        "local devices in index order: 'cpu' or 'cuda:N'",
        default=("cpu",),
        check=(NODE_HAS_DEVICES, each(LOCAL_DEVICE), no_repeated_gpu),
    )
    domain: str = key(
        "name of the [[cluster.domains]] entry this node's NICs are in; '' when the cluster declares no domains",
        default="",
    )
    speed: float = key(
        "relative compute speed of each of this node's devices (1.0 = reference); placement "
        "gives faster stages more layers",
        default=1.0,
        check=Check(lambda v: v > 0, "must be > 0 (1.0 = reference speed), got {v:g}"),
    )
    memory_gb: float = key(
        "memory per device in GB for placement's layer cap; 0 = no cap",
        default=0.0,
        check=Check(lambda v: v >= 0, "must be >= 0 (0 = no cap), got {v:g}"),
    )
    p2p: P2P = key(
        "stage boundaries between this node's own ranks: 'auto' (shared memory between CPU ranks, "
        "the network otherwise; the network too if /dev/shm is missing or too small, with a warning), "
        "'shm' (shared memory, an error if /dev/shm cannot hold the ring buffers; backend gloo only) "
        "or 'network' (the boundary's process group, as between nodes)",
        default=P2P.AUTO,
    )


@attrs.frozen
class DomainSpec:
    """``[[cluster.domains]]``: one network domain, i.e. a NIC kind and the fabric joining its nodes."""

    name: str = key(
        "domain name that nodes refer to ('ib0'); letters, digits, '-' or '_'", check=(NAME, NOT_A_TRANSPORT)
    )
    kind: DomainKind = key("'ib', 'roce', 'ethernet' or 'other'")
    bandwidth_gbps: float = key(
        "bandwidth of one NIC inside the domain, Gbit/s", check=Check(lambda v: v > 0, "must be > 0, got {v:g}")
    )
    latency_us: float = key(
        "one-way latency between two nodes of the domain, microseconds",
        check=Check(lambda v: v >= 0, "must be >= 0, got {v:g}"),
    )
    gloo_ifname: str = key(
        "network interface gloo binds this domain's groups to, e.g. 'ib0' (IPoIB) or "
        "'eth1'; '' = the process default (GLOO_SOCKET_IFNAME or the hostname's address)",
        default="",
        check=IFNAME,
    )
    nccl: tuple[tuple[str, str], ...] = key(
        "NCCL variables for this domain's communicators, as a table: [cluster.domains.nccl] NCCL_IB_HCA = 'mlx5_0'",
        default=(),
        check=nccl_net,
    )

    @property
    def nccl_env(self) -> dict[str, str]:
        return dict(self.nccl)


@attrs.frozen
class CrossDomainSpec:
    """``[cluster.cross_domain]``: the network between domains, used by every group spanning domains."""

    bandwidth_gbps: float = key(
        "bandwidth of one node's cross-domain NIC, Gbit/s; 0 = not given", default=0.0, check=OPTIONAL_MEASURE
    )
    latency_us: float = key(
        "one-way latency between domains, microseconds; 0 = not given", default=0.0, check=OPTIONAL_MEASURE
    )
    gloo_ifname: str = key(
        "network interface gloo binds cross-domain groups to; '' = the process default", default="", check=IFNAME
    )
    nccl: tuple[tuple[str, str], ...] = key(
        "NCCL variables for cross-domain communicators, e.g. { NCCL_NET = 'Socket', NCCL_SOCKET_IFNAME = 'eth0' }",
        default=(),
        check=nccl_net,
    )

    @property
    def nccl_env(self) -> dict[str, str]:
        return dict(self.nccl)


@attrs.frozen
class ClusterSpec:
    """``[cluster]``: the hosts and how ranks meet."""

    nodes: tuple[NodeSpec, ...] = key("the hosts")
    master: str = key("node whose host serves rendezvous; '' means the first node", default="")
    port: int = key(
        "rendezvous TCP port (MASTER_PORT overrides)",
        default=29511,
        check=Check(lambda v: 1 <= v <= 65535, "must be a TCP port 1..65535, got {v}"),
    )
    backend: Backend = key("'gloo' (CPU, default) or 'nccl' (CUDA)", default=Backend.GLOO)
    timeout_s: float = key(
        "seconds to wait for every rank to arrive; at least 1",
        default=60.0,
        check=(Check(lambda v: v > 0, "must be > 0, got {v}"), MEETING_TIME),
    )
    domains: tuple[DomainSpec, ...] = key(
        "network domains; none declared means one implicit domain whose "
        "groups all use the process's own network settings",
        default=(),
    )
    cross_domain: CrossDomainSpec = key("the network between domains (a table)", default=CrossDomainSpec())
    comm: CommLib = key(
        "'torch' (process groups for everything) or 'cupy' (CuPy NCCL communicators for "
        "gradient sync; needs CUDA devices and cupy)",
        default=CommLib.TORCH,
    )

    @functools.cached_property
    def _node_named(
        self,
    ) -> dict[str, NodeSpec]:  # a plan asks per rank and per group: no scan over the nodes each time
        named: dict[str, NodeSpec] = {}
        for n in self.nodes:
            named.setdefault(n.name, n)
        return named

    def node(self, name: str) -> NodeSpec:
        return self._node_named[name]

    @property
    def master_node(self) -> NodeSpec:
        return self.node(self.master) if self.master else self.nodes[0]

    def domain_of(self, node: str) -> str:
        """The domain a node is in; DEFAULT_TRANSPORT when the cluster declares no domains."""
        return self.node(node).domain if self.domains else DEFAULT_TRANSPORT

    def transport(self, name: str) -> DomainSpec | CrossDomainSpec | None:
        """Settings of a plan group's transport: a domain, the cross-domain network, or None (defaults)."""
        if name == CROSS_DOMAIN:
            return self.cross_domain
        return next((d for d in self.domains if d.name == name), None)
