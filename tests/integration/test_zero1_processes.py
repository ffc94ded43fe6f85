"""The tests of tests/unit/test_zero1.py that start processes or train for real (the integration tier).

ZeRO-1 (``train.optimizer = 'adamw_zero1'``): the sharded optimizer trains the same model as one process.

Pure checks first (which rank updates which slice, the memory formula, the schedule actions and the
simulator), then whole runs through ``hetero-launch`` (gloo, CPU) against the single-process run with
gradient clipping active (``train.grad_clip`` below every step's norm), checkpoints saved under ZeRO-1
and resumed without it on another layout and the reverse, bf16, and the trace's RS/AG actions.
"""

from __future__ import annotations

import attrs
import pytest

from harness import LAYOUTS, assert_same_model, common_sections, launch, write_layout
from hetero_llm.predict.trace import rank_rows, read_rank_traces

REFERENCE = LAYOUTS / "reference" / "reference.toml"

COMMON = common_sections(REFERENCE)  # 6 layers, hidden 32, 4 heads, global batch 12

COMMON_TP23 = (
    COMMON.replace("hidden = 32", "hidden = 48")
    .replace("heads = 4", "heads = 6")
    .replace('mlp = "swiglu"', 'mlp = "swiglu"\nffn = 96')
)

CLIP = ("--set", "train.grad_clip=0.3")  # every step's global norm is 0.6-0.7 here: clipping scales each step

ZERO1 = ("--set", "train.optimizer=adamw_zero1")

multiprocess = pytest.mark.multiprocess

STEPS = ("--set", "train.steps=4")  # 4 steps: the checkpoint tests save after 2


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return launch(REFERENCE, tmp_path_factory.mktemp("reference"), *CLIP, *STEPS)


@pytest.fixture(scope="module")
def reference_tp23(tmp_path_factory):
    d = tmp_path_factory.mktemp("reference_tp23")
    return launch(write_layout(d / "ref.toml", COMMON_TP23, [(12, 3, [(6, 1)])]), d, *CLIP, *STEPS)


RUN_CASES = [
    ("symmetric: 2 pipelines of 2 stages", [(6, 2, [(3, 1), (3, 1)]), (6, 2, [(3, 1), (3, 1)])], "1f1b"),
    ("tp 2 beside tp 1", [(8, 4, [(3, 1), (3, 2)]), (4, 2, [(6, 1)])], "1f1b"),
    ("3 pipelines, dynamic", [(6, 2, [(6, 1)]), (4, 2, [(2, 1), (4, 2)]), (2, 2, [(6, 1)])], "dynamic"),
    ("1 pipeline tp [1, 2], zbh1", [(12, 3, [(2, 1), (4, 2)])], "zbh1"),
]


@multiprocess
def test_reference_clips_every_step(reference):
    assert all(n > 0.3 for n in reference.grad_norms), reference.grad_norms


@multiprocess
@pytest.mark.parametrize("name,pipelines,schedule", RUN_CASES, ids=[c[0] for c in RUN_CASES])
def test_zero1_layout_trains_the_reference_model(name, pipelines, schedule, reference, tmp_path):
    path = write_layout(tmp_path / "layout.toml", COMMON, pipelines, schedule)
    assert_same_model(launch(path, tmp_path, *CLIP, *ZERO1, *STEPS), reference)


@multiprocess
def test_zero1_tp_2_beside_tp_3(reference_tp23, tmp_path):
    path = write_layout(tmp_path / "layout.toml", COMMON_TP23, [(6, 2, [(6, 2)]), (6, 3, [(6, 3)])])
    assert_same_model(launch(path, tmp_path, *CLIP, *ZERO1, *STEPS), reference_tp23)


@multiprocess
@pytest.mark.parametrize("zero1_first", [True, False], ids=["zero1 save -> plain resume", "plain save -> zero1 resume"])
def test_checkpoint_moves_between_zero1_and_plain_adamw_and_layouts(zero1_first, reference, tmp_path):
    a = write_layout(tmp_path / "a.toml", COMMON, [(8, 4, [(3, 1), (3, 2)]), (4, 2, [(6, 1)])])
    b = write_layout(tmp_path / "b.toml", COMMON, [(6, 2, [(6, 2)]), (6, 3, [(2, 1), (4, 1)])])
    first = launch(a, tmp_path / "a", *CLIP, *STEPS, "--checkpoint-every", "2", *(ZERO1 if zero1_first else ()))
    rest = launch(
        b,
        tmp_path / "b",
        *CLIP,
        *STEPS,
        "--resume",
        str(tmp_path / "a" / "ckpt" / "step-000002"),
        *(() if zero1_first else ZERO1),
    )
    both = attrs.evolve(rest, losses=first.losses[:2] + rest.losses, grad_norms=first.grad_norms[:2] + rest.grad_norms)
    assert_same_model(both, reference)


@multiprocess
def test_zero1_in_bf16_stays_within_the_bf16_tolerance(reference, tmp_path):
    from helpers_precision import assert_bf16_close

    path = write_layout(tmp_path / "layout.toml", COMMON, [(8, 4, [(3, 1), (3, 2)]), (4, 2, [(6, 1)])])
    assert_bf16_close(launch(path, tmp_path, *CLIP, *ZERO1, *STEPS, "--set", "train.precision=bf16"), reference)


@multiprocess
def test_trace_shows_the_optimizer_actions(tmp_path):
    path = write_layout(tmp_path / "layout.toml", COMMON, [(6, 2, [(3, 1), (3, 1)]), (6, 2, [(6, 1)])])
    launch(path, tmp_path, *ZERO1, "--trace", str(tmp_path / "trace"))
    labels, rows = rank_rows(read_rank_traces(tmp_path / "trace"))
    assert len(rows) == 3
    for row in rows:
        events = [action for action, _, _ in row]
        assert events.count("AG0") == 3 and events.count("RS0") == 3, events  # once per step
        assert events.index("AG0") < events.index("F0") and events[-1] == "RS0"
