"""Context parallelism trains the same model: stages of cp 2, 3 and 4, cp x TP, a cp pipeline beside a cp 1 one,
packed documents across chunk boundaries, the schedules, ZeRO-1, held-out loss and resumes across cp changes,
each against the one-process run of the same [model], [data] and seed (float32, tests/harness.py's tolerances).

Layouts here are written from pipelines [(batch, microbatches, [(layers, tp, cp), ...])], each pipeline on a node
of its own, a stage's TP x CP devices CP-major (``StageSpec.cp``).
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import numpy as np
import pytest
from helpers_precision import assert_bf16_close

from harness import LAYOUTS, assert_same_model, common_sections, launch, sections
from hetero_llm import layout
from hetero_llm.data import documents, sources
from hetero_llm.model import cp_chunks
from hetero_llm.plan import compile_plan
from hetero_llm.plan.describe import describe_context

pytestmark = pytest.mark.multiprocess

REFERENCE = LAYOUTS / "reference" / "reference.toml"  # 6 layers, seq_len 16, global batch 12, rope
COMMON = common_sections(REFERENCE)
DOCUMENTS = LAYOUTS / "reference" / "documents.toml"  # packed documents: 4 layers, seq_len 64, global batch 8
COMMON_DOCS = common_sections(DOCUMENTS)

Stages = list[tuple[int, int, int]]


def cp_layout(path: Path, common: str, pipelines: list[tuple[int, int, Stages]], **train: object) -> Path:
    """A layout of ``common``'s sections and ``pipelines``; ``train``: [train] keys to change."""
    model, tr, data = sections(common, path)
    tr = attrs.evolve(tr, **train)  # type: ignore[arg-type]
    nodes, pipes = [], []
    for pi, (batch, mbs, stages) in enumerate(pipelines):
        nodes.append(layout.NodeSpec(name=f"n{pi}", devices=("cpu",) * sum(tp * cp for _, tp, cp in stages)))
        specs, d = [], 0
        for layers, tp, cp in stages:
            devices = tuple(f"n{pi}:{d + i}" for i in range(tp * cp))
            specs.append(layout.StageSpec(layers=layers, devices=devices, cp=cp))
            d += tp * cp
        pipes.append(layout.PipelineSpec(batch=batch, microbatches=mbs, stages=tuple(specs)))
    cluster = layout.ClusterSpec(nodes=tuple(nodes))
    lay = layout.Layout(file=str(path), model=model, train=tr, data=data, cluster=cluster, pipelines=tuple(pipes))
    layout.dump(lay, path)
    layout.load(path)  # valid, as written
    return path


@pytest.fixture(scope="module")
def reference(shared_launch):
    return shared_launch(REFERENCE)


# (name, pipelines, [train] changes); every case trains reference.toml's model. One launch per case: the
# options a case adds (recompute, ZeRO-1) ride on a layout that test_resume_across_cp and test_held_out_loss
# also train without them (cp 2 and cp 4 alone in a stage, a cp 2 pipeline beside a cp 1 one), so every
# layout is trained with and without its option while the suite pays for fewer launches; cp 2 x tp 2 feeding
# cp 1 under the dynamic schedule is test_resume_across_cp's first run.
CASES = [
    ("cp 4, one stage, recompute full", [(12, 2, [(6, 1, 4)])], {"recompute": layout.Recompute.FULL}),
    (
        "a cp 2 pipeline beside a cp 1 pipeline, adamw_zero1",
        [(8, 2, [(6, 1, 2)]), (4, 2, [(3, 1, 1), (3, 1, 1)])],
        {"optimizer": layout.Optimizer.ADAMW_ZERO1},
    ),
    ("cp 4 feeding cp 2 feeding cp 1: re-chunked", [(12, 3, [(2, 1, 4), (2, 1, 2), (2, 1, 1)])], {}),
    ("cp 1 x tp 2 feeding cp 2, gpipe", [(12, 2, [(3, 2, 1), (3, 1, 2)])], {"schedule": layout.Schedule.GPIPE}),
    ("cp 2, 2 stages, zbh1", [(12, 3, [(3, 1, 2), (3, 1, 2)])], {"schedule": layout.Schedule.ZBH1}),
    (
        "cp 2 -> cp 1 wrapping to cp 2, interleaved",
        [(12, 2, [(4, 1, 2), (2, 1, 1)])],
        {"schedule": layout.Schedule.INTERLEAVED, "chunks": 2},
    ),
]


@pytest.mark.parametrize("name,pipelines,train", CASES, ids=[c[0] for c in CASES])
def test_context_parallel_trains_the_reference_model(name, pipelines, train, reference, tmp_path):
    path = cp_layout(tmp_path / "layout.toml", COMMON, pipelines, **train)
    assert_same_model(launch(path, tmp_path), reference)


def test_cp_3(shared_launch, tmp_path):
    """cp 3 cuts seq_len 12 into 6 chunks of 2; the reference is the one process at seq_len 12. (At seq_len 24,
    cp 2 and cp 3 alike leave one element of 1024 of layers.1.attn.wo 2e-5 off after 3 steps, 1.08e-4 of the
    tensor: AdamW's update of a gradient near eps follows the float32 rounding of attention's sums, masked
    attention's here, SDPA's in the reference; losses agree to 6e-8.)"""
    shorter = ("--set", "model.seq_len=12")
    path = cp_layout(tmp_path / "layout.toml", COMMON.replace("seq_len = 16", "seq_len = 12"), [(12, 3, [(6, 1, 3)])])
    assert_same_model(launch(path, tmp_path), shared_launch(REFERENCE, *shorter))


