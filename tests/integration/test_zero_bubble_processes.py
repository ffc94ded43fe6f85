"""The tests of tests/unit/test_zero_bubble.py that start processes or train for real (the integration tier).

Zero-bubble schedules: a backward split into input (I) and weight (W) gradients trains the same model.

The split is checked twice: the model functions against plain autograd in one process (same
gradients, weight gradients absent until W), and whole layouts with ``schedule = "zbh1"`` or a
schedule file mixing split and full backwards against the single-process run (float32, 1e-5).
"""

from __future__ import annotations

import pytest
from helpers_zero_bubble import reference  # noqa: F401  (a pytest fixture)

from harness import LAYOUTS, assert_same_model, common_sections, launch, write_layout

REFERENCE = LAYOUTS / "reference" / "reference.toml"

COMMON = common_sections(REFERENCE)  # 6 layers, hidden 32, 4 heads, rmsnorm, rope, swiglu

ZB_CASES = [
    ("2 stages uneven", [(12, 4, [(4, 1), (2, 1)])]),
    ("4 stages uneven, 6 microbatches", [(12, 6, [(2, 1), (1, 1), (1, 1), (2, 1)])]),
    ("tp [1, 2, 1]", [(12, 3, [(2, 1), (3, 2), (1, 1)])]),
    ("2 pipelines tp [[1, 2], [1, 1, 1]], rows 8/4", [(8, 4, [(3, 1), (3, 2)]), (4, 2, [(2, 1), (2, 1), (2, 1)])]),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name,pipelines", ZB_CASES, ids=[c[0] for c in ZB_CASES])
def test_zbh1_layout_trains_the_reference_model(name, pipelines, reference, tmp_path):
    path = write_layout(tmp_path / "layout.toml", COMMON, pipelines, "zbh1")
    assert_same_model(launch(path, tmp_path), reference)


@pytest.mark.multiprocess
def test_zbh1_with_recompute_trains_the_reference_model(reference, tmp_path):
    path = write_layout(
        tmp_path / "layout.toml",
        COMMON.replace("[train]", '[train]\nrecompute = "full"'),
        [(12, 4, [(3, 1), (3, 1)])],
        "zbh1",
    )
    assert_same_model(launch(path, tmp_path), reference)


@pytest.mark.multiprocess
def test_schedule_file_mixing_split_and_full_backwards(reference, tmp_path):
    """Stage 0 splits its backwards and runs every W at the end; stage 1 runs full B's."""
    (tmp_path / "order.txt").write_text("F0 F1 F2 I0 I1 I2 W2 W0 W1\nF0 B0 F1 B1 F2 B2\n")
    path = write_layout(tmp_path / "layout.toml", COMMON, [(12, 3, [(2, 1), (4, 1)])])
    path.write_text(
        path.read_text().replace("microbatches = 3\n", 'microbatches = 3\nschedule_file = "order.txt"\n', 1)
    )
    assert_same_model(launch(path, tmp_path), reference)
