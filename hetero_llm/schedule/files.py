"""Schedule files: user-written schedules as text (one line per stage) or CSV (one column per stage)."""

from __future__ import annotations

import csv
import io
from pathlib import Path

from hetero_llm.errors import ScheduleError
from hetero_llm.schedule.ir import Action, ActionLists, is_lowered
from hetero_llm.schedule.lowering import lower
from hetero_llm.schedule.validator import validate


def load_schedule_file(path: str | Path, num_stages: int, num_microbatches: int) -> ActionLists:
    """Read a user-written schedule, lower it if it is compute-only, and validate it.

    Two formats; ``#`` starts a comment and blank lines are skipped in both:

    - text: one line per stage, its actions separated by spaces (``F0 F1 B0 F2 B1 B2``);
    - CSV (a ``.csv`` file, or one whose first line starts with ``stage``): a header
      ``stage 0,stage 1,...`` and then one row per step, one column per stage; a stage with fewer
      actions leaves its trailing cells empty (the layout ``format_grid`` prints).

    Actions may be compute-only (``F``/``B``/``W``; communication is then added by ``lower``) or
    already lowered. Every error is a ScheduleError that starts ``FILE: line N:``.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as error:
        raise ScheduleError(f"{path}: cannot read schedule file: {error.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise ScheduleError(
            f"{path}: line {line} is not UTF-8 text (a schedule file is text: action strings "
            "such as F0 B0, one line or CSV column per stage)"
        ) from None
    lines = [(number, raw.split("#", 1)[0].strip()) for number, raw in enumerate(text.splitlines(), 1)]
    lines = [(number, content) for number, content in lines if content]
    if not lines:
        raise ScheduleError(f"{path}: no actions (expected one line per stage, {num_stages} stages)")
    is_csv = path.suffix.lower() == ".csv" or lines[0][1].lower().startswith("stage")
    reader = _read_csv_schedule if is_csv else _read_text_schedule
    schedule, where = reader(path, lines, num_stages)

    def located(error: ScheduleError) -> ScheduleError:
        line = where(error.stage, error.step) if error.stage is not None else None
        prefix = f"{path}: line {line}: " if line is not None else f"{path}: "
        return ScheduleError(prefix + str(error), error.stage, error.step)

    try:
        validate(schedule, num_microbatches)
    except ScheduleError as error:
        raise located(error) from None
    if is_lowered(schedule):
        return schedule
    lowered = lower(schedule)
    try:
        validate(lowered, num_microbatches)
    except ScheduleError as error:  # not expected: lowering keeps a valid order valid
        raise ScheduleError(f"{path}: after lowering: {error}") from None
    return lowered


def _parse_cell(path: Path, line: int, token: str, what: str) -> Action:
    try:
        return Action.parse(token)
    except ScheduleError as error:
        raise ScheduleError(f"{path}: line {line}: {what}: {error}") from None


def _read_text_schedule(path: Path, lines: list[tuple[int, str]], num_stages: int):
    if len(lines) != num_stages:
        extra = lines[num_stages][0] if len(lines) > num_stages else lines[-1][0]
        raise ScheduleError(
            f"{path}: line {extra}: {len(lines)} stage lines, expected {num_stages} "
            "(one line of space-separated actions per stage)"
        )
    schedule = [
        [
            _parse_cell(path, number, token, f"stage {stage} action {index}")
            for index, token in enumerate(content.split())
        ]
        for stage, (number, content) in enumerate(lines)
    ]

    def where(stage: int, step: int | None) -> int | None:
        return lines[stage][0] if 0 <= stage < len(lines) else None

    return schedule, where


def _read_csv_schedule(path: Path, lines: list[tuple[int, str]], num_stages: int):
    header_line, header = lines[0]
    names = [cell.strip() for cell in next(csv.reader(io.StringIO(header)))]
    expected = [f"stage {stage}" for stage in range(num_stages)]
    if names != expected:
        raise ScheduleError(
            f"{path}: line {header_line}: header {','.join(names)!r}, expected "
            f"{','.join(expected)!r} (one column per stage)"
        )
    schedule: ActionLists = [[] for _ in range(num_stages)]
    rows: list[list[int]] = [[] for _ in range(num_stages)]  # file line of each stage's step
    for number, content in lines[1:]:
        cells = [cell.strip() for cell in next(csv.reader(io.StringIO(content)))]
        if len(cells) > num_stages:
            raise ScheduleError(f"{path}: line {number}: {len(cells)} cells, but the header has {num_stages} stages")
        for stage, cell in enumerate(cells):
            if cell:
                schedule[stage].append(_parse_cell(path, number, cell, f"stage {stage}"))
                rows[stage].append(number)

    def where(stage: int, step: int | None) -> int | None:
        if not 0 <= stage < num_stages:
            return None
        if step is None or step >= len(rows[stage]):
            return header_line
        return rows[stage][step]

    return schedule, where
