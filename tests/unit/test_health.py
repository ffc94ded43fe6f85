"""Training health without processes: the progress line's ETA, and how the launcher reports a diverged run."""

from __future__ import annotations

import pytest

from harness import LAYOUTS
from hetero_llm import layout as layout_mod
from hetero_llm.errors import Diverged, RankFailure
from hetero_llm.launch import node
from hetero_llm.plan import compile_plan
from hetero_llm.train.metrics import duration


@pytest.mark.parametrize(
    "seconds,shown",
    [
        (0, "00:00:00"),
        (59.9, "00:00:59"),
        (3661, "01:01:01"),
        (86399, "23:59:59"),
        (86400, "1d 00:00:00"),
        (90061, "1d 01:01:01"),
        (400 * 86400 + 5, "400d 00:00:05"),
        (9999 * 86400 + 86399, "9999d 23:59:59"),
        (10_000 * 86400, ">9999d"),
        (1e300, ">9999d"),
        (float("inf"), ">9999d"),
        (float("nan"), ">9999d"),
    ],
    ids=str,
)
def test_eta_shows_days_and_is_bounded(seconds, shown):
    """gmtime's %H:%M:%S wrapped at 24 h and overflowed (OSError, OverflowError) for absurd train.steps."""
    assert duration(seconds) == shown


def _plan():
    return compile_plan(layout_mod.load(LAYOUTS / "examples" / "two_pipelines.toml"))


def test_a_diverged_run_is_reported_as_such_not_as_a_rank_failure(tmp_path):
    cause = "training diverged at step 5 (counting from 1, as the console and --metrics-jsonl do): loss nan, gradient norm nan; ..."
    for r in (0, 1, 2):
        (tmp_path / f"rank{r}.err").write_text(cause + "\n")
    failure = node._failure(_plan(), {0: 3, 1: 3, 2: 3}, tmp_path)
    assert type(failure) is Diverged and str(failure) == cause and failure.exit_code == 3


def test_a_failed_rank_is_still_named(tmp_path):
    (tmp_path / "rank0.err").write_text("RuntimeError: Connection closed by peer\n")
    (tmp_path / "rank1.err").write_text("RuntimeError: boom\n")
    failure = node._failure(_plan(), {0: 1, 1: 1}, tmp_path)
    assert type(failure) is RankFailure and failure.exit_code == 1
    assert str(failure) == (
        "rank 1 (node0:1, pipeline 0 stage 1) failed: RuntimeError: boom; 1 other rank(s) failed "
        "after it; stopped the other ranks"
    )
