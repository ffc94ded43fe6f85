"""Every combination of schedule kind, ``train.chunks``, schedule files and pipeline depth either
compiles to a plan that runs every layer exactly once per pipeline with a schedule that covers every
model chunk, or is refused with one located line. Pure and single-process (no torch).

The audit that found layers dropped from the model (``layers // chunks``), chunk actions without a
chunk to run them and a stage wrapped round to itself, all in accepted layouts, is replayed case by
case first; then the sweep checks the same rules over the whole grid.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import attrs
import pytest

from harness import own_nodes
from hetero_llm import schedule as sched
from hetero_llm.errors import LayoutError
from hetero_llm.layout import DataSpec, Layout, ModelSpec, Schedule, TrainSpec, dump, load
from hetero_llm.plan import compile_plan

LAYERS = 6
MICROBATCHES = 6  # divisible by every depth below, so generated interleaved schedules exist


def write(tmp: Path, schedule: str, chunks: int, pipes: list[tuple[list[int], str | None]]) -> Path:
    """A layout of 6 layers: ``pipes`` = [(stage layers, schedule file text or None)], one node each."""
    cluster, pipelines = own_nodes([(6, MICROBATCHES, [(layers, 1) for layers in stages]) for stages, _ in pipes])
    for pi, (_, text) in enumerate(pipes):
        if text is not None:
            (tmp / f"order{pi}.txt").write_text(text)
    pipelines = tuple(
        attrs.evolve(p, schedule_file=f"order{pi}.txt") if text is not None else p
        for pi, (p, (_, text)) in enumerate(zip(pipelines, pipes))
    )
    path = tmp / "layout.toml"
    dump(
        Layout(
            file=str(path),
            model=ModelSpec(layers=LAYERS, hidden=16, heads=2, vocab=32, seq_len=8),
            train=TrainSpec(steps=1, global_batch=6 * len(pipes), schedule=Schedule(schedule), chunks=chunks),
            data=DataSpec(grammar_vocab=16),
            cluster=cluster,
            pipelines=pipelines,
        ),
        path,
    )
    return path


def file_text(kind: str, stages: int, chunks: int) -> str:
    """A compute-only schedule file: a generated 1-chunk order, or GPipe over the virtual stages."""
    if chunks == 1:
        compute = sched.compute_schedule(kind, stages, MICROBATCHES)
    else:  # every stage runs its chunks in virtual-stage order: all forwards, then backwards reversed
        order = [(mb, c) for c in range(chunks) for mb in range(MICROBATCHES)]
        compute = [
            [sched.Action(sched.Kind.F, mb, c) for mb, c in order]
            + [sched.Action(sched.Kind.B, mb, c) for mb, c in reversed(order)]
            for _ in range(stages)
        ]
    return "\n".join(sched.format_actions(actions) for actions in compute) + "\n"


def check_plan(path: Path) -> None:
    """The rules an accepted layout must keep: each pipeline's chunk ranges tile its layers once, its
    schedule runs F and a backward of every (microbatch, chunk), and no boundary pairs a stage with itself."""
    plan = compile_plan(load(path))
    for pi in range(len(plan.layout.pipelines)):
        stages = [s for s in plan.stages if s.pipeline == pi]
        covered = sorted(layer for s in stages for lo, hi in s.chunk_ranges for layer in range(lo, hi))
        assert covered == list(range(LAYERS)), f"pipeline {pi} runs layers {covered}"
        chunks = {len(s.chunk_ranges) for s in stages}
        assert chunks == {plan.layout.train.chunks}
        schedule = plan.schedules[pi]
        assert sched.num_chunks(schedule) == plan.layout.train.chunks
        want = set(itertools.product(range(MICROBATCHES), range(plan.layout.train.chunks)))
        for actions in schedule:
            assert {(a.mb, a.chunk) for a in actions if a.kind is sched.Kind.F} == want
            assert {(a.mb, a.chunk) for a in actions if a.kind in (sched.Kind.B, sched.Kind.W)} == want
        sched.validate(schedule, MICROBATCHES)
    for group in plan.groups:
        assert len(set(group.ranks)) == len(group.ranks), f"{group.name} names a rank twice: {group.ranks}"


# ------------------------------------------------------------------------------- the audit's cases


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


# ------------------------------------------------------------------------------------- the sweep

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
