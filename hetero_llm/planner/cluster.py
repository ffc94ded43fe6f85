"""What the planner knows about a cluster: device kinds, nodes, links and ``[plan]`` limits. Torch-free.

A planner cluster file is a layout without ``[[pipelines]]`` (what ``hetero-place`` reads) plus a
``[plan]`` section that only the planner reads and that the written layout leaves out (hetero_llm.planner.output
writes the layout from these sections with hetero_llm.layout.dumps):

    [plan]
    max_tp = 8                      # largest TP size to try (0: a node's device count)
    max_cp = 1                      # largest context-parallel size to try (1: none)
    schedules = ["1f1b", "zbh1", "interleaved", "gpipe"]
    optimizers = ["adamw", "adamw_zero1"]  # train.optimizer values to choose from
    memory_margin = 0.1             # fraction of each device's memory kept free
    max_evals = 0                   # the search's budget in plans simulated (0: 400 + 8 per device, <= 2500)
    time_budget_s = 300             # a safety net: stop after this long (the output then says so)
    action_overhead_us = 0          # measured: the runtime's own time per compute action (0 on GPUs' scale)
    p2p_latency_us = 0              # measured: the communication library's latency per message
    grad_bytes = 4                  # gradient all-reduce element size (4: what the runtime reduces)
    grad_overlap = false            # sync after the backward (the runtime); true: torch DDP's overlap
    attention = "flash"             # the runtime's SDPA; "unfused": Megatron-LM of 2021
    vocab_parallel = false          # the head whole on every TP rank (the runtime); true: split (Megatron)
    execution = "auto"              # eager / compiled / fused kernels; auto: from train.compile (the runtime)
    [plan.nodes]                    # device kind of each node; keys are node names or globs
    "ib*" = "a100-80g"
    roce0 = "rtx4090"
    [plan.kinds.my-gpu]             # a kind the built-in catalogue lacks (or a corrected one)
    tflops = 120.0                  # peak dense TFLOPS at the training precision
    memory_gb = 32.0
    link_gbps = 256.0               # intra-node link per device, Gbit/s (NVLink, PCIe, shared memory)
    mem_bw_gbs = 900.0              # device memory bandwidth, GB/s (the optimizer step is bound by it)
    pricing = "roofline"            # else FLOPs at tflops only (an emulated device); then, measured:
    gemm_fraction = 0.8             # achieved large-matmul TFLOPS / tflops (attn_fraction, mem_fraction,
    launch_us = 5                   # link_fraction, sms: see docs/planner.md)
    [plan.nics]                     # NICs per node (default 1): a DGX has one per GPU
    "ib*" = 8
    [plan.documents]                # the corpus' document lengths (planner/documents.py): attention priced
    distribution = "lognormal"      # per document; default "row", one document per row (S^2 per row)
    median = 2048
    sigma = 1.6

A node whose devices are all ``cpu`` is of kind ``cpu`` unless ``[plan.nodes]`` says otherwise.
"""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path

import attrs

from hetero_llm import layout as layout_mod
from hetero_llm.errors import LayoutError
from hetero_llm.layout import (
    Backend,
    ClusterSpec,
    Compile,
    DataSpec,
    Layout,
    ModelSpec,
    Optimizer,
    Precision,
    TrainSpec,
    rules,
)
from hetero_llm.layout import reader as layout_reader
from hetero_llm.planner import catalogue
from hetero_llm.planner import profile as profile_mod
from hetero_llm.planner.catalogue import DeviceKind, catalogue_kind
from hetero_llm.planner.catalogue import doc as _doc
from hetero_llm.planner.documents import Documents, DocumentsSpec, read_documents
from hetero_llm.planner.profile import Profile


