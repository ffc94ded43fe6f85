"""Layout validation: every rule that needs more than one key, and when each key's own rules run.

A key's own rules (ranges, patterns, ...) are declared on its field in ``layout_schema`` and run here
by name (``_own``), interleaved with the rules between keys in one fixed order: the order of the calls
below is the order in which a file's problems are found, and only the first is reported. Keep it when
adding a rule (tests/bad_layouts has one file per message). Raises ``LayoutError`` naming the TOML
path; imports no torch.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any

from hetero_llm.errors import LayoutError
from hetero_llm.layout.fields import first_problem
from hetero_llm.layout.schema import (
    P2P,
    Backend,
    ClusterSpec,
    CommLib,
    Compile,
    DataKind,
    DomainKind,
    Layout,
    Packing,
    Position,
    Schedule,
    bucket_layout,
)

# A split backward defers weight gradients from inside autograd's backward; a compiled block would
# trace that backward once, with or without the deferral, whatever the action asks for.
SPLIT_BACKWARD_NO_COMPILE = (
    "'blocks' cannot compile a schedule that splits backwards into I and W "
    "(set compile = 'none', or a schedule without I/W actions)"
)


def _own(f: str, obj: Any, path: str, *names: str) -> None:
    """Run the single-field rules of ``obj``'s fields ``names``, in that order."""
    for name in names:
        found = first_problem(obj, name)
        if found is not None:
            raise LayoutError(f, f"{path}.{found[0]}", found[1])


def validate(layout: Layout) -> None:
    validate_sections(layout)
    _validate_pipelines(layout)
    _validate_buckets(layout)


def validate_sections(layout: Layout) -> None:
    """Every check of [model], [train], [data] and [cluster] (the layout's pipelines are not read): the
    planner runs them on a cluster file before its search."""
    f = layout.file
    m, t, d, c = layout.model, layout.train, layout.data, layout.cluster
    _own(f, m, "model", "layers", "hidden", "heads", "vocab", "seq_len", "ffn")
    _own(f, t, "train", "steps", "global_batch", "log_every", "chunks", "warmup_steps")
    if m.hidden % m.heads:
        raise LayoutError(
            f, "model.heads", f"{m.heads} heads do not divide hidden {m.hidden} (pick a divisor of {m.hidden})"
        )
    if m.position is Position.ROPE and m.head_dim % 2:
        raise LayoutError(
            f,
            "model.heads",
            f"rope needs an even head size (hidden / heads), got {m.head_dim} "
            f"(pick heads so that {m.hidden} / heads is even, or position = 'learned')",
        )
    _own(f, t, "train", "seed", "lr", "min_lr", "weight_decay", "eps", "beta1", "beta2", "grad_clip")
    _own(f, m, "model", "init_std")
    _validate_model_options(layout)
    if d.kind is DataKind.GRAMMAR:
        _own(f, d, "data", "grammar_seed")
        if d.tokenizer != "bytes":
            raise LayoutError(
                f,
                "data.tokenizer",
                "is set but data.kind is 'grammar', which has its own tokens "
                "(set data.kind = 'text' or 'jsonl', or remove data.tokenizer)",
            )
        if d.path:  # a forgotten data.kind would otherwise train on the grammar without a word
            raise LayoutError(
                f,
                "data.path",
                "is set but data.kind is 'grammar', which reads no file "
                "(set data.kind = 'text' or 'jsonl', or remove data.path)",
            )
    _validate_data(layout)
    _validate_eval(layout)

    validate_cluster(f, c)


