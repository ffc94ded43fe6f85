"""The layout schema: the TOML keys a user writes, as frozen attrs classes and enums.

Each key is declared once, here: its type, default, meaning (``doc``) and its single-field rules
(``check``; see ``fields``). Turning TOML into these classes is ``reader``'s job, rules
between keys are ``rules``'; ``hetero_llm.layout`` puts them together. Imports no torch.
The ``[cluster]`` tables are declared the same way in ``cluster_schema``.

Every key's documentation is here, beside it: the classes themselves are plain declarations.
"""

from __future__ import annotations

import enum
import math

import attrs

from hetero_llm.layout.cluster_schema import ClusterSpec
from hetero_llm.layout.fields import Check, at_least, at_most, key

MAX_STEPS = 10**9  # train.steps and warmup_steps: more cannot finish
STEPS_WHY = "a run of more steps cannot finish: 10^9 steps take 11.6 days even at 1 ms a step"


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


# Single-field rules used by more than one key, or too long to read inline.
BETA = Check(lambda v: 0 <= v < 1, "must be in [0, 1), got {v} (AdamW's usual values: 0.9, 0.95)")


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

    layers: int = key("number of transformer blocks", check=at_least(1))
    hidden: int = key("model width (channels)", check=at_least(1))
    heads: int = key("attention heads; TP sizes must divide it", check=at_least(1))
    vocab: int = key("vocabulary size; >= the data's vocabulary (grammar: grammar_vocab; text: 256)", check=at_least(1))
    seq_len: int = key("tokens per training sequence", check=at_least(1))
    ffn: int = key("MLP inner width; 0 means 4 * hidden", default=0, check=at_least(0))
    norm: Norm = key("'layernorm' (GPT) or 'rmsnorm' (Llama)", default=Norm.LAYERNORM)
    position: Position = key("'learned' absolute embeddings (GPT) or 'rope' (Llama)", default=Position.LEARNED)
    mlp: Mlp = key("'gelu' (GPT) or 'swiglu' (Llama)", default=Mlp.GELU)
    init_std: float = key("std of the normal init of weight matrices", default=0.02, check=at_least(0))
    norm_eps: float = key(
        "epsilon of every layernorm/rmsnorm (GPT-2: 1e-5; Llama: 1e-5 or 1e-6)",
        default=1e-5,
        check=Check(lambda v: v > 0, "must be > 0, got {v:g} (GPT-2 and Llama use 1e-5)"),
    )
    rope_theta: float = key(
        "RoPE base: position p rotates pair j by p / rope_theta^(2j / head size) (Llama 2: 10000; Llama 3: 500000)",
        default=10000.0,
        check=Check(lambda v: v > 0, "must be > 0, got {v:g} (Llama 2 uses 10000)"),
    )
    kv_heads: int = key(
        "key/value heads (grouped-query attention: each serves heads / kv_heads query heads); "
        "0 means heads (plain multi-head attention); TP sizes must divide it",
        default=0,
        check=Check(lambda v: v >= 0, "must be >= 0 (0 = heads), got {v}"),
    )
    tie_embeddings: bool = key(
        "the output head reuses the token embedding (GPT-2); with pipelines the first "
        "and last stage each hold it and sum its gradient",
        default=False,
    )
    bias: bool = key("biases on the attention and MLP projections (GPT-2); norms keep theirs either way", default=False)
    init_from: str = key(
        "a local Hugging Face model directory (config.json + model.safetensors, Llama or "
        "GPT-2) to start from instead of the seeded init; relative to the layout file; "
        "its config must match this [model]",
        default="",
    )

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

    steps: int = key("optimizer steps (at most 10^9)", check=(at_least(1), at_most(MAX_STEPS, STEPS_WHY)))
    global_batch: int = key("sequences per step, summed over pipelines", check=at_least(1))
    seed: int = key("seed of initialization and data order", default=0, check=at_least(0))
    schedule: Schedule = key(
        "'gpipe', '1f1b', 'interleaved' (with chunks), 'dynamic' (run what is ready), or "
        "'zbh1' (zero-bubble: each backward split into input and weight gradients, the "
        "weight gradients filling 1F1B's bubbles; keeps up to stages microbatches in "
        "flight on every stage)",
        default=Schedule.ONE_F_ONE_B,
    )
    chunks: int = key(
        "model chunks (virtual stages) per rank for 'interleaved'; 1 otherwise", default=1, check=at_least(1)
    )
    lr: float = key("peak learning rate (after warmup)", default=1e-3, check=at_least(0))
    min_lr: float = key("learning rate at the end of the cosine decay", default=1e-4, check=at_least(0))
    warmup_steps: int = key(
        "linear warmup steps from 0 to lr", default=0, check=(at_least(0), at_most(MAX_STEPS, STEPS_WHY))
    )
    weight_decay: float = key("AdamW decoupled weight decay (matrices only)", default=0.0, check=at_least(0))
    beta1: float = key("AdamW beta1", default=0.9, check=BETA)
    beta2: float = key("AdamW beta2", default=0.95, check=BETA)
    eps: float = key("AdamW epsilon", default=1e-8, check=at_least(0))
    grad_clip: float = key(
        "clip the global gradient norm to this; 0 disables",
        default=1.0,
        check=Check(lambda v: v >= 0, "must be >= 0 (0 disables clipping), got {v}"),
    )
    optimizer: Optimizer = key(
        "'adamw' (every rank keeps AdamW moments for all it holds) or 'adamw_zero1' (ZeRO-1: the holders of each "
        "gradient-sync block reduce-scatter its gradient, each updates the moments of its own slice, sized by "
        "TP size x node memory_gb, and all-gather the parameters back; docs/zero1.md)",
        default=Optimizer.ADAMW,
    )
    log_every: int = key("print progress every N steps", default=1, check=at_least(1))
    eval_every: int = key(
        "compute the held-out loss every N steps and after the last; 0 = never (with packing: "
        "over held-out documents packed as training's; with [[buckets]]: under the home layout)",
        default=0,
        check=at_least(0),
    )
    eval_batches: int = key(
        "held-out batches of global_batch sequences per evaluation: the same ones every time, whatever the layout",
        default=4,
        check=at_least(1),
    )
    precision: Precision = key(
        "'fp32' or 'bf16': bf16 computes every stage in bfloat16 from float32 master weights (AdamW state "
        "and accumulated gradients stay float32; activations and their gradients cross stage boundaries "
        "in bf16, halving p2p traffic; the loss is float32). Layouts then agree to the bf16 tolerance "
        "(per-step loss within 1e-2 relative), not float32's 1e-5",
        default=Precision.FP32,
    )
    recompute: Recompute = key(
        "'none' or 'full': recompute each transformer block's activations in backward "
        "(keeps only block inputs: less memory, about one more forward of compute); "
        "the default for stages that do not set their own",
        default=Recompute.NONE,
    )
    compile: Compile = key(
        "'none' or 'blocks': torch.compile each transformer block's apply (the first steps "
        "are slower while it compiles; on CPU it needs a C++ compiler)",
        default=Compile.NONE,
    )