@attrs.frozen
class PlanLimits:
    """``[plan]``: limits on the search."""

    max_tp: int = _doc("largest TP size to try; 0 = a node's device count", default=8)
    max_cp: int = _doc(
        "largest context-parallel size to try per stage (a stage's devices TP x CP, each CP rank holding 1 / cp of "
        "every sequence; sizes dividing seq_len / 2, flash attention only); 1 = no context parallelism",
        default=1,
    )
    schedules: tuple[str, ...] = _doc(
        "schedules to choose from: '1f1b', 'zbh1', 'interleaved' (any chunk count dividing the layers), 'gpipe' "
        "('dynamic' is chosen at run time: the planner cannot price it)",
        default=("1f1b", "zbh1", "interleaved", "gpipe"),
    )
    optimizers: tuple[str, ...] = _doc(
        "train.optimizer values to choose from: 'adamw', 'adamw_zero1' (ZeRO-1: less memory and a shorter "
        "optimizer step per device); the written layout sets the chosen one",
        default=("adamw", "adamw_zero1"),
    )
    memory_margin: float = _doc("fraction of each device's memory kept free (allocator, workspace)", default=0.1)
    max_evals: int = _doc(
        "the search's budget, counted in work so that the plan is a function of the input only (whatever the "
        "machine's speed or load): the local search stops after this many plans simulated (over every "
        "optimizer of plan.optimizers), and the sweep ranks at most max(20000, 8 x max_evals) structures; "
        "0 = 400 + 8 per device, at most 2500",
        default=0,
    )
    time_budget_s: float = _doc(
        "a safety net, not the budget: the search stops after this many seconds even when max_evals is not "
        "spent, and returns the best plan found so far; that plan then depends on the machine's speed and "
        'load, and the output says so (a line, a comment in the written layout\'s header, "cut_by_time": '
        "true in --json); 0 = no cap",
        default=300.0,
    )
    profile: str = _doc(
        "a profile file (JSON, written by `hetero-plan CLUSTER --profile FILE`; relative to the "
        "cluster file) whose measured per-layer times replace the catalogue's pricing for the kinds it names; "
        "'' = none",
        default="",
    )
    action_overhead_us: float = _doc(
        "the runtime's own time per compute action (F, B, I, W) in microseconds: the "
        "interpreter and posting the microbatch's sends and receives, added to every "
        "compute action of every stage; measure it (bench/planner/plan_vs_measured.py does: "
        "docs/benchmarks.md); 0 = none (next to GPU compute it is small)",
        default=0.0,
    )
    p2p_latency_us: float = _doc(
        "the communication library's own latency per message in microseconds, on top of "
        "the links' latency_us: added to every stage-boundary transfer and every step of "
        "a gradient all-reduce ring; measure it (a gloo ping-pong: benchlib.p2p_probe); "
        "0 = none",
        default=0.0,
    )
    grad_bytes: int = _doc(
        "bytes per gradient element the gradient all-reduce sends: 4 = float32, what hetero_llm's runtime "
        "reduces; 2 for a system that reduces fp16/bf16 gradients (Megatron-LM's default)",
        default=4,
    )
    grad_overlap: bool = _doc(
        "the gradient all-reduce overlaps the last microbatch's backward (torch DDP's buckets); false = after "
        "the backward, as hetero_llm's runtime does",
        default=False,
    )
    attention: str = _doc(
        "'flash': causal fused attention (SDPA, what hetero_llm's runtime runs); 'unfused': the S x S scores "
        "materialized by two batched matmuls, a softmax and a dropout kernel, and held for the backward (Megatron-LM of 2021)",
        default="flash",
    )
    vocab_parallel: bool = _doc(
        "the embedding and the head split over the TP group (Megatron-LM's vocabulary-parallel embedding and "
        "head): their parameters, gradients, optimizer state and gradient sync, and on roofline kinds the head's "
        "matmul, cross-entropy and logits; false = whole on every TP rank, as hetero_llm's runtime keeps them",
        default=False,
    )
    execution: str = _doc(
        "roofline kinds: how the element-wise work runs. 'eager': one kernel per PyTorch op (biases, "
        "activation, residuals, norms, layout copies, the bf16 weight casts), each paying the host's dispatch, "
        "overlapped with the GPU; 'compiled': torch.compile of the whole model (chains between matmuls fused, "
        "the cross-entropy fused); 'fused': hand-fused kernels (Megatron-LM's fused bias-GeLU, bias-dropout-add, "
        "layer norm; no weight casts); 'auto': what hetero_llm's runtime runs, eager, its blocks compiled with "
        "train.compile = 'blocks'",
        default="auto",
    )