def _validate_pipelines(layout: Layout) -> None:
    f, m, t, c = layout.file, layout.model, layout.train, layout.cluster
    used: dict[str, str] = {}
    gpus: dict[tuple[str, str], str] = {}  # (host, 'cuda:N') -> device id, for NCCL's one rank per GPU
    total_batch = 0
    for pi, pipe in enumerate(layout.pipelines):
        pp = f"pipelines[{pi}]"
        _own(f, pipe, pp, "batch", "microbatches")
        if pipe.batch % pipe.microbatches:
            raise LayoutError(
                f,
                f"{pp}.microbatches",
                f"{pipe.microbatches} microbatches do not divide the pipeline's batch "
                f"{pipe.batch} (use a divisor of {pipe.batch})",
            )
        total_batch += pipe.batch
        layer_sum = 0
        for si, stage in enumerate(pipe.stages):
            sp = f"{pp}.stages[{si}]"
            _own(f, stage, sp, "layers")
            layer_sum += stage.layers
            _own(f, stage, sp, "devices")
            tp = stage.tp
            if m.heads % tp:
                raise LayoutError(
                    f,
                    f"{sp}.devices",
                    f"TP size {tp} does not divide heads ({m.heads}) (use a TP size dividing {m.heads})",
                )
            if m.kv_heads_n % tp:
                raise LayoutError(
                    f,
                    f"{sp}.devices",
                    f"TP size {tp} does not divide model.kv_heads ({m.kv_heads_n}) "
                    f"(use a TP size dividing {m.kv_heads_n})",
                )
            if m.ffn_width % tp:
                raise LayoutError(
                    f,
                    f"{sp}.devices",
                    f"TP size {tp} does not divide the MLP width ({m.ffn_width}) "
                    f"(use a TP size dividing {m.ffn_width}, or a model.ffn divisible by {tp})",
                )
            for di, dev in enumerate(stage.devices):
                where = f"{sp}.devices[{di}]"
                _check_device_id(layout, dev, where)
                if dev in used:
                    raise LayoutError(
                        f, where, f"device '{dev}' is already used by {used[dev]} (each device runs one rank)"
                    )
                used[dev] = sp
                node_name, _, index = dev.partition(":")
                node = c.node(node_name)
                local = node.devices[int(index)]
                if c.backend is Backend.NCCL and local == "cpu":
                    raise LayoutError(
                        f,
                        where,
                        f"device '{dev}' is 'cpu' but cluster.backend is 'nccl' "
                        "(NCCL needs CUDA devices: list 'cuda:N' devices or use backend = 'gloo')",
                    )
                if c.backend is Backend.NCCL and gpus.setdefault((node.host, local), dev) != dev:
                    other = gpus[(node.host, local)]
                    raise LayoutError(
                        f,
                        where,
                        f"device '{dev}' is {local} on host {node.host}, like '{other}' "
                        "(NCCL runs one rank per GPU: give each rank its own GPU, or use backend = 'gloo')",
                    )
        _validate_pipeline_schedule(layout, pi)
        if layer_sum != m.layers:
            counts = " + ".join(str(s.layers) for s in pipe.stages)
            raise LayoutError(
                f,
                f"{pp}.stages",
                f"stage layers sum to {layer_sum} ({counts}) but model.layers is {m.layers} "
                f"(make them add up to {m.layers})",
            )
    if total_batch != t.global_batch:
        shares = " + ".join(str(p.batch) for p in layout.pipelines)
        raise LayoutError(
            f,
            "pipelines",
            f"pipeline batches sum to {total_batch} ({shares}) but train.global_batch is "
            f"{t.global_batch} (make them add up to {t.global_batch})",
        )


def _validate_model_options(layout: Layout) -> None:
    """``norm_eps``, ``rope_theta``, ``kv_heads``: options that reproduce Llama/GPT-2 models (``init_from``'s
    config.json is compared with [model] before a run starts: launch/preflight.py)."""
    f, m = layout.file, layout.model
    _own(f, m, "model", "norm_eps", "rope_theta", "kv_heads")
    if m.heads % m.kv_heads_n:
        raise LayoutError(
            f,
            "model.kv_heads",
            f"{m.kv_heads} does not divide heads ({m.heads}) "
            f"(use a divisor of {m.heads}, or 0 for one key/value head per query head)",
        )


