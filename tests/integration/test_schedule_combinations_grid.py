"""The tests of tests/unit/test_schedule_combinations.py that start processes or train for real (the integration tier).

Every combination of schedule kind, ``train.chunks``, schedule files and pipeline depth either
compiles to a plan that runs every layer exactly once per pipeline with a schedule that covers every
model chunk, or is refused with one located line. Pure and single-process (no torch).

The audit that found layers dropped from the model (``layers // chunks``), chunk actions without a
chunk to run them and a stage wrapped round to itself, all in accepted layouts, is replayed case by
case first; then the sweep checks the same rules over the whole grid.
"""

from __future__ import annotations

import itertools

from helpers_schedule_combinations import check_plan, file_text, write

from hetero_llm.errors import LayoutError
from hetero_llm.layout import load
from hetero_llm.plan import compile_plan

LAYERS = 6

MICROBATCHES = 6  # divisible by every depth below, so generated interleaved schedules exist

SCHEDULES = ["gpipe", "1f1b", "interleaved", "dynamic", "zbh1"]

SPLITS = [[6], [3, 3], [4, 2], [2, 2, 2], [1, 2, 3]]

FILES = [None, ("1f1b", 1), ("zbh1", 1), ("", 2), ("", 3)]  # (generator, chunks) of pipeline 0's file

SECOND = [[6], [2, 4]]  # pipeline 1: generated, one or two stages


def test_every_combination_compiles_right_or_is_refused_in_one_line(tmp_path):
    accepted, refused = 0, 0
    for schedule, chunks, split, spec, second in itertools.product(SCHEDULES, [1, 2, 3], SPLITS, FILES, SECOND):
        case = tmp_path / f"{schedule}-{chunks}-{'+'.join(map(str, split))}-{spec}-{len(second)}"
        case.mkdir()
        text = None if spec is None else file_text(spec[0], len(split), spec[1])
        path = write(case, schedule, chunks, [(split, text), (second, None)])
        try:
            lay = load(path)
            compile_plan(lay)
        except LayoutError as error:
            message = str(error)
            assert "\n" not in message and message.startswith(f"{path}: "), message
            refused += 1
            continue
        check_plan(path)
        accepted += 1
    # The grid holds both kinds, so neither branch is vacuous.
    assert accepted >= 100 and refused >= 100, (accepted, refused)