ATTENTION = ("flash", "unfused")
EXECUTION = ("auto", "eager", "compiled", "fused")


SCHEDULES = ("1f1b", "zbh1", "interleaved", "gpipe")
MAX_GLOBAL_BATCH = 65536  # sequences per step the planner searches (its work grows with the microbatches)


@attrs.frozen
class Node:
    name: str
    domain: str
    devices: int
    kind: DeviceKind
    nics: int = 1  # NICs of the node into its domain ([plan.nics]); its devices' network traffic spreads over them


@attrs.frozen
class Network:
    """Bandwidth (bytes/s) and latency (s) of the three kinds of link: inside a node, a domain, across domains."""

    domain_bw: tuple[tuple[str, float], ...]
    domain_latency: tuple[tuple[str, float], ...]
    cross_bw: float
    cross_latency: float


@attrs.frozen
class Cluster:
    """Everything the planner reads from a cluster file."""

    file: str
    model: ModelSpec
    train: TrainSpec
    data: DataSpec
    spec: ClusterSpec
    nodes: tuple[Node, ...]
    network: Network
    limits: PlanLimits
    profile: Profile | None = None  # measured per-layer times (plan.profile or --profile-file)
    documents: Documents = Documents()  # [plan.documents]: one document per row unless the file says otherwise

    @property
    def num_devices(self) -> int:
        return sum(n.devices for n in self.nodes)

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)


def _network(c: ClusterSpec) -> Network:
    if not c.domains:  # one implicit domain: take a 100 Gbit/s Ethernet-class NIC, 5 us
        return Network((("default", 100e9 / 8),), (("default", 5e-6),), 100e9 / 8, 5e-6)
    bw = tuple((d.name, d.bandwidth_gbps * 1e9 / 8) for d in c.domains)
    lat = tuple((d.name, d.latency_us * 1e-6) for d in c.domains)
    x = c.cross_domain
    # cross_domain bandwidth 0 = not given: the slowest domain NIC bounds it (traffic leaves through one)
    cross_bw = x.bandwidth_gbps * 1e9 / 8 if x.bandwidth_gbps else min(b for _, b in bw)
    cross_lat = x.latency_us * 1e-6 if x.latency_us else max(v for _, v in lat)
    return Network(bw, lat, cross_bw, cross_lat)


def load_cluster(path: str | os.PathLike, profile_file: str | os.PathLike | None = None) -> Cluster:
    """Read and check a planner cluster file; every problem is a LayoutError naming the TOML path.
    ``profile_file`` (``--profile-file``) replaces ``plan.profile``."""
    file = str(path)
    _, raw, sec = layout_mod.read_cluster_file(path, "the planner", extra=("plan",))
    model, train, cluster = sec["model"], sec["train"], sec["cluster"]
    if train.global_batch < 1:
        raise LayoutError(file, "train.global_batch", f"must be >= 1, got {train.global_batch}")
    for key in ("layers", "hidden", "heads", "seq_len", "vocab"):
        if getattr(model, key) < 1:
            raise LayoutError(file, f"model.{key}", f"must be >= 1, got {getattr(model, key)}")
    if train.global_batch > MAX_GLOBAL_BATCH:  # the search's steps grow with it (microbatches, divisors)
        raise LayoutError(
            file,
            "train.global_batch",
            f"{train.global_batch} sequences per step is more than the planner searches (at most "
            f"{MAX_GLOBAL_BATCH}: plan a smaller global batch, then scale the pipelines' batch and microbatches)",
        )
    # what the written layout's validation would refuse, before the search rather than after it
    probe = Layout(file, model, train, sec["data"], cluster, ())
    rules.validate_sections(layout_reader.map_paths(probe, lambda p: str(Path(file).parent / p)))
    plan = raw.get("plan", {})
    if not isinstance(plan, dict):
        raise LayoutError(file, "plan", "expected a table ([plan])")
    kinds_raw = plan.get("kinds", {})
    node_kinds = plan.get("nodes", {})
    limits = _plan_limits(file, plan, train)
    kinds = _kinds(file, kinds_raw, train.precision)
    if not isinstance(node_kinds, dict):
        raise LayoutError(file, "plan.nodes", "expected a table of node name (or glob) = device kind")
    for pattern, kind in node_kinds.items():
        if not isinstance(kind, str) or kind not in kinds:
            raise LayoutError(
                file,
                f"plan.nodes.{pattern}",
                f"unknown device kind {kind!r} (known: {', '.join(sorted(kinds))}; or add [plan.kinds.{kind}])",
            )
        _check_pattern(file, f"plan.nodes.{pattern}", pattern, cluster)
    nics = _nics(file, plan.get("nics", {}), cluster)
    nodes = []
    for i, n in enumerate(cluster.nodes):
        kind = next((k for pat, k in node_kinds.items() if fnmatch.fnmatchcase(n.name, pat)), None)
        if kind is None:
            if not all(d == "cpu" for d in n.devices):
                raise LayoutError(
                    file,
                    f"cluster.nodes[{i}]",
                    f"node '{n.name}' has no device kind (add it to "
                    f'[plan.nodes], e.g. {n.name} = "a100-80g"; kinds: {", ".join(sorted(kinds))})',
                )
            kind = "cpu"
        nodes.append(Node(n.name, cluster.domain_of(n.name), len(n.devices), kinds[kind], nics.get(n.name, 1)))
    profile = None
    if profile_file is not None:
        profile = profile_mod.read(profile_file, file, "--profile-file", model, train.precision)
    elif limits.profile:
        where = Path(file).parent / limits.profile
        profile = profile_mod.read(where, file, "plan.profile", model, train.precision)
    documents = read_documents(file, plan.get("documents", {}), sec["data"])
    return Cluster(
        file, model, train, sec["data"], cluster, tuple(nodes), _network(cluster), limits, profile, documents
    )