@attrs.frozen
class DataSpec:
    """``[data]``: where the tokens come from."""

    kind: DataKind = key(
        "'grammar' (embedded, known loss floor), 'text', 'jsonl' or 'tokens' (a pre-tokenized "
        ".bin or .npy file, memory-mapped)",
        default=DataKind.GRAMMAR,
    )
    path: str = key("text/jsonl/token file, relative to the layout file; '' for grammar", default="")
    field: str = key("JSONL key holding the text", default="text")
    tokenizer: str = key(
        "'bytes' (token = byte, vocab 256) or a local Hugging Face tokenizer.json, relative to the "
        "layout file; every document ends with its end-of-document token",
        default="bytes",
    )
    valid_path: str = key(
        "held-out file of the same kind (and tokenizer) for train.eval_every, relative to the layout file; '' = none",
        default="",
    )
    valid_fraction: float = key(
        "hold out this last fraction of data.path's tokens (with packing = "
        "'documents': of its documents) instead of a valid_path (training never samples "
        "them); 0 = none",
        default=0.0,
        check=Check(lambda v: 0 <= v < 1, "must be in [0, 1), got {v:g} (e.g. 0.05)"),
    )
    token_dtype: TokenDtype = key(
        "'uint16' (nanoGPT) or 'uint32': the ids of a .bin token file (a .npy file says its own)",
        default=TokenDtype.UINT16,
    )
    grammar_seed: int = key("seed of the grammar itself (not of the data order)", default=1234, check=at_least(0))
    grammar_vocab: int = key("tokens the grammar uses", default=64, check=at_least(2))
    branching: int = key("possible successors of each grammar context", default=4, check=at_least(1))
    packing: Packing = key(
        "'none': each row is a window of seq_len + 1 tokens cut anywhere in the data; "
        "'documents': whole documents (at most seq_len + 1 tokens; longer ones are cut) "
        "packed into the global_batch rows of seq_len, attention kept inside each document "
        "and positions restarting in each, the loss averaged over real targets "
        "(see docs/hot_switching.md)",
        default=Packing.NONE,
    )
    separator: str = key(
        "with packing = 'documents' and kind = 'text': the string between documents; '' "
        "makes the whole file one document (cut to seq_len + 1 tokens)",
        default="\n\n",
    )
    doc_len_median: float = key(
        "with packing = 'documents' and kind = 'grammar': median document length in "
        "tokens (lengths are lognormal, clipped to [2, seq_len + 1])",
        default=32.0,
        check=Check(
            lambda v: v >= 2,
            "must be >= 2 tokens (a document needs a token to predict from and one to predict), got {v}",
        ),
    )
    doc_len_sigma: float = key(
        "with packing = 'documents' and kind = 'grammar': standard deviation of the log "
        "of document lengths (larger: a longer tail)",
        default=1.0,
        check=Check(lambda v: v >= 0, "must be >= 0 (0: every document has the median length), got {v}"),
    )