def test_packed_documents_across_chunk_boundaries(shared_launch, tmp_path):
    """Documents packed into rows cross the zigzag chunks' boundaries (checked on the first step's rows): each
    token keeps its document and its position inside it on whichever CP rank holds it."""
    model, tr, data = sections(COMMON_DOCS)
    source, _ = sources.document_sources(data, model.seq_len, str(DOCUMENTS))
    rows = documents.fill_rows(source, tr.seed, 0, tr.global_batch, model.seq_len)
    cuts = {hi for r in range(2) for _, hi in cp_chunks.chunk_ranges(model.seq_len, 2, r)} - {model.seq_len}
    crossing = [(row, start, n) for row, start, n in rows.spans.tolist() if any(start < c < start + n for c in cuts)]
    assert len(crossing) >= 2 and np.any(rows.targets == documents.IGNORE)  # documents across chunk cuts, and padding
    path = cp_layout(tmp_path / "layout.toml", COMMON_DOCS, [(8, 2, [(2, 1, 2), (2, 1, 2)])])
    assert_same_model(launch(path, tmp_path), shared_launch(DOCUMENTS))


def _valid_losses(workdir: Path) -> list[float]:
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [r["valid_loss"] for r in rows if r.get("valid_loss") is not None]


def test_held_out_loss(shared_launch, tmp_path):
    """The held-out loss of a cp 2 pipeline beside a cp 1 one is the one process's, and so is the model (the
    layout of CASES' ZeRO-1 case, with AdamW: a cp 2 stage beside a cp 1 pipeline of 2 stages)."""
    every = ("--set", "train.eval_every=2")
    ref = shared_launch(REFERENCE, *every)
    path = cp_layout(tmp_path / "layout.toml", COMMON, [(8, 2, [(6, 1, 2)]), (4, 2, [(3, 1, 1), (3, 1, 1)])])
    run = launch(path, tmp_path, *every)
    assert_same_model(run, ref)
    want, got = _valid_losses(ref.workdir), _valid_losses(tmp_path)
    assert len(want) == 2 and got == pytest.approx(want, rel=1e-5)


STEPS = ("--set", "train.steps=4")  # the learning rate schedule depends on train.steps: same in every run


@pytest.mark.parametrize(
    "a,train,b",
    [
        ([(12, 3, [(6, 1, 2)])], {}, [(12, 2, [(3, 1, 4), (3, 1, 1)])]),  # 5 ranks: cp 4 is a stage, not both
        ([(12, 3, [(3, 2, 2), (3, 1, 1)])], {"schedule": layout.Schedule.DYNAMIC}, None),
    ],
    ids=["cp 2 -> cp 4 feeding cp 1", "cp 2 x tp 2 feeding cp 1, dynamic -> one process"],
)
def test_resume_across_cp(a, train, b, shared_launch, tmp_path):
    """Saved under one cp, resumed under another (or none): the shards are those of cp 1, the model the same. The
    first run trains all 4 steps (saving at step 2) and is itself the one process's model: cp 2 alone in a stage,
    and cp 2 x tp 2 feeding cp 1 under the dynamic schedule."""
    ref = shared_launch(REFERENCE, *STEPS)
    path_a = cp_layout(tmp_path / "a.toml", COMMON, a, **train)
    path_b = cp_layout(tmp_path / "b.toml", COMMON, b) if b else REFERENCE
    first = launch(path_a, tmp_path / "a", *STEPS, "--checkpoint-every", "2")
    assert_same_model(first, ref)
    rest = launch(path_b, tmp_path / "b", *STEPS, "--resume", str(tmp_path / "a" / "ckpt" / "step-000002"))
    assert len(rest.losses) == 2
    both = attrs.evolve(rest, losses=first.losses[:2] + rest.losses, grad_norms=first.grad_norms[:2] + rest.grad_norms)
    assert_same_model(both, ref)


def test_bf16_cp_2(shared_launch, reference, tmp_path):
    """train.precision = "bf16" on a cp 2 stage (ring attention's block math and merge in float32 from bf16 inputs,
    tests/integration/test_context.py) trains within the bf16 tolerance (tests/integration/test_precision.py's docstring) of the
    one-process bf16 run, and of the float32 one."""
    bf16 = ("--set", "train.precision=bf16")
    path = cp_layout(tmp_path / "layout.toml", COMMON, [(12, 3, [(3, 1, 2), (3, 1, 1)])])
    run = launch(path, tmp_path, *bf16)
    assert_bf16_close(run, shared_launch(REFERENCE, *bf16))
    assert_bf16_close(run, reference)
    assert run.losses != reference.losses  # computed in bf16, not float32


def test_cp_2_without_overlap(reference, tmp_path):
    """``cp_overlap = false`` (each ring transfer waited for before the next block: the baseline of
    bench/context/context_links.py) trains the same model; --dry-run says the ring does not overlap."""
    path = cp_layout(tmp_path / "layout.toml", COMMON, [(12, 3, [(6, 1, 2)])])
    path.write_text(path.read_text().replace("cp = 2", "cp = 2\ncp_overlap = false"))
    lay = layout.load(path)
    assert [st.cp_overlap for st in lay.pipelines[0].stages] == [False]
    assert "(no overlap)" in "\n".join(describe_context(compile_plan(lay)))
    assert_same_model(launch(path, tmp_path), reference)