def check_devices(cluster: Cluster) -> None:
    """Before a search whose plan is written as a layout: NCCL runs one rank per GPU, and a plan may use every
    device of the cluster, so each device must be a CUDA GPU of its own (the layout's rule for the devices its
    pipelines use, applied to all). Not part of ``load_cluster``: the benchmarks plan generated NCCL clusters
    that are never launched, their nodes all on one host."""
    file, c = cluster.file, cluster.spec
    if c.backend is not Backend.NCCL:
        return
    seen: dict[tuple[str, str], str] = {}
    for i, node in enumerate(c.nodes):
        for j, local in enumerate(node.devices):
            where, dev = f"cluster.nodes[{i}].devices[{j}]", f"{node.name}:{j}"
            if local == "cpu":
                raise LayoutError(
                    file,
                    where,
                    f"device '{dev}' is 'cpu' but cluster.backend is 'nccl' "
                    "(NCCL needs CUDA devices: list 'cuda:N' devices or use backend = 'gloo')",
                )
            other = seen.setdefault((node.host, local), dev)
            if other != dev:
                raise LayoutError(
                    file,
                    where,
                    f"device '{dev}' is {local} on host {node.host}, like '{other}' (NCCL runs one rank per "
                    "GPU and a plan may use every device: give each node its own GPUs, or use backend = 'gloo')",
                )


def _plan_limits(file: str, plan: dict, train: TrainSpec) -> PlanLimits:
    """``[plan]``'s limits (its keys but the tables), checked; under train.compile = 'blocks' without 'zbh1'."""
    tables = ("kinds", "nodes", "nics", "documents")
    limits = (
        layout_mod.build(PlanLimits, {k: v for k, v in plan.items() if k not in tables}, "plan", file)
        if set(plan) - set(tables)
        else PlanLimits()
    )
    _check_limits(file, limits)
    if train.compile is Compile.BLOCKS and "zbh1" in limits.schedules:  # the layout would be refused
        kept = tuple(x for x in limits.schedules if x != "zbh1")
        if not kept:
            raise LayoutError(
                file,
                "plan.schedules",
                "only 'zbh1', whose split backward train.compile = 'blocks' cannot compile "
                "(allow '1f1b' or 'interleaved', or set train.compile = 'none')",
            )
        limits = attrs.evolve(limits, schedules=kept)
    if train.compile is Compile.BLOCKS and limits.max_cp > 1:  # the layout would be refused
        raise LayoutError(
            file,
            "plan.max_cp",
            f"{limits.max_cp}: train.compile = 'blocks' cannot compile the ring attention of context parallelism "
            "(set plan.max_cp = 1, or train.compile = 'none')",
        )
    return limits