@attrs.frozen
class StageSpec:
    """``[[pipelines.stages]]``: contiguous layers on one TP group."""

    layers: int = key("number of transformer blocks in this stage", check=at_least(1))
    devices: tuple[str, ...] = key(
        "device ids 'node:index'; their count is the stage's TP size times its cp (CP-major: the first TP "
        "size devices are context-parallel rank 0's TP group, the next ones rank 1's, ...)",
        check=Check(bool, 'a stage needs at least one device (list device ids, e.g. ["node0:0"])'),
    )
    recompute: Recompute | None = key(
        "'none' or 'full' for this stage (e.g. 'full' on a GPU short of memory); unset: train.recompute", default=None
    )
    cp: int = key(
        "context-parallel size: each sequence is cut into 2 x cp equal chunks and CP rank r of the stage holds "
        "chunks r and 2 x cp - 1 - r (zigzag: causal work balanced), attention exchanging keys and values in a "
        "ring; model.seq_len must be divisible by 2 x cp; 1: no context parallelism",
        default=1,
        check=at_least(1),
    )
    cp_overlap: bool = key(
        "with cp > 1: post each ring step's key/value transfer before computing the attention blocks it travels "
        "beside, so the transfer hides behind them (true, as Megatron-LM and torchtitan do); false: wait for "
        "each transfer before going on (every transfer exposed: a baseline for measuring what overlap saves); "
        "the same model either way",
        default=True,
    )

    @property
    def tp(self) -> int:
        return len(self.devices) // self.cp