def _validate_data(layout: Layout) -> None:
    d, m, f = layout.data, layout.model, layout.file
    _validate_packing(layout)
    if d.kind is DataKind.GRAMMAR:
        _own(f, d, "data", "grammar_vocab", "branching")
        if d.branching > d.grammar_vocab:
            raise LayoutError(
                f,
                "data.branching",
                f"{d.branching} exceeds grammar_vocab {d.grammar_vocab} (use at most {d.grammar_vocab})",
            )
        if m.vocab < d.grammar_vocab:
            raise LayoutError(
                f,
                "model.vocab",
                f"{m.vocab} is smaller than data.grammar_vocab {d.grammar_vocab} "
                f"(set model.vocab >= {d.grammar_vocab})",
            )
        return
    if not d.path:
        raise LayoutError(
            f,
            "data.path",
            f"data.kind '{d.kind.value}' needs a file (set data.path to a "
            f".{ {DataKind.JSONL: 'jsonl', DataKind.TOKENS: 'bin'}.get(d.kind, 'txt') } file, relative to "
            "the layout file)",
        )
    if Path(d.path).is_dir():
        raise LayoutError(f, "data.path", f"'{d.path}' is a folder, not a file (give an existing text or JSONL file)")
    if d.kind is DataKind.TOKENS:
        if not Path(d.path).is_file():
            raise LayoutError(
                f,
                "data.path",
                f"file '{d.path}' does not exist (give a .bin or .npy token file, e.g. one hetero-tokenize wrote)",
            )
        if not d.path.endswith((".bin", ".npy")):
            raise LayoutError(
                f,
                "data.path",
                f"file '{d.path}' is neither .bin nor .npy (data.kind 'tokens' reads "
                "token files; use kind 'text' or 'jsonl' for text)",
            )
    elif not Path(d.path).is_file():
        raise LayoutError(f, "data.path", f"file '{d.path}' does not exist (give an existing text or JSONL file)")
    size = Path(d.path).stat().st_size
    if size == 0:
        raise LayoutError(
            f,
            "data.path",
            f"file '{d.path}' is empty (give a file with at least one window of {m.seq_len + 1} tokens: seq_len + 1)",
        )
    if d.kind is DataKind.TEXT and d.tokenizer == "bytes" and size < m.seq_len + 1:  # as many byte tokens as bytes
        raise LayoutError(
            f,
            "data.path",
            f"file '{d.path}' has {size} tokens, fewer than one window of "
            f"{m.seq_len + 1} tokens (seq_len + 1); give a longer file or a smaller seq_len",
        )
    if d.tokenizer == "bytes":
        if d.kind is DataKind.TOKENS:
            return  # the ids in the file bound model.vocab (checked when the file is opened)
        if m.vocab < 256:
            raise LayoutError(
                f, "model.vocab", f"{m.vocab} is smaller than the byte tokenizer's 256 tokens (set model.vocab >= 256)"
            )
        return
    from hetero_llm.data import (
        tokenizers as tokens,
    )  # torch-free; the tokenizers library loads only for a tokenizer.json

    try:
        vocab = tokens.load(d.tokenizer).vocab_size
    except ValueError as e:
        raise LayoutError(f, "data.tokenizer", str(e)) from None
    if m.vocab < vocab:
        raise LayoutError(
            f, "model.vocab", f"{m.vocab} is smaller than the tokenizer's {vocab} tokens (set model.vocab >= {vocab})"
        )


def _validate_packing(layout: Layout) -> None:
    d, f = layout.data, layout.file
    if d.packing is not Packing.DOCUMENTS:
        return
    _own(f, d, "data", "doc_len_median", "doc_len_sigma")
    if d.kind is DataKind.TOKENS:  # documents are found by separators in text or JSONL lines (documents.py)
        raise LayoutError(
            f,
            "data.packing",
            "'documents' finds whole documents in data.kind 'grammar', 'text' or "
            "'jsonl', not in a 'tokens' file (pack the text or JSONL file it was tokenized from, or set "
            "data.packing = 'none')",
        )
    if layout.train.compile is Compile.BLOCKS:
        raise LayoutError(
            f,
            "train.compile",
            "'blocks' cannot compile packed documents (their attention groups "
            "change shape every microbatch; set compile = 'none', or data.packing = 'none')",
        )


def _validate_eval(layout: Layout) -> None:
    """Held-out evaluation: ``train.eval_every`` / ``eval_batches``, ``data.valid_path`` / ``valid_fraction``."""
    f, t, d = layout.file, layout.train, layout.data
    _own(f, t, "train", "eval_every", "eval_batches")
    _own(f, d, "data", "valid_fraction")
    if d.valid_path and d.valid_fraction:
        raise LayoutError(f, "data.valid_fraction", "is set as well as data.valid_path (hold out one way: remove one)")
    if d.kind is DataKind.GRAMMAR and (d.valid_path or d.valid_fraction):
        which = "valid_path" if d.valid_path else "valid_fraction"
        raise LayoutError(
            f,
            f"data.{which}",
            "is set but data.kind is 'grammar', whose held-out batches are fresh "
            f"samples of the grammar (remove data.{which})",
        )
    if d.valid_path and not Path(d.valid_path).is_file():
        raise LayoutError(
            f,
            "data.valid_path",
            f"file '{d.valid_path}' does not exist (give a held-out file of the same kind as data.path)",
        )
    if t.eval_every and d.kind is not DataKind.GRAMMAR and not (d.valid_path or d.valid_fraction):
        raise LayoutError(
            f,
            "train.eval_every",
            "needs held-out data (set data.valid_path, or data.valid_fraction = 0.05 to hold out the end of data.path)",
        )


