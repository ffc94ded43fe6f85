"""Layouts: the TOML a user writes, loaded once into frozen attrs classes.

This is the only module that touches the raw TOML dict. Every key is declared once, on an attrs
field (type, default, docstring in ``metadata["doc"]``); unknown keys are errors with a did-you-mean,
because a silently ignored typo (``train.stpes``) is the classic way a TOML config lies to its user.
Imports no torch: ``--dry-run``, planning and most tests run anywhere.
"""

from __future__ import annotations

import difflib
import enum
import ipaddress
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

import attrs

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.9/3.10 only
    import tomli as tomllib

from hetero_llm.errors import LayoutError


def _doc(text: str, **kw: Any) -> Any:
    return attrs.field(metadata={"doc": text}, **kw)


class Schedule(str, enum.Enum):
    """Pipeline schedule kind (``train.schedule``)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"  # interleaved 1F1B: train.chunks model chunks per rank
    DYNAMIC = "dynamic"  # MegatronDPP: run the highest-priority action whose input has arrived
    ZBH1 = "zbh1"  # zero-bubble ZB-H1: backward split into input (I) and weight (W) gradients


class Norm(str, enum.Enum):
    LAYERNORM = "layernorm"
    RMSNORM = "rmsnorm"


class Position(str, enum.Enum):
    LEARNED = "learned"
    ROPE = "rope"


class Mlp(str, enum.Enum):
    GELU = "gelu"
    SWIGLU = "swiglu"


class DataKind(str, enum.Enum):
    GRAMMAR = "grammar"
    TEXT = "text"
    JSONL = "jsonl"
    TOKENS = "tokens"  # a pre-tokenized .bin/.npy file (hetero-tokenize, nanoGPT)


class TokenDtype(str, enum.Enum):
    """Width of the ids in a .bin token file (``data.token_dtype``)."""

    UINT16 = "uint16"  # nanoGPT's; vocabularies up to 65536
    UINT32 = "uint32"


class Packing(str, enum.Enum):
    """How a step's tokens form rows (``data.packing``)."""

    NONE = "none"  # random windows of seq_len + 1 tokens, crossing document boundaries
    DOCUMENTS = "documents"  # whole documents packed into rows, attention masked to each document


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
    SHM = "shm"  # shared memory (hetero_llm/shm.py) for every boundary inside this node; needs backend gloo
    NETWORK = "network"  # the boundary's process group (gloo over TCP, or NCCL), like a boundary between nodes


# Transport names a plan group can carry besides a domain name (so no domain may be called any of them).
DEFAULT_TRANSPORT = "default"  # no [[cluster.domains]]: the process's own network settings
CROSS_DOMAIN = "cross_domain"  # a group whose members are in more than one domain
SHM = "shm"  # a stage-boundary group inside one node that moves its tensors through shared memory

# NCCL variables a domain may set: the network-selection ones Holmes-style domains need, plus common
# tuning knobs. Anything else named NCCL_* is more likely a typo than a wish (did-you-mean).
NCCL_VARIABLES = (
    "NCCL_NET", "NCCL_NET_PLUGIN", "NCCL_IB_HCA", "NCCL_IB_GID_INDEX", "NCCL_IB_ROCE_VERSION_NUM",
    "NCCL_IB_TC", "NCCL_IB_SL", "NCCL_IB_TIMEOUT", "NCCL_IB_RETRY_CNT", "NCCL_IB_QPS_PER_CONNECTION",
    "NCCL_IB_PCI_RELAXED_ORDERING", "NCCL_IB_ADAPTIVE_ROUTING", "NCCL_IB_DISABLE", "NCCL_IB_MERGE_NICS",
    "NCCL_NET_GDR_LEVEL", "NCCL_NET_GDR_READ", "NCCL_SOCKET_IFNAME", "NCCL_SOCKET_FAMILY",
    "NCCL_SOCKET_NTHREADS", "NCCL_NSOCKS_PERTHREAD", "NCCL_CROSS_NIC", "NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE",
    "NCCL_ALGO", "NCCL_PROTO", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS", "NCCL_BUFFSIZE", "NCCL_DEBUG",
    "NCCL_DEBUG_SUBSYS", "NCCL_TOPO_FILE",
)


class Precision(str, enum.Enum):
    """Compute precision (``train.precision``); parameters and AdamW state are float32 either way."""

    FP32 = "fp32"
    BF16 = "bf16"


class Recompute(str, enum.Enum):
    """Activation recomputation (``train.recompute``, ``pipelines.stages.recompute``)."""

    NONE = "none"
    FULL = "full"  # keep only each block's input; recompute the block in backward


class Optimizer(str, enum.Enum):
    """``train.optimizer``: where AdamW's state lives."""

    ADAMW = "adamw"  # every rank keeps the moments of every parameter shard it holds
    ADAMW_ZERO1 = "adamw_zero1"  # each gradient-sync block's holders split its moments (docs/zero1.md)


class Compile(str, enum.Enum):
    """``torch.compile`` regions (``train.compile``)."""

    NONE = "none"
    BLOCKS = "blocks"  # each transformer block (one compiled graph, reused by every block)


