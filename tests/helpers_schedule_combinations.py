"""Helpers shared by tests/unit/test_schedule_combinations.py and tests/integration/test_schedule_combinations_grid.py; not a test module."""

from __future__ import annotations

import itertools
from pathlib import Path

import attrs

from harness import own_nodes
from hetero_llm import schedule as sched
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