# C901: a flat list of independent rules on [plan]'s limits, each one error, checked in order: a split would
# only scatter the list
def _check_limits(file: str, limits: PlanLimits) -> None:  # noqa: C901
    if limits.max_tp < 0:
        raise LayoutError(file, "plan.max_tp", f"must be >= 0 (0 = a node's device count), got {limits.max_tp}")
    if limits.max_cp < 1:
        raise LayoutError(file, "plan.max_cp", f"must be >= 1 (1 = no context parallelism), got {limits.max_cp}")
    if limits.max_cp > 1 and limits.attention != "flash":
        raise LayoutError(
            file,
            "plan.max_cp",
            f"context parallelism is priced for flash attention only, but plan.attention is '{limits.attention}' "
            "(set plan.max_cp = 1, or plan.attention = 'flash')",
        )
    if not limits.schedules:
        raise LayoutError(file, "plan.schedules", f"needs at least one schedule (from {', '.join(SCHEDULES)})")
    for i, s in enumerate(limits.schedules):
        if s == "dynamic":
            raise LayoutError(
                file,
                f"plan.schedules[{i}]",
                "'dynamic' runs what is ready at run time: the planner's simulator cannot price it (plan with "
                "'1f1b', then set train.schedule = 'dynamic' in the written layout)",
            )
        if s not in SCHEDULES:
            raise LayoutError(
                file,
                f"plan.schedules[{i}]",
                f"unknown schedule {s!r} (the planner chooses from {', '.join(SCHEDULES)})",
            )
    known = tuple(o.value for o in Optimizer)
    if not limits.optimizers:
        raise LayoutError(file, "plan.optimizers", f"needs at least one optimizer (from {', '.join(known)})")
    for i, o in enumerate(limits.optimizers):
        if o not in known:
            raise LayoutError(
                file, f"plan.optimizers[{i}]", f"unknown optimizer {o!r} (the planner chooses from {', '.join(known)})"
            )
    if not 0 <= limits.memory_margin < 1:
        raise LayoutError(file, "plan.memory_margin", f"must be in [0, 1), got {limits.memory_margin:g}")
    if limits.max_evals < 0:
        raise LayoutError(
            file, "plan.max_evals", f"must be >= 0 (0 = 400 + 8 per device, at most 2500), got {limits.max_evals}"
        )
    if limits.time_budget_s < 0:
        raise LayoutError(file, "plan.time_budget_s", f"must be >= 0 (0 = no limit), got {limits.time_budget_s:g}")
    if limits.grad_bytes not in (2, 4):
        raise LayoutError(
            file, "plan.grad_bytes", f"must be 4 (float32 gradients) or 2 (fp16/bf16), got {limits.grad_bytes}"
        )
    if limits.attention not in ATTENTION:
        raise LayoutError(
            file, "plan.attention", f"unknown attention {limits.attention!r} (one of: {', '.join(ATTENTION)})"
        )
    if limits.execution not in EXECUTION:
        raise LayoutError(
            file, "plan.execution", f"unknown execution {limits.execution!r} (one of: {', '.join(EXECUTION)})"
        )
    for key in ("action_overhead_us", "p2p_latency_us"):
        value = getattr(limits, key)
        if value < 0:  # (the key reader already refuses nan and inf)
            raise LayoutError(file, f"plan.{key}", f"must be a number of microseconds >= 0 (0 = none), got {value:g}")


def _kinds(file: str, raw: object, precision: Precision) -> dict[str, DeviceKind]:
    kinds = {name: catalogue_kind(name, precision) for name in catalogue.KINDS}
    if not isinstance(raw, dict):
        raise LayoutError(file, "plan.kinds", "expected tables [plan.kinds.NAME]")
    for name, table in raw.items():
        where = f"plan.kinds.{name}"
        kind = (
            layout_mod.build(DeviceKind, table, where, file)
            if isinstance(table, dict) and "name" not in table
            else None
        )
        if kind is None:
            raise LayoutError(file, where, "expected a table with tflops, memory_gb, link_gbps, mem_bw_gbs")
        for key in ("tflops", "memory_gb", "link_gbps", "mem_bw_gbs"):
            if not getattr(kind, key) > 0:
                raise LayoutError(file, f"{where}.{key}", f"must be > 0, got {getattr(kind, key):g}")
        _check_kind(file, where, kind)
        kinds[name] = attrs.evolve(kind, name=name)
    return kinds


