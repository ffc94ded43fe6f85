"""What the GPU benchmark (``python -m bench.gpu.gpu_bench``, whose docstring explains it) trains: the model sizes,
a case (size, sequence length, batch) with its parameter count and model FLOPs per token, and our layout of it.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from hetero_llm import layout as layout_mod
from hetero_llm.model.params import count_params

VOCAB = 50304  # GPT-2's 50257 padded to a multiple of 64, as nanoGPT does


@attrs.frozen
class Size:
    name: str
    layers: int
    hidden: int
    heads: int
    vocab: int = VOCAB


SIZES = {s.name: s for s in (Size("124m", 12, 768, 12), Size("1.3b", 24, 2048, 16), Size("tiny", 2, 64, 4, 256))}


@attrs.frozen
class Case:
    size: Size
    seq: int
    batch: int

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def model_spec(self) -> layout_mod.ModelSpec:
        s = self.size
        return layout_mod.ModelSpec(layers=s.layers, hidden=s.hidden, heads=s.heads, vocab=s.vocab, seq_len=self.seq)

    @property
    def params(self) -> int:
        return count_params(self.model_spec())

    def flops_per_token(self) -> float:
        s = self.size
        matmul_weights = self.params - s.vocab * s.hidden - self.seq * s.hidden  # minus the embedding tables
        return 6 * matmul_weights + 12 * s.layers * s.hidden * self.seq


def layout_toml(
    case: Case,
    *,
    devices: list[str],
    steps: int,
    corpus: Path,
    compile_mode: str = "none",
    backend: str = "gloo",
    stages: int = 1,
    microbatches: int = 1,
) -> str:
    """One pipeline; ``stages`` stages of one rank each, or one stage over all ``devices`` (TP)."""
    s = case.size
    train = layout_mod.TrainSpec(
        steps=steps,
        global_batch=case.batch,
        seed=0,
        precision=layout_mod.Precision.BF16,
        compile=layout_mod.Compile(compile_mode),
        lr=3e-4,
        min_lr=3e-5,
        warmup_steps=2,
        weight_decay=0.1,
        grad_clip=1.0,
        log_every=1,
    )
    data = layout_mod.DataSpec(kind=layout_mod.DataKind.TEXT, path=str(corpus))
    # one node per rank: several ranks may share one GPU (gloo)
    nodes = tuple(layout_mod.NodeSpec(name=f"r{i}", devices=(dev,)) for i, dev in enumerate(devices))
    cluster = layout_mod.ClusterSpec(nodes=nodes, backend=layout_mod.Backend(backend), timeout_s=300.0)
    if stages > 1:
        specs = tuple(layout_mod.StageSpec(layers=s.layers // stages, devices=(f"r{i}:0",)) for i in range(stages))
    else:
        specs = (layout_mod.StageSpec(layers=s.layers, devices=tuple(f"r{i}:0" for i in range(len(devices)))),)
    pipeline = layout_mod.PipelineSpec(batch=case.batch, microbatches=microbatches, stages=specs)
    return layout_mod.dumps(
        layout_mod.Layout(
            file="<gpu_bench>", model=case.model_spec(), train=train, data=data, cluster=cluster, pipelines=(pipeline,)
        )
    )
