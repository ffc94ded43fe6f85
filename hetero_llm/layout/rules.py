"""Layout validation: every rule that needs more than one key, and when each key's own rules run.

A key's own rules (ranges, patterns, ...) are declared on its field in ``schema`` and run here
by name (``check_own``), interleaved with the rules between keys in one fixed order: the order of the calls
below is the order in which a file's problems are found, and only the first is reported. Keep it when
adding a rule (tests/bad_layouts has one file per message). The rules of ``[data]`` (``data_rules``) and
of ``[cluster]`` (``cluster_rules``) are called at their place in that order. Raises ``LayoutError``
naming the TOML path; imports no torch.
"""

from __future__ import annotations

import re
from pathlib import Path

from hetero_llm.errors import LayoutError
from hetero_llm.layout.cluster_rules import validate_cluster
from hetero_llm.layout.cluster_schema import Backend
from hetero_llm.layout.data_rules import validate_data, validate_eval
from hetero_llm.layout.fields import check_own
from hetero_llm.layout.schema import Compile, DataKind, Layout, Packing, Position, Schedule, bucket_layout

# A split backward defers weight gradients from inside autograd's backward; a compiled block would
# trace that backward once, with or without the deferral, whatever the action asks for.
SPLIT_BACKWARD_NO_COMPILE = (
    "'blocks' cannot compile a schedule that splits backwards into I and W "
    "(set compile = 'none', or a schedule without I/W actions)"
)


def validate(layout: Layout) -> None:
    validate_sections(layout)
    _validate_pipelines(layout)
    _validate_buckets(layout)


def validate_sections(layout: Layout) -> None:
    """Every check of [model], [train], [data] and [cluster] (the layout's pipelines are not read): the
    planner runs them on a cluster file before its search."""
    f = layout.file
    m, t, d, c = layout.model, layout.train, layout.data, layout.cluster
    check_own(f, m, "model", "layers", "hidden", "heads", "vocab", "seq_len", "ffn")
    check_own(f, t, "train", "steps", "global_batch", "log_every", "chunks", "warmup_steps")
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
    check_own(f, t, "train", "seed", "lr", "min_lr", "weight_decay", "eps", "beta1", "beta2", "grad_clip")
    check_own(f, m, "model", "init_std")
    _validate_model_options(layout)
    if d.kind is DataKind.GRAMMAR:
        check_own(f, d, "data", "grammar_seed")
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
    validate_data(layout)
    validate_eval(layout)

    validate_cluster(f, c)


def _validate_pipelines(layout: Layout) -> None:
    f, m, t, c = layout.file, layout.model, layout.train, layout.cluster
    used: dict[str, str] = {}
    known = {n.name: len(n.devices) for n in c.nodes}
    gpus: dict[tuple[str, str], str] = {}  # (host, 'cuda:N') -> device id, for NCCL's one rank per GPU
    total_batch = 0
    for pi, pipe in enumerate(layout.pipelines):
        pp = f"pipelines[{pi}]"
        check_own(f, pipe, pp, "batch", "microbatches")
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
            check_own(f, stage, sp, "layers")
            layer_sum += stage.layers
            check_own(f, stage, sp, "devices")
            _validate_context_parallel(layout, pi, si)
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
                _check_device_id(layout, dev, where, known)
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


def _validate_context_parallel(layout: Layout, pi: int, si: int) -> None:
    """A stage's ``cp``: its devices are TP x CP, the sequence cuts into 2 x cp zigzag chunks, and what the
    runtime cannot yet run with context parallelism is refused (an accepted layout trains the same model)."""
    f, m, t = layout.file, layout.model, layout.train
    stage = layout.pipelines[pi].stages[si]
    sp = f"pipelines[{pi}].stages[{si}]"
    check_own(f, stage, sp, "cp")
    cp, n = stage.cp, len(stage.devices)
    if n % cp:
        raise LayoutError(
            f,
            f"{sp}.cp",
            f"{n} device{'s' if n > 1 else ''} do not split into cp = {cp} TP groups "
            f"(list TP size x {cp} devices, or a cp dividing {n})",
        )
    if m.seq_len % (2 * cp):
        raise LayoutError(
            f,
            f"{sp}.cp",
            f"model.seq_len {m.seq_len} does not cut into 2 x cp = {2 * cp} equal chunks, as the zigzag "
            f"load balancing needs (use a cp with seq_len divisible by 2 x cp, or a seq_len multiple of {2 * cp})",
        )
    if cp == 1:
        return
    if t.compile is Compile.BLOCKS:
        raise LayoutError(
            f, "train.compile", f"'blocks' cannot compile {sp}'s ring attention (cp = {cp}) yet (set compile = 'none')"
        )