def _check_kind(file: str, where: str, kind: DeviceKind) -> None:
    if kind.pricing not in catalogue.PRICINGS:
        raise LayoutError(
            file, f"{where}.pricing", f"unknown pricing {kind.pricing!r} (one of: {', '.join(catalogue.PRICINGS)})"
        )
    if not 0 <= kind.attn_fraction <= 1:
        raise LayoutError(
            file,
            f"{where}.attn_fraction",
            f"must be a fraction in [0, 1] (0 = the matmul rate), got {kind.attn_fraction:g}",
        )
    for key in ("gemm_fraction", "mem_fraction", "link_fraction"):
        value = getattr(kind, key)
        if not 0 < value <= 1:
            raise LayoutError(
                file, f"{where}.{key}", f"must be a fraction in (0, 1] (achieved / datasheet), got {value:g}"
            )
    if kind.sms < 0:
        raise LayoutError(file, f"{where}.sms", f"must be >= 0 (0 = no wave quantization), got {kind.sms}")
    if kind.launch_us < 0:
        raise LayoutError(file, f"{where}.launch_us", f"must be a number of microseconds >= 0, got {kind.launch_us:g}")


def _check_pattern(file: str, where: str, pattern: str, cluster: ClusterSpec) -> None:
    """A ``[plan.nodes]`` or ``[plan.nics]`` key must match a node."""
    if not any(fnmatch.fnmatchcase(n.name, pattern) for n in cluster.nodes):
        raise LayoutError(file, where, f"matches no node (nodes: {', '.join(n.name for n in cluster.nodes)})")


def _nics(file: str, raw: object, cluster: ClusterSpec) -> dict[str, int]:
    """``[plan.nics]``: NICs per node, by node name or glob (the first match wins); 1 where none matches."""
    if not isinstance(raw, dict):
        raise LayoutError(file, "plan.nics", 'expected a table of node name (or glob) = NICs per node, e.g. "dgx*" = 8')
    for pattern, count in raw.items():
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise LayoutError(file, f"plan.nics.{pattern}", f"expected a number of NICs >= 1, got {count!r}")
        _check_pattern(file, f"plan.nics.{pattern}", pattern, cluster)
    out = {}
    for n in cluster.nodes:
        count = next((c for pat, c in raw.items() if fnmatch.fnmatchcase(n.name, pat)), 1)
        out[n.name] = count
    return out


def schema_markdown() -> str:
    """Every key the planner reads ([plan], [plan.documents], [plan.kinds.NAME], [plan.nodes]), for
    docs/planner.md."""
    rows = []
    for section, cls in (("plan", PlanLimits), ("plan.documents", DocumentsSpec), ("plan.kinds.NAME", DeviceKind)):
        for fl in attrs.fields(cls):
            if fl.name == "name":
                continue
            default = "required" if fl.default is attrs.NOTHING else repr(fl.default)
            rows.append(f"| `{section}.{fl.name}` | {default} | {fl.metadata['doc']} |")
    rows.append(
        "| `plan.nics.PATTERN` | 1 | NICs of the nodes whose name matches PATTERN (a name or a glob; the first "
        "match wins): their devices' traffic into the domain spreads over them (a DGX has one per GPU) |"
    )
    rows.append(
        "| `plan.nodes.PATTERN` | nodes of only `cpu` devices: 'cpu' | device kind of the nodes whose name "
        "matches PATTERN (a name or a glob such as 'ib*'; the first match wins); a catalogue kind or a "
        "[plan.kinds.NAME] |"
    )
    return (
        "| key | default | meaning |\n| --- | --- | --- |\n"
        + "\n".join(rows)
        + "\n\nBuilt-in device kinds (hetero_llm/planner/catalogue.py; the sources below the table):\n\n"
        + catalogue.catalogue_markdown()
    )
