"""Layout invariance: every valid layout trains the same model as one process (float32, 1e-5).

Each case runs ``hetero-launch`` on a layout with gloo on CPU and compares per-step losses, gradient
norms and every final parameter with the single-process run of the same [model], [data] and seed.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from harness import LAYOUTS, RUNNABLE_LAYOUTS, assert_same_model, common_sections, launch, write_layout
from hetero_llm import layout as layout_mod

pytestmark = pytest.mark.multiprocess

REFERENCE = LAYOUTS / "reference" / "reference.toml"
COMMON = common_sections(REFERENCE)  # 6 layers, hidden 32, 4 heads, global batch 12

# Tensor-parallel sizes 2 and 3 side by side need heads and MLP width divisible by both.
COMMON_TP23 = (
    COMMON.replace("hidden = 32", "hidden = 48")
    .replace("heads = 4", "heads = 6")
    .replace('mlp = "swiglu"', 'mlp = "swiglu"\nffn = 96')
)


@pytest.fixture(scope="module")
def reference(shared_launch):
    return shared_launch(REFERENCE)  # one run for the modules that compare with it (conftest.py)


@pytest.fixture(scope="module")
def reference_tp23(tmp_path_factory):
    d = tmp_path_factory.mktemp("reference_tp23")
    return launch(write_layout(d / "ref.toml", COMMON_TP23, [(12, 3, [(6, 1)])]), d)


# (name, pipelines [(batch, microbatches, [(layers, tp), ...])], schedule)
PIPELINE_CASES = [
    ("2 stages uneven, 1f1b", [(12, 4, [(4, 1), (2, 1)])], "1f1b"),
    ("3 stages uneven, gpipe", [(12, 3, [(1, 1), (3, 1), (2, 1)])], "gpipe"),
    ("4 stages uneven, 1f1b", [(12, 6, [(2, 1), (1, 1), (1, 1), (2, 1)])], "1f1b"),
    (
        "2 pipelines: 3+2 stages, 8/4 rows, 4/1 microbatches",
        [(8, 4, [(2, 1), (3, 1), (1, 1)]), (4, 1, [(5, 1), (1, 1)])],
        "1f1b",
    ),
    (
        "3 pipelines: 1+2+3 stages, 6/4/2 rows, gpipe",
        [(6, 2, [(6, 1)]), (4, 4, [(5, 1), (1, 1)]), (2, 2, [(1, 1), (1, 1), (4, 1)])],
        "gpipe",
    ),
]

TP_CASES = [
    ("tp [1, 2, 1]", [(12, 4, [(2, 1), (3, 2), (1, 1)])], "1f1b"),
    ("tp [1, 4, 2]: boundaries 1->4 and 4->2", [(12, 3, [(2, 1), (2, 4), (2, 2)])], "1f1b"),
    (
        "tp [[1, 2, 1], [2, 2]], partitions 1+3+2 / 4+2, rows 8/4",
        [(8, 4, [(1, 1), (3, 2), (2, 1)]), (4, 2, [(4, 2), (2, 2)])],
        "1f1b",
    ),
    (
        "tp [[4], [2, 2], [1, 1, 1, 1]]",
        [(6, 3, [(6, 4)]), (4, 2, [(3, 2), (3, 2)]), (2, 2, [(1, 1), (2, 1), (2, 1), (1, 1)])],
        "gpipe",
    ),
]


SCHEDULE_CASES = [
    ("dynamic, 2 pipelines with tp [[1, 2, 1], [3]]", [(8, 4, [(2, 1), (3, 2), (1, 1)]), (4, 2, [(6, 1)])], "dynamic"),
    ("dynamic, 4 stages", [(12, 6, [(1, 1), (2, 1), (2, 1), (1, 1)])], "dynamic"),
]


@pytest.mark.parametrize(
    "name,pipelines,schedule",
    PIPELINE_CASES + TP_CASES + SCHEDULE_CASES,
    ids=[c[0] for c in PIPELINE_CASES + TP_CASES + SCHEDULE_CASES],
)
def test_layout_trains_the_reference_model(name, pipelines, schedule, reference, tmp_path):
    path = write_layout(tmp_path / "layout.toml", COMMON, pipelines, schedule)
    assert_same_model(launch(path, tmp_path), reference)


NETWORK_CASES = [PIPELINE_CASES[0], TP_CASES[0], SCHEDULE_CASES[1]]  # one pipeline each: its node is n0


@pytest.mark.parametrize("name,pipelines,schedule", NETWORK_CASES, ids=[c[0] for c in NETWORK_CASES])
def test_boundaries_over_the_network_train_the_reference_model(name, pipelines, schedule, reference, tmp_path):
    """The cases above move same-node boundaries through shared memory (p2p = 'auto'); these through gloo."""
    path = write_layout(tmp_path / "layout.toml", COMMON, pipelines, schedule)
    assert_same_model(launch(path, tmp_path, "--set", "cluster.nodes[0].p2p=network"), reference)


@pytest.mark.parametrize(
    "stages,microbatches",
    [([(4, 1), (2, 2)], 4), ([(2, 1), (2, 2), (2, 1)], 6)],
    ids=["2 stages tp [1, 2]", "3 stages tp [1, 2, 1]"],
)
def test_interleaved_two_chunks(stages, microbatches, reference, tmp_path):
    common = COMMON.replace('schedule = "1f1b"', 'schedule = "interleaved"\nchunks = 2')
    path = write_layout(tmp_path / "layout.toml", common, [(12, microbatches, stages)])
    assert_same_model(launch(path, tmp_path), reference)


def test_schedule_file_for_one_pipeline(reference, tmp_path):
    """A user-written order (all forwards, then backwards in reverse) in pipeline 0; 1F1B in pipeline 1."""
    (tmp_path / "order.txt").write_text("# stage 0\nF0 F1 F2 F3 B3 B2 B1 B0\n# stage 1\nF0 B0 F1 B1 F2 B2 F3 B3\n")
    path = write_layout(tmp_path / "layout.toml", COMMON, [(8, 4, [(3, 1), (3, 1)]), (4, 2, [(6, 1)])])
    path.write_text(
        path.read_text().replace("microbatches = 4\n", 'microbatches = 4\nschedule_file = "order.txt"\n', 1)
    )
    assert_same_model(launch(path, tmp_path), reference)


def test_two_chunk_schedule_file_beside_generated_interleaved(reference, tmp_path):
    """Interleaved with 2 chunks: pipeline 0 runs a user file (GPipe over its 4 virtual stages, 4 + 2
    layers cut into chunks of 2 + 1), pipeline 1 the generated order (2 + 4 layers)."""
    order = " ".join(
        [f"F{m}" for m in range(4)]
        + [f"F{m}.1" for m in range(4)]
        + [f"B{m}.1" for m in reversed(range(4))]
        + [f"B{m}" for m in reversed(range(4))]
    )
    (tmp_path / "order.txt").write_text(f"{order}\n{order}\n")
    common = COMMON.replace('schedule = "1f1b"', 'schedule = "interleaved"\nchunks = 2')
    path = write_layout(tmp_path / "layout.toml", common, [(8, 4, [(4, 1), (2, 1)]), (4, 2, [(2, 1), (4, 1)])])
    path.write_text(
        path.read_text().replace("microbatches = 4\n", 'microbatches = 4\nschedule_file = "order.txt"\n', 1)
    )
    assert_same_model(launch(path, tmp_path), reference)


def test_tp_sizes_2_and_3_in_different_pipelines(reference_tp23, tmp_path):
    """Shards of 1/2 and 1/3 of each weight: gradient sync over the finest common blocks."""
    path = write_layout(tmp_path / "layout.toml", COMMON_TP23, [(6, 2, [(3, 2), (3, 3)]), (6, 3, [(2, 3), (4, 2)])])
    assert_same_model(launch(path, tmp_path), reference_tp23)


def _single_process_references() -> dict[Path, layout_mod.Layout]:
    refs = {}
    for p in RUNNABLE_LAYOUTS:
        lay = layout_mod.load(p)
        if len(lay.pipelines) == 1 and len(lay.pipelines[0].stages) == 1 and lay.pipelines[0].stages[0].tp == 1:
            refs[p] = lay
    return refs


def _same_model(a: layout_mod.Layout, b: layout_mod.Layout) -> bool:
    """Same model, data and optimization; the schedule, step count and where AdamW's state lives (adamw or
    adamw_zero1, which trains the same model: docs/invariance.md) may differ."""

    def key(lay):
        train = attrs.evolve(lay.train, schedule=b.train.schedule, steps=0, log_every=1, optimizer=b.train.optimizer)
        return lay.model, lay.data, train

    return key(a) == key(b)


# The walkthrough layouts train for minutes on real text: tests/integration/test_walkthrough.py runs own_text a few steps.
EXAMPLES = [
    p
    for p in RUNNABLE_LAYOUTS
    if p.name not in ("quickstart.toml", "own_text.toml") and p not in _single_process_references()
]


def test_at_least_three_examples_share_a_single_process_reference():
    refs = _single_process_references()
    sharing = [p for p in EXAMPLES if any(_same_model(layout_mod.load(p), r) for r in refs.values())]
    assert len(sharing) >= 3, sharing


@pytest.fixture(scope="module")
def example_references(shared_launch):
    """One single-process run per reference layout, shared by the examples that match it (and, at the layout's own
    step count, with the other modules: reference.toml's run is ``reference`` above)."""

    def get(path: Path, steps: int):
        if steps == layout_mod.load(path).train.steps:
            return shared_launch(path)
        return shared_launch(path, "--set", f"train.steps={steps}")

    return get


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_layout_trains_its_reference_model(example, example_references, tmp_path):
    lay = layout_mod.load(example)
    ref_path = next(p for p, r in _single_process_references().items() if _same_model(lay, r))
    assert_same_model(launch(example, tmp_path), example_references(ref_path, lay.train.steps))