def _validate_model_options(layout: Layout) -> None:
    """``norm_eps``, ``rope_theta``, ``kv_heads``: options that reproduce Llama/GPT-2 models (``init_from``'s
    config.json is compared with [model] before a run starts: launch/preflight.py)."""
    f, m = layout.file, layout.model
    check_own(f, m, "model", "norm_eps", "rope_theta", "kv_heads")
    if m.heads % m.kv_heads_n:
        raise LayoutError(
            f,
            "model.kv_heads",
            f"{m.kv_heads} does not divide heads ({m.heads}) "
            f"(use a divisor of {m.heads}, or 0 for one key/value head per query head)",
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


def _check_device_id(layout: Layout, dev: str, where: str, known: dict[str, int]) -> None:
    """``dev`` names a device of [cluster] (``known``: each node's device count, made once per layout)."""
    c = layout.cluster
    node_name, sep, index = dev.partition(":")
    if not sep or not re.fullmatch(r"0|[1-9][0-9]*", index):
        raise LayoutError(
            layout.file, where, f"'{dev}' is not a device id (write 'node:index', e.g. '{c.nodes[0].name}:0')"
        )
    if node_name not in known or int(index) >= known[node_name]:
        have = ", ".join(f"{n} ({k} device{'s' if k > 1 else ''})" for n, k in known.items())
        raise LayoutError(layout.file, where, f"device '{dev}' is not in [cluster] (nodes: {have})")


def _validate_buckets(layout: Layout) -> None:
    """Bounds ascend and end at seq_len; each bucket's layout is valid on its own, on home devices."""
    m = layout.model
    if not layout.buckets:
        return
    home = {dev for p in layout.pipelines for st in p.stages for dev in st.devices}
    _check_switching_supported(layout, home)
    known = {n.name: len(n.devices) for n in layout.cluster.nodes}
    previous = 0
    for bi, b in enumerate(layout.buckets):
        _check_bucket(layout, bi, previous, home, known)
        previous = b.max_len
    if previous != m.seq_len:
        raise LayoutError(
            layout.file,
            f"buckets[{len(layout.buckets) - 1}].max_len",
            f"{previous} is below model.seq_len "
            f"({m.seq_len}): documents of {previous + 1} to {m.seq_len} positions would fit no bucket "
            f"(make the last bucket's max_len {m.seq_len})",
        )


def _check_switching_supported(layout: Layout, home: set[str]) -> None:
    """What hot switching does not run yet: unpacked data."""
    f = layout.file
    if layout.data.packing is not Packing.DOCUMENTS:
        raise LayoutError(f, "buckets", "need data.packing = 'documents' (buckets sort whole documents by length)")


def _check_bucket(layout: Layout, bi: int, previous: int, home: set[str], known: dict[str, int]) -> None:
    """``buckets[bi]``: its bound above the one before (``previous``), its devices home devices, its keys
    together, and its layout valid on its own."""
    f, m, b = layout.file, layout.model, layout.buckets[bi]
    at = f"buckets[{bi}]"
    check_own(f, b, at, "max_len", "chunks")
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
    for pi, pipe in enumerate(b.pipelines):
        for si, stage in enumerate(pipe.stages):
            for di, dev in enumerate(stage.devices):
                where = f"{at}.pipelines[{pi}].stages[{si}].devices[{di}]"
                _check_device_id(layout, dev, where, known)
                if dev not in home:
                    raise LayoutError(
                        f,
                        where,
                        f"device '{dev}' is not in the home layout ([[pipelines]]); "
                        "every bucket runs on the home layout's devices",
                    )
    if b.top_up and bi == 0:
        raise LayoutError(
            f, f"{at}.top_up", "the shortest bucket has no shorter documents to take (set top_up on a longer bucket)"
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
    _check_bucket_layout(layout, bi)
    _check_bucket_cp(layout, bi)


def _check_bucket_cp(layout: Layout, bi: int) -> None:
    """A bucket's rows are ``max_len`` wide: every context-parallel stage it runs (its own, or home's when it has
    none) cuts them into 2 x cp equal zigzag chunks."""
    b = layout.buckets[bi]
    at = f"buckets[{bi}]." if b.pipelines else ""
    for pi, pipe in enumerate(b.pipelines or layout.pipelines):
        for si, st in enumerate(pipe.stages):
            if st.cp > 1 and b.max_len % (2 * st.cp):
                raise LayoutError(
                    layout.file,
                    f"buckets[{bi}].max_len",
                    f"{b.max_len} does not cut into 2 x cp = {2 * st.cp} equal chunks, as {at}pipelines[{pi}]."
                    f"stages[{si}] (cp = {st.cp}) needs for the bucket's rows (use a multiple of {2 * st.cp})",
                )


def _check_bucket_layout(layout: Layout, bi: int) -> None:
    """The bucket's own layout valid, its errors named by the bucket's keys."""
    at, b = f"buckets[{bi}]", layout.buckets[bi]
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
        raise LayoutError(layout.file, path, e.message) from None
