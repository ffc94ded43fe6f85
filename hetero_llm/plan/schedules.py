"""Each pipeline's action lists as the plan compiles them: generated for ``train.schedule``, or read from the
pipeline's schedule file and checked against the layout (one located ``LayoutError``). Pure data, no torch.
"""

from __future__ import annotations

import functools
import os

from hetero_llm import schedule as sched
from hetero_llm.errors import LayoutError, ScheduleError
from hetero_llm.layout import SPLIT_BACKWARD_NO_COMPILE, Backend, Compile, Layout, Schedule


def pipeline_schedule(layout: Layout, pi: int) -> list[list[sched.Action]]:
    """The lowered, validated action lists of pipeline ``pi`` (one per stage).

    'dynamic' pipelines list the 1F1B order here: it is what ``--dry-run`` shows and what the
    runtime falls back to for priorities; the runtime picks the actual order as inputs arrive.
    """
    pipe, train = layout.pipelines[pi], layout.train
    n = len(pipe.stages)
    if pipe.schedule_file:
        try:
            loaded = sched.load_schedule_file(pipe.schedule_file, n, pipe.microbatches)
        except ScheduleError as e:
            raise LayoutError(layout.file, f"pipelines[{pi}].schedule_file", str(e).splitlines()[0]) from None
        used = sched.num_chunks(loaded)
        if used != train.chunks:
            c = train.chunks
            if used > c:
                fix = (
                    "write chunk 0 only" if c == 1 else f"write chunks 0..{c - 1} only"
                ) + f", or set schedule = 'interleaved' and train.chunks = {used}"
            else:
                fix = f"give every stage F and B actions of chunks 0..{c - 1}, e.g. F0.{c - 1} B0.{c - 1}, or " + (
                    "set train.chunks = 1 and schedule = '1f1b'" if used == 1 else f"set train.chunks = {used}"
                )
            raise LayoutError(
                layout.file,
                f"pipelines[{pi}].schedule_file",
                f"{os.path.basename(pipe.schedule_file)}: uses {used} model chunk{'s' if used > 1 else ''} "
                f"per stage but train.chunks is {train.chunks} ({fix})",
            )
        if train.compile is Compile.BLOCKS and any(a.kind is sched.Kind.I for actions in loaded for a in actions):
            raise LayoutError(layout.file, "train.compile", SPLIT_BACKWARD_NO_COMPILE)
        if layout.cluster.backend is Backend.NCCL:  # generated schedules keep the order by construction
            try:
                sched.check_message_order(loaded)
            except ScheduleError as e:
                raise LayoutError(
                    layout.file,
                    f"pipelines[{pi}].schedule_file",
                    f"{os.path.basename(pipe.schedule_file)}: {str(e).splitlines()[0]}",
                ) from None
        return loaded
    kind = "1f1b" if train.schedule is Schedule.DYNAMIC else train.schedule.value
    return [list(actions) for actions in _generated(kind, n, pipe.microbatches, train.chunks)]


@functools.lru_cache(maxsize=64)  # pipelines of one shape share their lists: a planned layout has many such
def _generated(kind: str, stages: int, microbatches: int, chunks: int) -> tuple[tuple[sched.Action, ...], ...]:
    """The lowered, validated action lists of a generated schedule (a pure function of its arguments)."""
    lowered = sched.build(kind, stages, microbatches, chunks=chunks)
    sched.validate(lowered, microbatches)
    return tuple(tuple(actions) for actions in lowered)