def validate_cluster(f: str, c: ClusterSpec) -> None:
    """The ``[cluster]`` checks, on their own: placement validates a cluster file that has no pipelines yet."""
    names = [n.name for n in c.nodes]
    seen_nodes: set[str] = set()
    for i, node in enumerate(c.nodes):
        at = f"cluster.nodes[{i}]"
        _own(f, node, at, "name")
        if node.name in seen_nodes:
            raise LayoutError(f, f"{at}.name", f"node '{node.name}' is declared twice (give each node its own name)")
        seen_nodes.add(node.name)
        _own(f, node, at, "devices", "host")
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
    _own(f, c, "cluster", "port", "timeout_s")
    _validate_domains(f, c)


def _validate_domains(f: str, c: ClusterSpec) -> None:
    domain_names = [d.name for d in c.domains]
    for i, d in enumerate(c.domains):
        at = f"cluster.domains[{i}]"
        _own(f, d, at, "name")
        if d.name in domain_names[:i]:
            raise LayoutError(f, f"{at}.name", f"domain '{d.name}' is declared twice (give each domain its own name)")
        _own(f, d, at, "bandwidth_gbps", "latency_us", "gloo_ifname", "nccl")
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
    _own(f, c.cross_domain, "cluster.cross_domain", "bandwidth_gbps", "latency_us", "gloo_ifname", "nccl")
    for i, node in enumerate(c.nodes):
        at = f"cluster.nodes[{i}]"
        _own(f, node, at, "speed", "memory_gb")
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


def _validate_pipeline_schedule(layout: Layout, pi: int) -> None:
    f, t, pipe = layout.file, layout.train, layout.pipelines[pi]
    pp, n = f"pipelines[{pi}]", len(pipe.stages)
    if pipe.schedule_file and Path(pipe.schedule_file).is_dir():
        raise LayoutError(
            f,
            f"{pp}.schedule_file",
            f"'{pipe.schedule_file}' is a folder, not a file "
            "(give a text or CSV file of action strings, one line or column per stage)",
        )
    if pipe.schedule_file and not Path(pipe.schedule_file).is_file():
        raise LayoutError(
            f,
            f"{pp}.schedule_file",
            f"file '{pipe.schedule_file}' does not exist "
            "(give a text or CSV file of action strings, one line or column per stage)",
        )
    # train.chunks shapes every pipeline, schedule file or not: the plan cuts each stage into
    # train.chunks model chunks and wraps the last stage round to the first, so these hold for all.
    # (A file's own chunk count is compared with train.chunks where the file is read: plan.pipeline_schedule.)
    if t.schedule is Schedule.INTERLEAVED:
        if t.chunks < 2:
            raise LayoutError(
                f, "train.chunks", f"'interleaved' needs chunks >= 2, got {t.chunks} (or use schedule = '1f1b')"
            )
        if n < 2:
            raise LayoutError(
                f, f"{pp}.stages", "'interleaved' needs at least 2 stages (or use schedule = '1f1b' here)"
            )
        if not pipe.schedule_file and pipe.microbatches % n:  # the generator's rule; a file brings its own order
            raise LayoutError(
                f,
                f"{pp}.microbatches",
                f"'interleaved' needs microbatches divisible by the {n} stages, "
                f"got {pipe.microbatches} (use a multiple of {n})",
            )
        for si, stage in enumerate(pipe.stages):
            if stage.layers % t.chunks:
                raise LayoutError(
                    f,
                    f"{pp}.stages[{si}].layers",
                    f"{stage.layers} layers do not split into "
                    f"{t.chunks} chunks (use a multiple of train.chunks = {t.chunks})",
                )
    elif t.chunks != 1:
        raise LayoutError(
            f,
            "train.chunks",
            f"chunks = {t.chunks} needs schedule = 'interleaved' (got '{t.schedule.value}'; set chunks = 1)",
        )
    if t.schedule is Schedule.ZBH1 and t.compile is Compile.BLOCKS:
        raise LayoutError(f, "train.compile", SPLIT_BACKWARD_NO_COMPILE)