@attrs.frozen
class PipelineSpec:
    """``[[pipelines]]``: one data-parallel replica of the whole model."""

    batch: int = key("sequences of each global batch this pipeline trains on", check=at_least(1))
    microbatches: int = key("microbatches the batch is split into; must divide batch", check=at_least(1))
    stages: tuple[StageSpec, ...] = key("ordered stages; their layers sum to model.layers")
    schedule_file: str = key(
        "a file of action strings (one line, or CSV column, per stage) to run instead of "
        "train.schedule; relative to the layout file; '' for none",
        default="",
    )


@attrs.frozen
class BucketSpec:
    """``[[buckets]]``: the documents up to a length, trained under their own layout (hot switching)."""

    max_len: int = key(
        "longest document of the bucket in positions (a document of n tokens fills n - 1), above the "
        "previous bucket's; also the width of the bucket's rows (a multiple of 2 x cp for every context-parallel "
        "stage the bucket runs). Buckets go from shortest to longest and the last one's max_len is model.seq_len",
        check=at_least(1),
    )
    schedule: Schedule | None = key("this bucket's pipeline schedule; unset: train.schedule", default=None)
    chunks: int = key(
        "model chunks per rank when this bucket's schedule is 'interleaved'; 0: train.chunks",
        default=0,
        check=at_least(0),
    )
    pipelines: tuple[PipelineSpec, ...] = key(
        "the bucket's layout, over devices of the home layout ([[pipelines]]), stages with their own tp and cp; a "
        "pipeline's batch is its share of the bucket's rows (a step's rows are the ones its documents need, padded "
        "with empty rows to a multiple of the smallest shares in these proportions whose microbatches split evenly, "
        "and split in proportion); none: the bucket runs under the home layout (its rows sized the same way)",
        default=(),
    )
    elastic: bool = key(
        "true: each step runs as many microbatches as its documents need, each of the rows batch / microbatches "
        "fixes (HotSPa's way: a microbatch's memory stays fixed, no empty microbatches); false: the microbatch "
        "count is fixed and a step's rows are spread over them",
        default=False,
    )
    top_up: bool = key(
        "true: the free positions of this bucket's rows (padding, computed anyway) take shorter buckets' documents, "
        "longest first, without adding rows; they then leave their own bucket (longer buckets top up first)",
        default=False,
    )


@attrs.frozen
class Layout:
    """A whole layout file, typed; paths in it are resolved against the file's folder."""

    file: str  # the file it was loaded from: every error names it
    model: ModelSpec
    train: TrainSpec
    data: DataSpec
    cluster: ClusterSpec
    pipelines: tuple[PipelineSpec, ...]  # the home layout: it holds the optimizer state and takes the step
    buckets: tuple[BucketSpec, ...] = ()  # hot switching: each bucket of document lengths under its own layout


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


def elastic_divisor(pipelines) -> int:
    """An elastic bucket's unit is its pipelines' batch and microbatches over this: the gcd of their microbatch
    counts, each over its stage count where a multiple of it (interleaving's need). Home's 8 in 8: 8, one row."""
    return math.gcd(
        *(p.microbatches // (len(p.stages) if p.microbatches % len(p.stages) == 0 else 1) for p in pipelines)
    )


def elastic_layout(layout: Layout, rounds: int) -> Layout:
    """An elastic bucket's layout (``bucket_layout``) for ``rounds`` of its unit: each pipeline's batch and
    microbatches over ``elastic_divisor``, times ``rounds`` (its microbatches keep their rows)."""
    g = elastic_divisor(layout.pipelines)
    if rounds == g == 1:
        return layout
    pipelines = tuple(
        attrs.evolve(p, batch=p.batch // g * rounds, microbatches=p.microbatches // g * rounds)
        for p in layout.pipelines
    )
    train = attrs.evolve(layout.train, global_batch=sum(p.batch for p in pipelines))
    return attrs.evolve(layout, pipelines=pipelines, train=train)