@attrs.frozen
class ModelSpec:
    """``[model]``: a GPT/Llama-style decoder-only transformer."""

    layers: int = _doc("number of transformer blocks")
    hidden: int = _doc("model width (channels)")
    heads: int = _doc("attention heads; TP sizes must divide it")
    vocab: int = _doc("vocabulary size; >= the data's vocabulary (grammar: grammar_vocab; text: 256)")
    seq_len: int = _doc("tokens per training sequence")
    ffn: int = _doc("MLP inner width; 0 means 4 * hidden", default=0)
    norm: Norm = _doc("'layernorm' (GPT) or 'rmsnorm' (Llama)", default=Norm.LAYERNORM)
    position: Position = _doc("'learned' absolute embeddings (GPT) or 'rope' (Llama)", default=Position.LEARNED)
    mlp: Mlp = _doc("'gelu' (GPT) or 'swiglu' (Llama)", default=Mlp.GELU)
    init_std: float = _doc("std of the normal init of weight matrices", default=0.02)
    norm_eps: float = _doc("epsilon of every layernorm/rmsnorm (GPT-2: 1e-5; Llama: 1e-5 or 1e-6)", default=1e-5)
    rope_theta: float = _doc("RoPE base: position p rotates pair j by p / rope_theta^(2j / head size) "
                             "(Llama 2: 10000; Llama 3: 500000)", default=10000.0)
    kv_heads: int = _doc("key/value heads (grouped-query attention: each serves heads / kv_heads query heads); "
                         "0 means heads (plain multi-head attention); TP sizes must divide it", default=0)
    tie_embeddings: bool = _doc("the output head reuses the token embedding (GPT-2); with pipelines the first "
                                "and last stage each hold it and sum its gradient", default=False)
    bias: bool = _doc("biases on the attention and MLP projections (GPT-2); norms keep theirs either way",
                      default=False)
    init_from: str = _doc("a local Hugging Face model directory (config.json + model.safetensors, Llama or "
                          "GPT-2) to start from instead of the seeded init; relative to the layout file; "
                          "its config must match this [model]", default="")

    @property
    def ffn_width(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_heads_n(self) -> int:
        """Key/value heads: ``kv_heads``, or ``heads`` when it is 0."""
        return self.kv_heads or self.heads


@attrs.frozen
class TrainSpec:
    """``[train]``: the optimization, identical for every layout of one model."""

    steps: int = _doc("optimizer steps")
    global_batch: int = _doc("sequences per step, summed over pipelines")
    seed: int = _doc("seed of initialization and data order", default=0)
    schedule: Schedule = _doc("'gpipe', '1f1b', 'interleaved' (with chunks), 'dynamic' (run what is ready), or "
                              "'zbh1' (zero-bubble: each backward split into input and weight gradients, the "
                              "weight gradients filling 1F1B's bubbles; keeps up to stages microbatches in "
                              "flight on every stage)", default=Schedule.ONE_F_ONE_B)
    chunks: int = _doc("model chunks (virtual stages) per rank for 'interleaved'; 1 otherwise", default=1)
    lr: float = _doc("peak learning rate (after warmup)", default=1e-3)
    min_lr: float = _doc("learning rate at the end of the cosine decay", default=1e-4)
    warmup_steps: int = _doc("linear warmup steps from 0 to lr", default=0)
    weight_decay: float = _doc("AdamW decoupled weight decay (matrices only)", default=0.0)
    beta1: float = _doc("AdamW beta1", default=0.9)
    beta2: float = _doc("AdamW beta2", default=0.95)
    eps: float = _doc("AdamW epsilon", default=1e-8)
    grad_clip: float = _doc("clip the global gradient norm to this; 0 disables", default=1.0)
    optimizer: Optimizer = _doc(
        "'adamw' (every rank keeps AdamW moments for all it holds) or 'adamw_zero1' (ZeRO-1: the holders of each "
        "gradient-sync block reduce-scatter its gradient, each updates the moments of its own slice, sized by "
        "TP size x node memory_gb, and all-gather the parameters back; docs/zero1.md)", default=Optimizer.ADAMW)
    log_every: int = _doc("print progress every N steps", default=1)
    eval_every: int = _doc("compute the held-out loss every N steps and after the last; 0 = never", default=0)
    eval_batches: int = _doc("held-out batches of global_batch sequences per evaluation: the same ones every "
                             "time, whatever the layout", default=4)
    precision: Precision = _doc(
        "'fp32' or 'bf16': bf16 computes every stage in bfloat16 from float32 master weights (AdamW state "
        "and accumulated gradients stay float32; activations and their gradients cross stage boundaries "
        "in bf16, halving p2p traffic; the loss is float32). Layouts then agree to the bf16 tolerance "
        "(per-step loss within 1e-2 relative), not float32's 1e-5", default=Precision.FP32)
    recompute: Recompute = _doc("'none' or 'full': recompute each transformer block's activations in backward "
                                "(keeps only block inputs: less memory, about one more forward of compute); "
                                "the default for stages that do not set their own", default=Recompute.NONE)
    compile: Compile = _doc("'none' or 'blocks': torch.compile each transformer block's apply (the first steps "
                            "are slower while it compiles; on CPU it needs a C++ compiler)", default=Compile.NONE)


@attrs.frozen
class DataSpec:
    """``[data]``: where the tokens come from."""

    kind: DataKind = _doc("'grammar' (embedded, known loss floor), 'text', 'jsonl' or 'tokens' (a pre-tokenized "
                          ".bin or .npy file, memory-mapped)", default=DataKind.GRAMMAR)
    path: str = _doc("text/jsonl/token file, relative to the layout file; '' for grammar", default="")
    field: str = _doc("JSONL key holding the text", default="text")
    tokenizer: str = _doc("'bytes' (token = byte, vocab 256) or a local Hugging Face tokenizer.json, relative to the "
                          "layout file; every document ends with its end-of-document token", default="bytes")
    valid_path: str = _doc("held-out file of the same kind (and tokenizer) for train.eval_every, relative to the "
                           "layout file; '' = none", default="")
    valid_fraction: float = _doc("hold out this last fraction of data.path's tokens instead of a valid_path "
                                 "(training never samples them); 0 = none", default=0.0)
    token_dtype: TokenDtype = _doc("'uint16' (nanoGPT) or 'uint32': the ids of a .bin token file (a .npy file "
                                   "says its own)", default=TokenDtype.UINT16)
    grammar_seed: int = _doc("seed of the grammar itself (not of the data order)", default=1234)
    grammar_vocab: int = _doc("tokens the grammar uses", default=64)
    branching: int = _doc("possible successors of each grammar context", default=4)
    packing: Packing = _doc("'none': each row is a window of seq_len + 1 tokens cut anywhere in the data; "
                            "'documents': whole documents (at most seq_len + 1 tokens; longer ones are cut) "
                            "packed into the global_batch rows of seq_len, attention kept inside each document "
                            "and positions restarting in each, the loss averaged over real targets "
                            "(see docs/hot_switching.md)", default=Packing.NONE)
    separator: str = _doc("with packing = 'documents' and kind = 'text': the string between documents; '' "
                          "makes the whole file one document (cut to seq_len + 1 tokens)", default="\n\n")
    doc_len_median: float = _doc("with packing = 'documents' and kind = 'grammar': median document length in "
                                 "tokens (lengths are lognormal, clipped to [2, seq_len + 1])", default=32.0)
    doc_len_sigma: float = _doc("with packing = 'documents' and kind = 'grammar': standard deviation of the log "
                                "of document lengths (larger: a longer tail)", default=1.0)


@attrs.frozen
class NodeSpec:
    """``[[cluster.nodes]]``: one host."""

    name: str = _doc("node name used in device ids ('node0' -> 'node0:1')")
    host: str = _doc("address other nodes reach this host at: a host name or IP address, no port "
                    "(that is cluster.port)", default="127.0.0.1")
    devices: tuple[str, ...] = _doc("local devices in index order: 'cpu' or 'cuda:N'", default=("cpu",))
    domain: str = _doc("name of the [[cluster.domains]] entry this node's NICs are in; '' when the cluster "
                       "declares no domains", default="")
    speed: float = _doc("relative compute speed of each of this node's devices (1.0 = reference); placement "
                        "gives faster stages more layers", default=1.0)
    memory_gb: float = _doc("memory per device in GB for placement's layer cap; 0 = no cap", default=0.0)
    p2p: P2P = _doc("stage boundaries between this node's own ranks: 'auto' (shared memory between CPU ranks, "
                    "the network otherwise; the network too if /dev/shm is missing or too small, with a warning), "
                    "'shm' (shared memory, an error if /dev/shm cannot hold the ring buffers; backend gloo only) "
                    "or 'network' (the boundary's process group, as between nodes)", default=P2P.AUTO)


@attrs.frozen
class DomainSpec:
    """``[[cluster.domains]]``: one network domain, i.e. a NIC kind and the fabric joining its nodes."""

    name: str = _doc("domain name that nodes refer to ('ib0'); letters, digits, '-' or '_'")
    kind: DomainKind = _doc("'ib', 'roce', 'ethernet' or 'other'")
    bandwidth_gbps: float = _doc("bandwidth of one NIC inside the domain, Gbit/s")
    latency_us: float = _doc("one-way latency between two nodes of the domain, microseconds")
    gloo_ifname: str = _doc("network interface gloo binds this domain's groups to, e.g. 'ib0' (IPoIB) or "
                            "'eth1'; '' = the process default (GLOO_SOCKET_IFNAME or the hostname's address)",
                            default="")
    nccl: tuple[tuple[str, str], ...] = _doc("NCCL variables for this domain's communicators, as a table: "
                                             "[cluster.domains.nccl] NCCL_IB_HCA = 'mlx5_0'", default=())

    @property
    def nccl_env(self) -> dict[str, str]:
        return dict(self.nccl)


@attrs.frozen
class CrossDomainSpec:
    """``[cluster.cross_domain]``: the network between domains, used by every group spanning domains."""

    bandwidth_gbps: float = _doc("bandwidth of one node's cross-domain NIC, Gbit/s; 0 = not given", default=0.0)
    latency_us: float = _doc("one-way latency between domains, microseconds; 0 = not given", default=0.0)
    gloo_ifname: str = _doc("network interface gloo binds cross-domain groups to; '' = the process default",
                            default="")
    nccl: tuple[tuple[str, str], ...] = _doc("NCCL variables for cross-domain communicators, e.g. "
                                             "{ NCCL_NET = 'Socket', NCCL_SOCKET_IFNAME = 'eth0' }", default=())

    @property
    def nccl_env(self) -> dict[str, str]:
        return dict(self.nccl)


@attrs.frozen
class ClusterSpec:
    """``[cluster]``: the hosts and how ranks meet."""

    nodes: tuple[NodeSpec, ...] = _doc("the hosts")
    master: str = _doc("node whose host serves rendezvous; '' means the first node", default="")
    port: int = _doc("rendezvous TCP port (MASTER_PORT overrides)", default=29511)
    backend: Backend = _doc("'gloo' (CPU, default) or 'nccl' (CUDA)", default=Backend.GLOO)
    timeout_s: float = _doc("seconds to wait for every rank to arrive; at least 1", default=60.0)
    domains: tuple[DomainSpec, ...] = _doc("network domains; none declared means one implicit domain whose "
                                           "groups all use the process's own network settings", default=())
    cross_domain: CrossDomainSpec = _doc("the network between domains (a table)", default=CrossDomainSpec())
    comm: CommLib = _doc("'torch' (process groups for everything) or 'cupy' (CuPy NCCL communicators for "
                         "gradient sync; needs CUDA devices and cupy)", default=CommLib.TORCH)

    def node(self, name: str) -> NodeSpec:
        return next(n for n in self.nodes if n.name == name)

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


@attrs.frozen
class StageSpec:
    """``[[pipelines.stages]]``: contiguous layers on one TP group."""

    layers: int = _doc("number of transformer blocks in this stage")
    devices: tuple[str, ...] = _doc("device ids 'node:index'; their count is the stage's TP size")
    recompute: Recompute | None = _doc("'none' or 'full' for this stage (e.g. 'full' on a GPU short of memory); "
                                       "unset: train.recompute", default=None)

    @property
    def tp(self) -> int:
        return len(self.devices)


@attrs.frozen
class PipelineSpec:
    """``[[pipelines]]``: one data-parallel replica of the whole model."""

    batch: int = _doc("sequences of each global batch this pipeline trains on")
    microbatches: int = _doc("microbatches the batch is split into; must divide batch")
    stages: tuple[StageSpec, ...] = _doc("ordered stages; their layers sum to model.layers")
    schedule_file: str = _doc("a file of action strings (one line, or CSV column, per stage) to run instead of "
                              "train.schedule; relative to the layout file; '' for none", default="")


@attrs.frozen
class BucketSpec:
    """``[[buckets]]``: the documents up to a length, trained under their own layout (hot switching)."""

    max_len: int = _doc("longest document of the bucket in positions (a document of n tokens fills n - 1), above the "
                        "previous bucket's; also the width of the bucket's rows. Buckets go from shortest to "
                        "longest and the last one's max_len is model.seq_len")
    schedule: Schedule | None = _doc("this bucket's pipeline schedule; unset: train.schedule", default=None)
    chunks: int = _doc("model chunks per rank when this bucket's schedule is 'interleaved'; 0: train.chunks",
                       default=0)
    pipelines: tuple[PipelineSpec, ...] = _doc(
        "the bucket's layout, over devices of the home layout ([[pipelines]]); a pipeline's batch is its share of "
        "the bucket's rows (they are padded with empty rows to a multiple of the shares' sum and split in "
        "proportion); none: the bucket runs under the home layout", default=())


@attrs.frozen
class Layout:
    file: str
    model: ModelSpec
    train: TrainSpec
    data: DataSpec
    cluster: ClusterSpec
    pipelines: tuple[PipelineSpec, ...]  # the home layout: it holds the optimizer state and takes the step
    buckets: tuple[BucketSpec, ...] = ()  # hot switching: each bucket of document lengths under its own layout


# --------------------------------------------------------------------------------------------
# Loading


def load(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> Layout:
    """Read, override (``--set a.b=v``), type-check and validate a layout file."""
    file = str(path)
    p = Path(path)
    if p.is_dir():
        raise LayoutError(file, "", "is a folder, not a layout file (pass the path of a .toml layout, e.g. "
                          "layouts/quickstart.toml)")
    if not p.is_file():
        raise LayoutError(file, "", "no such layout file (pass the path of a .toml layout, e.g. layouts/quickstart.toml)")
    try:
        data = p.read_bytes()
    except OSError as e:
        raise LayoutError(file, "", f"cannot read the file: {e.strerror} (check its permissions)") from None
    if data.startswith(b"\xef\xbb\xbf"):
        raise LayoutError(file, "", "starts with a UTF-8 byte order mark (BOM), which TOML does not allow "
                          "(save the file as UTF-8 without BOM)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise LayoutError(file, "", f"line {line} is not UTF-8 text (save the file as UTF-8: TOML requires it)") from None
    if not text.strip():
        raise LayoutError(file, "", "file is empty (start from layouts/quickstart.toml)")
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise LayoutError(file, "", f"TOML syntax error: {e} (fix the TOML syntax there)") from None
    for item in overrides:
        _apply_override(raw, item, file)
    return from_dict(raw, file, base_dir=p.parent)


def loads(text: str, file: str = "<string>", base_dir: str | os.PathLike = ".") -> Layout:
    """Load a layout from TOML text (tests, generated layouts)."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise LayoutError(file, "", f"TOML syntax error: {e} (fix the TOML syntax there)") from None
    return from_dict(raw, file, base_dir=Path(base_dir))


_SECTIONS = {"model": ModelSpec, "train": TrainSpec, "data": DataSpec, "cluster": ClusterSpec}
_REQUIRED_SECTIONS = ("model", "train", "cluster", "pipelines")
_NESTED = {(ClusterSpec, "nodes"): NodeSpec, (ClusterSpec, "domains"): DomainSpec, (PipelineSpec, "stages"): StageSpec,
           (BucketSpec, "pipelines"): PipelineSpec}
# Fields holding one table rather than an array of tables: (class, field) -> converter(value, where, file).
_TABLES = {
    (ClusterSpec, "cross_domain"): lambda v, where, file: _one_table(CrossDomainSpec, v, where, file),
    (DomainSpec, "nccl"): lambda v, where, file: _nccl_table(v, where, file),
    (CrossDomainSpec, "nccl"): lambda v, where, file: _nccl_table(v, where, file),
}


def from_dict(raw: dict, file: str, base_dir: Path) -> Layout:
    _check_keys(raw, list(_SECTIONS) + ["pipelines", "buckets"], "", file, what="section")
    for name in _REQUIRED_SECTIONS:
        if name not in raw:
            hint = "[[pipelines]]" if name == "pipelines" else f"[{name}]"
            raise LayoutError(file, name, f"missing section (add a {hint} section; see layouts/quickstart.toml)")
    sections = {name: _build(cls, raw.get(name, {}), name, file) for name, cls in _SECTIONS.items()}
    pipes = raw["pipelines"]
    if not isinstance(pipes, list) or not pipes:
        raise LayoutError(file, "pipelines", "expected one or more [[pipelines]] tables")
    pipelines = tuple(_build(PipelineSpec, t, f"pipelines[{i}]", file) for i, t in enumerate(pipes))
    pipelines = _resolve_schedule_files(pipelines, base_dir)
    buckets = raw.get("buckets", [])
    if not isinstance(buckets, list) or not buckets and "buckets" in raw:
        raise LayoutError(file, "buckets", "expected one or more [[buckets]] tables")
    buckets = tuple(_build(BucketSpec, t, f"buckets[{i}]", file) for i, t in enumerate(buckets))
    buckets = tuple(attrs.evolve(b, pipelines=_resolve_schedule_files(b.pipelines, base_dir)) for b in buckets)
    if sections["model"].init_from:
        sections["model"] = attrs.evolve(sections["model"], init_from=str(base_dir / sections["model"].init_from))
    data = sections["data"]
    if data.path:
        data = attrs.evolve(data, path=str((base_dir / data.path)))
    if data.tokenizer != "bytes":
        data = attrs.evolve(data, tokenizer=str(base_dir / data.tokenizer))
    if data.valid_path:
        data = attrs.evolve(data, valid_path=str(base_dir / data.valid_path))
    layout = Layout(file=file, model=sections["model"], train=sections["train"], data=data,
                    cluster=sections["cluster"], pipelines=pipelines, buckets=buckets)
    validate(layout)
    return layout


def _resolve_schedule_files(pipelines: tuple[PipelineSpec, ...], base_dir: Path) -> tuple[PipelineSpec, ...]:
    return tuple(attrs.evolve(p, schedule_file=str(base_dir / p.schedule_file)) if p.schedule_file else p
                 for p in pipelines)


def _check_keys(table: dict, allowed: list[str], path: str, file: str, what: str = "key") -> None:
    for key in table:
        if key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else f" (known: {', '.join(allowed)})"
            where = f"{path}.{key}" if path else key
            raise LayoutError(file, where, f"unknown {what} '{key}'{hint}")


def _build(cls: type, table: Any, path: str, file: str) -> Any:
    if not isinstance(table, dict):
        raise LayoutError(file, path, f"expected a table, got {_type_name(table)}")
    fields = attrs.fields(cls)
    _check_keys(table, [f.name for f in fields], path, file)
    kwargs = {}
    for f in fields:
        where = f"{path}.{f.name}"
        if f.name not in table:
            if f.default is attrs.NOTHING:
                raise LayoutError(file, where, f"missing required key ({f.metadata['doc']})")
            continue
        value = table[f.name]
        nested = _NESTED.get((cls, f.name))
        if nested is not None:
            if not isinstance(value, list) or not value:
                array = re.sub(r"\[\d+\]", "", where)  # pipelines[0].stages -> pipelines.stages
                raise LayoutError(file, where, f"expected one or more [[{array}]] tables")
            kwargs[f.name] = tuple(_build(nested, t, f"{where}[{i}]", file) for i, t in enumerate(value))
        elif (cls, f.name) in _TABLES:
            kwargs[f.name] = _TABLES[(cls, f.name)](value, where, file)
        else:
            kwargs[f.name] = _convert(value, f.type, where, file)
    return cls(**kwargs)


def spec_dict(spec: Any) -> dict[str, Any]:
    """A flat spec (``ModelSpec``, ``DataSpec``) as the TOML table it loads from: enums as their values."""
    return {f.name: getattr(getattr(spec, f.name), "value", getattr(spec, f.name)) for f in attrs.fields(type(spec))}


def model_from_dict(table: dict, file: str) -> ModelSpec:
    """A ``ModelSpec`` from a ``spec_dict`` table (a checkpoint's meta.json), type-checked like [model]."""
    return _build(ModelSpec, table, "model", file)


def _one_table(cls: type, value: Any, where: str, file: str) -> Any:
    if isinstance(value, list):
        raise LayoutError(file, where, f"expected one [{where}] table, got an array of tables "
                          f"(write [{where}] with single brackets)")
    return _build(cls, value, where, file)


def _nccl_table(value: Any, where: str, file: str) -> tuple[tuple[str, str], ...]:
    """An ``nccl`` table: known NCCL variable names, values as the text NCCL will read."""
    if not isinstance(value, dict):
        raise LayoutError(file, where, f"expected a table of NCCL variables, got {_type_name(value)} "
                          "(e.g. nccl = { NCCL_IB_HCA = \"mlx5_0\" })")
    out = []
    for key, v in value.items():
        at = f"{where}.{key}"
        if key not in NCCL_VARIABLES:
            close = difflib.get_close_matches(key.upper(), NCCL_VARIABLES, n=1)
            if not close and not key.upper().startswith("NCCL_"):
                close = difflib.get_close_matches("NCCL_" + key.upper(), NCCL_VARIABLES, n=1)
            hint = f"did you mean '{close[0]}'?" if close else "docs/domains.md lists the accepted names"
            raise LayoutError(file, at, f"unknown NCCL variable '{key}' ({hint})")
        if isinstance(v, bool) or not isinstance(v, (str, int)):
            raise LayoutError(file, at, f"expected a string or an integer, got {_type_name(v)} "
                              "(NCCL reads its variables as text, e.g. \"1\")")
        if isinstance(v, str) and not v.strip():
            raise LayoutError(file, at, "is empty (remove it to keep NCCL's default)")
        out.append((key, str(v)))
    return tuple(out)


def _type_name(v: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a float", str: "a string",
            list: "an array", dict: "a table"}.get(type(v), type(v).__name__) + f" ({v!r})"


def _convert(value: Any, annotation: str, where: str, file: str) -> Any:
    """Check one scalar/array value against a field's annotation (a string under PEP 563)."""
    annotation = annotation.removesuffix(" | None")  # optional keys: TOML has no null, so a value is given
    enum_cls = {"Schedule": Schedule, "Norm": Norm, "Position": Position, "Mlp": Mlp,
                "DataKind": DataKind, "Packing": Packing, "TokenDtype": TokenDtype, "Backend": Backend,
                "DomainKind": DomainKind, "CommLib": CommLib, "Precision": Precision, "Recompute": Recompute,
                "Compile": Compile, "Optimizer": Optimizer, "P2P": P2P}.get(annotation)
    if enum_cls is not None:
        choices = [m.value for m in enum_cls]
        if not isinstance(value, str):
            raise LayoutError(file, where, f"expected a string, got {_type_name(value)} (choose one of: {', '.join(choices)})")
        if value not in choices:
            # case-insensitive first: "1F1B" and "GPipe" are the likeliest slips
            lowered = {c.lower(): c for c in choices}
            close = [lowered[value.lower()]] if value.lower() in lowered else \
                difflib.get_close_matches(value.lower(), choices, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise LayoutError(file, where, f"unknown value {value!r} ({hint}choose one of: {', '.join(choices)})")
        return enum_cls(value)
    if annotation in ("int", "float"):
        wanted = "an integer" if annotation == "int" else "a number"
        ok = (int,) if annotation == "int" else (int, float)
        if isinstance(value, bool) or not isinstance(value, ok):
            fix = ""
            if isinstance(value, str):
                try:
                    unquoted = tomllib.loads(f"v = {value}")["v"]
                except tomllib.TOMLDecodeError:
                    unquoted = None
                if isinstance(unquoted, ok) and not isinstance(unquoted, bool):
                    fix = " (remove the quotes)"
            elif annotation == "int" and isinstance(value, float) and value.is_integer():
                fix = f" (write {int(value)})"
            raise LayoutError(file, where, f"expected {wanted}, got {_type_name(value)}{fix}")
        if annotation == "float" and not math.isfinite(value):
            raise LayoutError(file, where, f"expected a finite number, got {value!r}")
        return value if annotation == "int" else float(value)
    if annotation == "bool":
        if not isinstance(value, bool):
            raise LayoutError(file, where, f"expected true or false, got {_type_name(value)}")
        return value
    if annotation == "str":
        if not isinstance(value, str):
            raise LayoutError(file, where, f"expected a string, got {_type_name(value)} (put it in quotes)")
        return value
    if annotation == "tuple[str, ...]":
        if not isinstance(value, list):
            raise LayoutError(file, where, f"expected an array of strings, got {_type_name(value)} (put the values in [ ], each in quotes)")
        for i, v in enumerate(value):
            if not isinstance(v, str):
                raise LayoutError(file, f"{where}[{i}]", f"expected a string, got {_type_name(v)} (put it in quotes)")
        return tuple(value)
    raise TypeError(f"layout field type {annotation!r} has no converter")  # a bug here, not user input


# --------------------------------------------------------------------------------------------
# --set overrides


_SEGMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(?:\[(\d+)\])?$")


def _apply_override(raw: dict, item: str, file: str) -> None:
    """Apply ``a.b[0].c=value`` (``a.b.0.c`` also accepted); the value is parsed as TOML."""
    if "=" not in item:
        raise LayoutError(file, f"--set {item}", "expected KEY=VALUE (e.g. --set train.steps=5)")
    key, _, text = item.partition("=")
    key = key.strip()
    if not key:
        raise LayoutError(file, f"--set {item}", "no key before '=' (e.g. --set train.steps=5)")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text  # bare words are strings: --set data.kind=text
    segments: list[str | int] = []
    for part in key.split("."):
        if part.isascii() and part.isdigit():
            segments.append(int(part))
            continue
        m = _SEGMENT.match(part)
        if not m:
            raise LayoutError(file, f"--set {key}", f"cannot parse key segment '{part}' (use e.g. pipelines[0].batch)")
        segments.append(m.group(1))
        if m.group(2) is not None:
            segments.append(int(m.group(2)))
    _check_override_path(segments, key, file)
    node: Any = raw
    done = ""  # the part of the key walked so far, for messages
    for i, seg in enumerate(segments):
        if isinstance(seg, int):
            if not isinstance(node, list):
                raise LayoutError(file, f"--set {key}", f"'{done}' is not an array (drop the index [{seg}])")
            if seg >= len(node):
                have = f"{done} has {len(node)} entr{'y' if len(node) == 1 else 'ies'}"
                fix = f"use an index below {len(node)}" if node else "add one to the file first"
                raise LayoutError(file, f"--set {key}", f"index {seg} is out of range: {have} ({fix})")
            if i == len(segments) - 1:
                if isinstance(node[seg], dict):
                    raise LayoutError(file, f"--set {key}", "cannot replace a whole table (set one of its keys)")
                node[seg] = value  # one entry of a plain array: --set pipelines.0.stages.0.devices.0=node0:1
                return
            node = node[seg]
            done += f"[{seg}]"
            continue
        if isinstance(node, list):
            raise LayoutError(file, f"--set {key}", f"'{done}' is an array of tables (pick one, e.g. {done}[0].{seg})")
        if not isinstance(node, dict):
            raise LayoutError(file, f"--set {key}", f"'{done}' is a value, not a table (set '{done}' itself)")
        if i == len(segments) - 1:
            node[seg] = value
            return
        node = node.setdefault(seg, [] if isinstance(segments[i + 1], int) else {})
        done = f"{done}.{seg}" if done else seg


def _check_override_path(segments: list[str | int], key: str, file: str) -> None:
    """Reject --set keys that are not in the schema, even where the file leaves them at a default."""
    cls: type | None = None
    for n, seg in enumerate(segments):
        if isinstance(seg, int):
            continue
        if cls is dict:  # a free-key table (nccl): the loader checks the name
            cls = None
            continue
        if cls is None and n > 0:  # the previous key was a value, not a table
            done = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in segments[:n]).lstrip(".")
            raise LayoutError(file, f"--set {key}", f"'{done}' is a value, not a table (set '{done}' itself)")
        if cls is None:
            allowed = list(_SECTIONS) + ["pipelines", "buckets"]
            if seg not in allowed:
                close = difflib.get_close_matches(seg, allowed, n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                raise LayoutError(file, f"--set {key}", f"unknown section '{seg}'{hint}")
            cls = {"pipelines": PipelineSpec, "buckets": BucketSpec}.get(seg) or _SECTIONS[seg]
            continue
        names = [f.name for f in attrs.fields(cls)]
        if seg not in names:
            close = difflib.get_close_matches(seg, names, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else f" (known: {', '.join(names)})"
            raise LayoutError(file, f"--set {key}", f"unknown key '{seg}'{hint}")
        table = _TABLES.get((cls, seg))
        cls = _NESTED.get((cls, seg)) or (None if table is None else
                                          CrossDomainSpec if seg == "cross_domain" else dict)


# --------------------------------------------------------------------------------------------
# Validation: everything that a single field cannot check by itself.


def _positive(layout: Layout, obj: Any, path: str, names: list[str], minimum: int = 1) -> None:
    for name in names:
        value = getattr(obj, name)
        if value < minimum:
            raise LayoutError(layout.file, f"{path}.{name}", f"must be >= {minimum}, got {value}")


def validate(layout: Layout) -> None:
    f = layout.file
    m, t, d, c = layout.model, layout.train, layout.data, layout.cluster
    _positive(layout, m, "model", ["layers", "hidden", "heads", "vocab", "seq_len"])
    _positive(layout, m, "model", ["ffn"], minimum=0)
    _positive(layout, t, "train", ["steps", "global_batch", "log_every", "chunks"])
    _positive(layout, t, "train", ["warmup_steps"], minimum=0)
    if m.hidden % m.heads:
        raise LayoutError(f, "model.heads", f"{m.heads} heads do not divide hidden {m.hidden} (pick a divisor of {m.hidden})")
    if m.position is Position.ROPE and m.head_dim % 2:
        raise LayoutError(f, "model.heads", f"rope needs an even head size (hidden / heads), got {m.head_dim} "
                          f"(pick heads so that {m.hidden} / heads is even, or position = 'learned')")
    _positive(layout, t, "train", ["seed"], minimum=0)  # numpy seeds the data stream; it rejects negatives
    for name in ("lr", "min_lr", "weight_decay", "eps"):
        if getattr(t, name) < 0:
            raise LayoutError(f, f"train.{name}", f"must be >= 0, got {getattr(t, name)}")
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(t, name) < 1:
            raise LayoutError(f, f"train.{name}", f"must be in [0, 1), got {getattr(t, name)} (AdamW's usual values: 0.9, 0.95)")
    if t.grad_clip < 0:
        raise LayoutError(f, "train.grad_clip", f"must be >= 0 (0 disables clipping), got {t.grad_clip}")
    if m.init_std < 0:
        raise LayoutError(f, "model.init_std", f"must be >= 0, got {m.init_std}")
    _validate_model_options(layout)
    if d.kind is DataKind.GRAMMAR:
        _positive(layout, d, "data", ["grammar_seed"], minimum=0)  # numpy rejects negative seeds
        if d.tokenizer != "bytes":
            raise LayoutError(f, "data.tokenizer", "is set but data.kind is 'grammar', which has its own tokens "
                              "(set data.kind = 'text' or 'jsonl', or remove data.tokenizer)")
        if d.path:  # a forgotten data.kind would otherwise train on the grammar without a word
            raise LayoutError(f, "data.path", "is set but data.kind is 'grammar', which reads no file "
                              "(set data.kind = 'text' or 'jsonl', or remove data.path)")
    _validate_data(layout)
    _validate_eval(layout)

    validate_cluster(f, c)

    # pipelines
    used: dict[str, str] = {}
    gpus: dict[tuple[str, str], str] = {}  # (host, 'cuda:N') -> device id, for NCCL's one rank per GPU
    total_batch = 0
    for pi, pipe in enumerate(layout.pipelines):
        pp = f"pipelines[{pi}]"
        _positive(layout, pipe, pp, ["batch", "microbatches"])
        if pipe.batch % pipe.microbatches:
            raise LayoutError(f, f"{pp}.microbatches", f"{pipe.microbatches} microbatches do not divide the pipeline's batch "
                              f"{pipe.batch} (use a divisor of {pipe.batch})")
        total_batch += pipe.batch
        layer_sum = 0
        for si, stage in enumerate(pipe.stages):
            sp = f"{pp}.stages[{si}]"
            _positive(layout, stage, sp, ["layers"])
            layer_sum += stage.layers
            if not stage.devices:
                raise LayoutError(f, f"{sp}.devices", "a stage needs at least one device (list device ids, e.g. [\"node0:0\"])")
            tp = stage.tp
            if m.heads % tp:
                raise LayoutError(f, f"{sp}.devices", f"TP size {tp} does not divide heads ({m.heads}) (use a TP size dividing {m.heads})")
            if m.kv_heads_n % tp:
                raise LayoutError(f, f"{sp}.devices", f"TP size {tp} does not divide model.kv_heads ({m.kv_heads_n}) "
                                  f"(use a TP size dividing {m.kv_heads_n})")
            if m.ffn_width % tp:
                raise LayoutError(f, f"{sp}.devices", f"TP size {tp} does not divide the MLP width ({m.ffn_width}) "
                                  f"(use a TP size dividing {m.ffn_width}, or a model.ffn divisible by {tp})")
            for di, dev in enumerate(stage.devices):
                where = f"{sp}.devices[{di}]"
                _check_device_id(layout, dev, where)
                if dev in used:
                    raise LayoutError(f, where, f"device '{dev}' is already used by {used[dev]} (each device runs one rank)")
                used[dev] = sp
                node_name, _, index = dev.partition(":")
                node = c.node(node_name)
                local = node.devices[int(index)]
                if c.backend is Backend.NCCL and local == "cpu":
                    raise LayoutError(f, where, f"device '{dev}' is 'cpu' but cluster.backend is 'nccl' "
                                      "(NCCL needs CUDA devices: list 'cuda:N' devices or use backend = 'gloo')")
                if c.backend is Backend.NCCL and gpus.setdefault((node.host, local), dev) != dev:
                    other = gpus[(node.host, local)]
                    raise LayoutError(f, where, f"device '{dev}' is {local} on host {node.host}, like '{other}' "
                                      "(NCCL runs one rank per GPU: give each rank its own GPU, or use backend = 'gloo')")
        _validate_pipeline_schedule(layout, pi)
        if layer_sum != m.layers:
            counts = " + ".join(str(s.layers) for s in pipe.stages)
            raise LayoutError(f, f"{pp}.stages", f"stage layers sum to {layer_sum} ({counts}) but model.layers is {m.layers} "
                              f"(make them add up to {m.layers})")
    if total_batch != t.global_batch:
        shares = " + ".join(str(p.batch) for p in layout.pipelines)
        raise LayoutError(f, "pipelines", f"pipeline batches sum to {total_batch} ({shares}) but train.global_batch is "
                          f"{t.global_batch} (make them add up to {t.global_batch})")
    _validate_buckets(layout)


def bucket_layout(layout: Layout, index: int) -> Layout:
    """Bucket ``index``'s own layout: its pipelines (the home ones if it has none), schedule and chunks, and a
    global batch that is the sum of its pipelines' shares. The model is the same (its rows are ``max_len`` wide,
    a matter of the data, not of the parameters)."""
    b, t = layout.buckets[index], layout.train
    pipelines = b.pipelines or layout.pipelines
    schedule = b.schedule or t.schedule
    chunks = b.chunks or (t.chunks if schedule is t.schedule else 1)
    train = attrs.evolve(t, schedule=schedule, chunks=chunks, global_batch=sum(p.batch for p in pipelines))
    return attrs.evolve(layout, train=train, pipelines=pipelines, buckets=())


def _validate_buckets(layout: Layout) -> None:
    """Bounds ascend and end at seq_len; each bucket's layout is valid on its own, on home devices."""
    f, m = layout.file, layout.model
    if not layout.buckets:
        return
    if layout.data.packing is not Packing.DOCUMENTS:
        raise LayoutError(f, "buckets", "need data.packing = 'documents' (buckets sort whole documents by length)")
    if layout.train.optimizer is Optimizer.ADAMW_ZERO1:
        raise LayoutError(f, "train.optimizer", "'adamw_zero1' cannot run with [[buckets]] (its reduce-scatter starts "
                          "inside the home layout's backward, which a switching step may not run; use 'adamw')")
    home = {dev for p in layout.pipelines for st in p.stages for dev in st.devices}
    cuda = sorted(d for d in home if layout.cluster.node(d.partition(":")[0]).devices[int(d.partition(":")[2])] != "cpu")
    if cuda:  # the switch exchange is plain gloo send/recv of device tensors: CPU only until it is built for NCCL
        raise LayoutError(f, "buckets", f"hot switching runs on CPU devices only for now, and device '{cuda[0]}' is "
                          "a GPU (remove [[buckets]] to train under [[pipelines]] on GPUs)")
    previous = 0
    for bi, b in enumerate(layout.buckets):
        at = f"buckets[{bi}]"
        _positive(layout, b, at, ["max_len"])
        _positive(layout, b, at, ["chunks"], minimum=0)
        if b.max_len <= previous:
            raise LayoutError(f, f"{at}.max_len", f"{b.max_len} is not above buckets[{bi - 1}].max_len ({previous}) "
                              "(list buckets from shortest to longest, each bound above the one before)")
        if b.max_len > m.seq_len:
            raise LayoutError(f, f"{at}.max_len", f"{b.max_len} exceeds model.seq_len ({m.seq_len}): no document is "
                              f"longer (use at most {m.seq_len})")
        previous = b.max_len
        for pi, pipe in enumerate(b.pipelines):
            for si, stage in enumerate(pipe.stages):
                for di, dev in enumerate(stage.devices):
                    where = f"{at}.pipelines[{pi}].stages[{si}].devices[{di}]"
                    _check_device_id(layout, dev, where)
                    if dev not in home:
                        raise LayoutError(f, where, f"device '{dev}' is not in the home layout ([[pipelines]]); "
                                          "every bucket runs on the home layout's devices")
        try:
            validate(bucket_layout(layout, bi))
        except LayoutError as e:
            path = e.path
            if path.startswith("pipelines"):
                path = f"{at}.{path}"
            elif path in ("train.schedule", "train.chunks"):
                path = f"{at}.{path.removeprefix('train.')}"
            raise LayoutError(f, path, e.message) from None
    if previous != m.seq_len:
        raise LayoutError(f, f"buckets[{len(layout.buckets) - 1}].max_len", f"{previous} is below model.seq_len "
                          f"({m.seq_len}): documents of {previous + 1} to {m.seq_len} positions would fit no bucket "
                          f"(make the last bucket's max_len {m.seq_len})")


def _validate_model_options(layout: Layout) -> None:
    """``norm_eps``, ``rope_theta``, ``kv_heads``, ``init_from``: the options that reproduce Llama/GPT-2 models."""
    f, m = layout.file, layout.model
    if m.norm_eps <= 0:
        raise LayoutError(f, "model.norm_eps", f"must be > 0, got {m.norm_eps:g} (GPT-2 and Llama use 1e-5)")
    if m.rope_theta <= 0:
        raise LayoutError(f, "model.rope_theta", f"must be > 0, got {m.rope_theta:g} (Llama 2 uses 10000)")
    if m.kv_heads < 0:
        raise LayoutError(f, "model.kv_heads", f"must be >= 0 (0 = heads), got {m.kv_heads}")
    if m.heads % m.kv_heads_n:
        raise LayoutError(f, "model.kv_heads", f"{m.kv_heads} does not divide heads ({m.heads}) "
                          f"(use a divisor of {m.heads}, or 0 for one key/value head per query head)")
    if m.init_from:
        from hetero_llm import hf  # torch-free: reads config.json only

        hf.check_config(layout)


def read_cluster_file(path: str | os.PathLike, writer: str, extra: tuple[str, ...] = ()
                      ) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """A layout file without ``[[pipelines]]`` (the input of placement and the planner, named ``writer`` in the
    message that refuses pipelines): its text, raw TOML and typed sections, checked like a layout's cluster.
    ``extra``: sections the caller reads itself (e.g. the planner's ``[plan]``)."""
    file = str(path)
    p = Path(path)
    if not p.is_file():
        raise LayoutError(file, "", "no such file (pass a TOML file with [model], [train] and [cluster])")
    try:
        text = p.read_text()
        raw = tomllib.loads(text)
    except UnicodeDecodeError:
        raise LayoutError(file, "", "not UTF-8 text (save the file as UTF-8: TOML requires it)") from None
    except tomllib.TOMLDecodeError as e:
        raise LayoutError(file, "", f"TOML syntax error: {e} (fix the TOML syntax there)") from None
    _check_keys(raw, list(_SECTIONS) + ["pipelines", *extra], "", file, what="section")
    if "pipelines" in raw:
        raise LayoutError(file, "pipelines", f"the file already has [[pipelines]] ({writer} writes them: "
                          "start from a copy without them)")
    for name in ("model", "train", "cluster"):
        if name not in raw:
            raise LayoutError(file, name, f"missing section (add a [{name}] section)")
    sections = {name: _build(cls, raw.get(name, {}), name, file) for name, cls in _SECTIONS.items()}
    validate_cluster(file, sections["cluster"])
    return text, raw, sections


def validate_cluster(f: str, c: ClusterSpec) -> None:
    """The ``[cluster]`` checks, on their own: placement validates a cluster file that has no pipelines yet."""
    names = [n.name for n in c.nodes]
    seen_nodes: set[str] = set()
    for i, node in enumerate(c.nodes):
        if not re.fullmatch(r"[A-Za-z0-9_\-]+", node.name):
            raise LayoutError(f, f"cluster.nodes[{i}].name", f"'{node.name}' must be letters, digits, '-' or '_'")
        if node.name in seen_nodes:
            raise LayoutError(f, f"cluster.nodes[{i}].name", f"node '{node.name}' is declared twice (give each node its own name)")
        seen_nodes.add(node.name)
        if not node.devices:
            raise LayoutError(f, f"cluster.nodes[{i}].devices", "a node needs at least one device (e.g. devices = [\"cpu\"])")
        for j, dev in enumerate(node.devices):
            if not re.fullmatch(r"cpu|cuda:(0|[1-9][0-9]*)", dev):
                raise LayoutError(f, f"cluster.nodes[{i}].devices[{j}]", f"unknown device '{dev}' (use 'cpu' or 'cuda:N')")
        cuda = [dv for dv in node.devices if dv != "cpu"]
        if len(set(cuda)) != len(cuda):
            raise LayoutError(f, f"cluster.nodes[{i}].devices", f"a CUDA device is listed twice: {list(node.devices)} (list each GPU once)")
        if not node.host.strip():
            raise LayoutError(f, f"cluster.nodes[{i}].host", "is empty (give the address other nodes reach this host at, e.g. '127.0.0.1')")
        _check_host(f, f"cluster.nodes[{i}].host", node.host)
        if node.p2p is P2P.SHM and c.backend is not Backend.GLOO:
            raise LayoutError(f, f"cluster.nodes[{i}].p2p", f"'shm' moves host memory, but backend is '{c.backend.value}' "
                              "(NCCL keeps boundaries on the GPU and uses its own paths inside a node: set p2p = 'auto')")
    if c.master and c.master not in names:
        close = difflib.get_close_matches(c.master, names, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise LayoutError(f, "cluster.master", f"'{c.master}' is not a node ({hint}nodes: {', '.join(names)})")
    if not 1 <= c.port <= 65535:
        raise LayoutError(f, "cluster.port", f"must be a TCP port 1..65535, got {c.port}")
    if c.timeout_s <= 0:
        raise LayoutError(f, "cluster.timeout_s", f"must be > 0, got {c.timeout_s}")
    if c.timeout_s < MIN_TIMEOUT_S:
        raise LayoutError(f, "cluster.timeout_s", f"must be at least {MIN_TIMEOUT_S:g} s (the time ranks have to meet; "
                          f"the default is 60), got {c.timeout_s:g}")
    _validate_domains(f, c)


MIN_TIMEOUT_S = 1.0  # below this, ranks started together time out before they can meet


def _check_host(f: str, at: str, host: str) -> None:
    """A host name or an IP address (IPv6 literals have colons), not ``address:port`` or a URL."""
    try:
        ipaddress.ip_address(host.strip("[]"))
        return
    except ValueError:
        pass
    address, sep, port = host.rpartition(":")
    if sep and port.isdigit():
        raise LayoutError(f, at, f"'{host}' has a port in it (give the address alone, host = '{address.strip('[]')}'; "
                          "the rendezvous port is cluster.port)")
    if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9.\-_]*[A-Za-z0-9])?", host):
        raise LayoutError(f, at, f"'{host}' is not a host name or an IP address (e.g. 'node1.cluster' or '10.0.0.1')")


_IFNAME = re.compile(r"[A-Za-z0-9_.:-]{1,15}")  # Linux interface names: at most 15 bytes, no '/' or spaces


def _validate_domains(f: str, c: ClusterSpec) -> None:
    domain_names = [d.name for d in c.domains]
    for i, d in enumerate(c.domains):
        at = f"cluster.domains[{i}]"
        if not re.fullmatch(r"[A-Za-z0-9_\-]+", d.name):
            raise LayoutError(f, f"{at}.name", f"'{d.name}' must be letters, digits, '-' or '_'")
        if d.name in (DEFAULT_TRANSPORT, CROSS_DOMAIN, SHM):
            raise LayoutError(f, f"{at}.name", f"'{d.name}' is reserved (it names a group's transport; pick another name)")
        if d.name in domain_names[:i]:
            raise LayoutError(f, f"{at}.name", f"domain '{d.name}' is declared twice (give each domain its own name)")
        if d.bandwidth_gbps <= 0:
            raise LayoutError(f, f"{at}.bandwidth_gbps", f"must be > 0, got {d.bandwidth_gbps:g}")
        if d.latency_us < 0:
            raise LayoutError(f, f"{at}.latency_us", f"must be >= 0, got {d.latency_us:g}")
        _check_transport(f, at, d.gloo_ifname, d.nccl)
        if d.kind is DomainKind.ETHERNET:
            env = d.nccl_env
            ib = [k for k in env if k.startswith("NCCL_IB_")]
            if ib or env.get("NCCL_NET", "").lower() == "ib":
                what = ib[0] if ib else "NCCL_NET = 'IB'"
                raise LayoutError(f, f"{at}.nccl.{ib[0] if ib else 'NCCL_NET'}",
                                  f"{what} needs RDMA verbs, but kind is 'ethernet' (remove it, or set kind = 'roce' or 'ib')")
    x = c.cross_domain
    for name in ("bandwidth_gbps", "latency_us"):
        if getattr(x, name) < 0:
            raise LayoutError(f, f"cluster.cross_domain.{name}", f"must be >= 0 (0 = not given), got {getattr(x, name):g}")
    _check_transport(f, "cluster.cross_domain", x.gloo_ifname, x.nccl)
    for i, node in enumerate(c.nodes):
        at = f"cluster.nodes[{i}]"
        if node.speed <= 0:
            raise LayoutError(f, f"{at}.speed", f"must be > 0 (1.0 = reference speed), got {node.speed:g}")
        if node.memory_gb < 0:
            raise LayoutError(f, f"{at}.memory_gb", f"must be >= 0 (0 = no cap), got {node.memory_gb:g}")
        if not c.domains and node.domain:
            raise LayoutError(f, f"{at}.domain", f"'{node.domain}' is not declared: the cluster has no [[cluster.domains]] "
                              f"(add one named '{node.domain}', or remove domain)")
        if c.domains and not node.domain:
            raise LayoutError(f, f"{at}.domain", f"missing: the cluster declares domains, so every node names its own "
                              f"(domains: {', '.join(domain_names)})")
        if c.domains and node.domain not in domain_names:
            close = difflib.get_close_matches(node.domain, domain_names, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise LayoutError(f, f"{at}.domain", f"'{node.domain}' is not a domain ({hint}domains: {', '.join(domain_names)})")
    if c.comm is CommLib.CUPY:
        for i, node in enumerate(c.nodes):
            if "cpu" in node.devices:
                raise LayoutError(f, "cluster.comm", f"'cupy' needs CUDA devices, but node '{node.name}' lists 'cpu' "
                                  "(list 'cuda:N' devices, or use comm = 'torch')")


def _check_transport(f: str, at: str, ifname: str, nccl: tuple[tuple[str, str], ...]) -> None:
    if ifname and not _IFNAME.fullmatch(ifname):
        raise LayoutError(f, f"{at}.gloo_ifname", f"'{ifname}' is not a network interface name (at most 15 letters, "
                          "digits, '_', '.', ':' or '-', e.g. 'eth0')")
    net = dict(nccl).get("NCCL_NET")
    if net is not None and net.lower() not in ("ib", "socket") and "NCCL_NET_PLUGIN" not in dict(nccl):
        raise LayoutError(f, f"{at}.nccl.NCCL_NET", f"'{net}' is not one of NCCL's built-in nets 'IB' or 'Socket' "
                          "(or set NCCL_NET_PLUGIN to the plugin that provides it)")


def _validate_pipeline_schedule(layout: Layout, pi: int) -> None:
    f, t, pipe = layout.file, layout.train, layout.pipelines[pi]
    pp, n = f"pipelines[{pi}]", len(pipe.stages)
    if pipe.schedule_file and Path(pipe.schedule_file).is_dir():
        raise LayoutError(f, f"{pp}.schedule_file", f"'{pipe.schedule_file}' is a folder, not a file "
                          "(give a text or CSV file of action strings, one line or column per stage)")
    if pipe.schedule_file and not Path(pipe.schedule_file).is_file():
        raise LayoutError(f, f"{pp}.schedule_file", f"file '{pipe.schedule_file}' does not exist "
                          "(give a text or CSV file of action strings, one line or column per stage)")
    # train.chunks shapes every pipeline, schedule file or not: the plan cuts each stage into
    # train.chunks model chunks and wraps the last stage round to the first, so these hold for all.
    # (A file's own chunk count is compared with train.chunks where the file is read: plan.pipeline_schedule.)
    if t.schedule is Schedule.INTERLEAVED:
        if t.chunks < 2:
            raise LayoutError(f, "train.chunks", f"'interleaved' needs chunks >= 2, got {t.chunks} (or use schedule = '1f1b')")
        if n < 2:
            raise LayoutError(f, f"{pp}.stages", "'interleaved' needs at least 2 stages (or use schedule = '1f1b' here)")
        if not pipe.schedule_file and pipe.microbatches % n:  # the generator's rule; a file brings its own order
            raise LayoutError(f, f"{pp}.microbatches", f"'interleaved' needs microbatches divisible by the {n} stages, "
                              f"got {pipe.microbatches} (use a multiple of {n})")
        for si, stage in enumerate(pipe.stages):
            if stage.layers % t.chunks:
                raise LayoutError(f, f"{pp}.stages[{si}].layers", f"{stage.layers} layers do not split into "
                                  f"{t.chunks} chunks (use a multiple of train.chunks = {t.chunks})")
    elif t.chunks != 1:
        raise LayoutError(f, "train.chunks", f"chunks = {t.chunks} needs schedule = 'interleaved' "
                          f"(got '{t.schedule.value}'; set chunks = 1)")
    if t.schedule is Schedule.ZBH1 and t.compile is Compile.BLOCKS:
        raise LayoutError(f, "train.compile", SPLIT_BACKWARD_NO_COMPILE)


# A split backward defers weight gradients from inside autograd's backward; a compiled block would
# trace that backward once, with or without the deferral, whatever the action asks for.
SPLIT_BACKWARD_NO_COMPILE = ("'blocks' cannot compile a schedule that splits backwards into I and W "
                             "(set compile = 'none', or a schedule without I/W actions)")


def _check_device_id(layout: Layout, dev: str, where: str) -> None:
    c = layout.cluster
    node_name, sep, index = dev.partition(":")
    if not sep or not re.fullmatch(r"0|[1-9][0-9]*", index):
        raise LayoutError(layout.file, where, f"'{dev}' is not a device id (write 'node:index', e.g. '{c.nodes[0].name}:0')")
    known = {n.name: len(n.devices) for n in c.nodes}
    if node_name not in known or int(index) >= known[node_name]:
        have = ", ".join(f"{n} ({k} device{'s' if k > 1 else ''})" for n, k in known.items())
        raise LayoutError(layout.file, where, f"device '{dev}' is not in [cluster] (nodes: {have})")


def _validate_data(layout: Layout) -> None:
    d, m, f = layout.data, layout.model, layout.file
    _validate_packing(layout)
    if d.kind is DataKind.GRAMMAR:
        _positive(layout, d, "data", ["grammar_vocab"], minimum=2)
        _positive(layout, d, "data", ["branching"])
        if d.branching > d.grammar_vocab:
            raise LayoutError(f, "data.branching", f"{d.branching} exceeds grammar_vocab {d.grammar_vocab} (use at most {d.grammar_vocab})")
        if m.vocab < d.grammar_vocab:
            raise LayoutError(f, "model.vocab", f"{m.vocab} is smaller than data.grammar_vocab {d.grammar_vocab} "
                              f"(set model.vocab >= {d.grammar_vocab})")
        return
    if not d.path:
        raise LayoutError(f, "data.path", f"data.kind '{d.kind.value}' needs a file (set data.path to a "
                          f".{ {DataKind.JSONL: 'jsonl', DataKind.TOKENS: 'bin'}.get(d.kind, 'txt')} file, relative to "
                          "the layout file)")
    if Path(d.path).is_dir():
        raise LayoutError(f, "data.path", f"'{d.path}' is a folder, not a file (give an existing text or JSONL file)")
    if d.kind is DataKind.TOKENS:
        if not Path(d.path).is_file():
            raise LayoutError(f, "data.path", f"file '{d.path}' does not exist (give a .bin or .npy token file, e.g. "
                              "one hetero-tokenize wrote)")
        if not d.path.endswith((".bin", ".npy")):
            raise LayoutError(f, "data.path", f"file '{d.path}' is neither .bin nor .npy (data.kind 'tokens' reads "
                              "token files; use kind 'text' or 'jsonl' for text)")
    elif not Path(d.path).is_file():
        raise LayoutError(f, "data.path", f"file '{d.path}' does not exist (give an existing text or JSONL file)")
    size = Path(d.path).stat().st_size
    if size == 0:
        raise LayoutError(f, "data.path", f"file '{d.path}' is empty (give a file with at least one window of "
                          f"{m.seq_len + 1} tokens: seq_len + 1)")
    if d.kind is DataKind.TEXT and d.tokenizer == "bytes" and size < m.seq_len + 1:  # as many byte tokens as bytes
        raise LayoutError(f, "data.path", f"file '{d.path}' has {size} tokens, fewer than one window of "
                          f"{m.seq_len + 1} tokens (seq_len + 1); give a longer file or a smaller seq_len")
    if d.tokenizer == "bytes":
        if d.kind is DataKind.TOKENS:
            return  # the ids in the file bound model.vocab (checked when the file is opened)
        if m.vocab < 256:
            raise LayoutError(f, "model.vocab", f"{m.vocab} is smaller than the byte tokenizer's 256 tokens (set model.vocab >= 256)")
        return
    from hetero_llm import tokens  # torch-free; the tokenizers library loads only for a tokenizer.json

    try:
        vocab = tokens.load(d.tokenizer).vocab_size
    except ValueError as e:
        raise LayoutError(f, "data.tokenizer", str(e)) from None
    if m.vocab < vocab:
        raise LayoutError(f, "model.vocab", f"{m.vocab} is smaller than the tokenizer's {vocab} tokens "
                          f"(set model.vocab >= {vocab})")


def _validate_packing(layout: Layout) -> None:
    d, f = layout.data, layout.file
    if d.packing is not Packing.DOCUMENTS:
        return
    if d.doc_len_median < 2:
        raise LayoutError(f, "data.doc_len_median", f"must be >= 2 tokens (a document needs a token to predict "
                          f"from and one to predict), got {d.doc_len_median}")
    if d.doc_len_sigma < 0:
        raise LayoutError(f, "data.doc_len_sigma", f"must be >= 0 (0: every document has the median length), "
                          f"got {d.doc_len_sigma}")
    if layout.train.compile is Compile.BLOCKS:
        raise LayoutError(f, "train.compile", "'blocks' cannot compile packed documents (their attention groups "
                          "change shape every microbatch; set compile = 'none', or data.packing = 'none')")


def _validate_eval(layout: Layout) -> None:
    """Held-out evaluation: ``train.eval_every`` / ``eval_batches``, ``data.valid_path`` / ``valid_fraction``."""
    f, t, d = layout.file, layout.train, layout.data
    _positive(layout, t, "train", ["eval_every"], minimum=0)
    _positive(layout, t, "train", ["eval_batches"])
    if not 0 <= d.valid_fraction < 1:
        raise LayoutError(f, "data.valid_fraction", f"must be in [0, 1), got {d.valid_fraction:g} (e.g. 0.05)")
    if d.valid_path and d.valid_fraction:
        raise LayoutError(f, "data.valid_fraction", "is set as well as data.valid_path (hold out one way: remove one)")
    if d.kind is DataKind.GRAMMAR and (d.valid_path or d.valid_fraction):
        which = "valid_path" if d.valid_path else "valid_fraction"
        raise LayoutError(f, f"data.{which}", "is set but data.kind is 'grammar', whose held-out batches are fresh "
                          f"samples of the grammar (remove data.{which})")
    if d.valid_path and not Path(d.valid_path).is_file():
        raise LayoutError(f, "data.valid_path", f"file '{d.valid_path}' does not exist (give a held-out file of the "
                          f"same kind as data.path)")
    if t.eval_every and d.packing is Packing.DOCUMENTS:
        raise LayoutError(f, "train.eval_every", "is not supported with data.packing = 'documents' yet (set "
                          "eval_every = 0, or packing = 'none')")
    if t.eval_every and layout.buckets:
        raise LayoutError(f, "train.eval_every", "is not supported with [[buckets]] (hot switching) yet (set "
                          "eval_every = 0)")
    if t.eval_every and d.kind is not DataKind.GRAMMAR and not (d.valid_path or d.valid_fraction):
        raise LayoutError(f, "train.eval_every", "needs held-out data (set data.valid_path, or data.valid_fraction "
                          "= 0.05 to hold out the end of data.path)")


def schema_markdown() -> str:
    """Every layout key with its default and meaning, for docs/layout.md."""
    rows = []
    for section, cls in [("model", ModelSpec), ("train", TrainSpec), ("data", DataSpec), ("cluster", ClusterSpec),
                         ("cluster.nodes[]", NodeSpec), ("cluster.domains[]", DomainSpec),
                         ("cluster.cross_domain", CrossDomainSpec),
                         ("pipelines[]", PipelineSpec), ("pipelines[].stages[]", StageSpec),
                         ("buckets[]", BucketSpec)]:
        for fl in attrs.fields(cls):
            default = "required" if fl.default is attrs.NOTHING else repr(getattr(fl.default, "value", fl.default))
            if (cls, fl.name) in _TABLES:
                default = "{}" if fl.name == "nccl" else "(table)"
            rows.append(f"| `{section}.{fl.name}` | {default} | {fl.metadata['doc']} |")
    return "| key | default | meaning |\n| --- | --- | --- |\n" + "\n".join(rows) + "\n"