def _check_device_id(layout: Layout, dev: str, where: str) -> None:
    c = layout.cluster
    node_name, sep, index = dev.partition(":")
    if not sep or not re.fullmatch(r"0|[1-9][0-9]*", index):
        raise LayoutError(
            layout.file, where, f"'{dev}' is not a device id (write 'node:index', e.g. '{c.nodes[0].name}:0')"
        )
    known = {n.name: len(n.devices) for n in c.nodes}
    if node_name not in known or int(index) >= known[node_name]:
        have = ", ".join(f"{n} ({k} device{'s' if k > 1 else ''})" for n, k in known.items())
        raise LayoutError(layout.file, where, f"device '{dev}' is not in [cluster] (nodes: {have})")


def _validate_buckets(layout: Layout) -> None:
    """Bounds ascend and end at seq_len; each bucket's layout is valid on its own, on home devices."""
    f, m = layout.file, layout.model
    if not layout.buckets:
        return
    if layout.data.packing is not Packing.DOCUMENTS:
        raise LayoutError(f, "buckets", "need data.packing = 'documents' (buckets sort whole documents by length)")
    home = {dev for p in layout.pipelines for st in p.stages for dev in st.devices}
    cuda = sorted(
        d for d in home if layout.cluster.node(d.partition(":")[0]).devices[int(d.partition(":")[2])] != "cpu"
    )
    if cuda:  # the switch exchange is plain gloo send/recv of device tensors: CPU only until it is built for NCCL
        raise LayoutError(
            f,
            "buckets",
            f"hot switching runs on CPU devices only for now, and device '{cuda[0]}' is "
            "a GPU (remove [[buckets]] to train under [[pipelines]] on GPUs)",
        )
    previous = 0
    for bi, b in enumerate(layout.buckets):
        at = f"buckets[{bi}]"
        _own(f, b, at, "max_len", "chunks")
        if b.max_len <= previous:
            raise LayoutError(
                f,
                f"{at}.max_len",
                f"{b.max_len} is not above buckets[{bi - 1}].max_len ({previous}) "
                "(list buckets from shortest to longest, each bound above the one before)",
            )
        if b.max_len > m.seq_len:
            raise LayoutError(
                f,
                f"{at}.max_len",
                f"{b.max_len} exceeds model.seq_len ({m.seq_len}): no document is longer (use at most {m.seq_len})",
            )
        previous = b.max_len
        for pi, pipe in enumerate(b.pipelines):
            for si, stage in enumerate(pipe.stages):
                for di, dev in enumerate(stage.devices):
                    where = f"{at}.pipelines[{pi}].stages[{si}].devices[{di}]"
                    _check_device_id(layout, dev, where)
                    if dev not in home:
                        raise LayoutError(
                            f,
                            where,
                            f"device '{dev}' is not in the home layout ([[pipelines]]); "
                            "every bucket runs on the home layout's devices",
                        )
        if b.top_up and bi == 0:
            raise LayoutError(
                f,
                f"{at}.top_up",
                "the shortest bucket has no shorter documents to take (set top_up on a longer bucket)",
            )
        fixed = [i for i, p in enumerate(b.pipelines or layout.pipelines) if p.schedule_file]
        if b.elastic and fixed:
            where = f"{at}.pipelines[{fixed[0]}]" if b.pipelines else f"pipelines[{fixed[0]}]"
            raise LayoutError(
                f,
                f"{at}.elastic",
                f"an elastic bucket runs a different number of microbatches each step, "
                f"and {where}.schedule_file orders a fixed number (set elastic = false, or drop the "
                "schedule file)",
            )
        try:
            validate(bucket_layout(layout, bi))
        except LayoutError as e:
            path = e.path
            empty = [i for i, p in enumerate(b.pipelines) if p.batch < 1]
            if path == "train.global_batch" and empty:  # the bucket's batches sum to 0: name its own pipeline's key
                path = f"pipelines[{empty[0]}].batch"
            if path.startswith("pipelines"):
                path = f"{at}.{path}"
            elif path in ("train.schedule", "train.chunks"):
                path = f"{at}.{path.removeprefix('train.')}"
            raise LayoutError(f, path, e.message) from None
    if previous != m.seq_len:
        raise LayoutError(
            f,
            f"buckets[{len(layout.buckets) - 1}].max_len",
            f"{previous} is below model.seq_len "
            f"({m.seq_len}): documents of {previous + 1} to {m.seq_len} positions would fit no bucket "
            f"(make the last bucket's max_len {m.seq_len})",
        )
