"""The tests of tests/unit/test_rendezvous.py that start processes or train for real (the integration tier).

The rendezvous (hetero_llm/comm/rendezvous.py): served where the ranks look for it, bound to the master's
address, every wait bounded by ``cluster.timeout_s`` and every failure one line.

The multi-host proof (a distinct address per node, rank 0 on a node that is not the master) runs on the
namespace testbed in tests/integration/test_testbed_launch.py; these run anywhere.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch.distributed  # noqa: F401  (imported here, so the timed rendezvous below does not include it)
from helpers_rendezvous import _plan

from harness import LAYOUTS, common_sections, free_port
from hetero_llm.comm import rendezvous
from hetero_llm.errors import RankFailure

COMMON = common_sections(LAYOUTS / "reference" / "reference.toml")

TWO_PIPELINES = [(6, 2, [(3, 1), (3, 1)]), (6, 2, [(6, 1)])]  # n0: ranks 0, 1; n1: rank 2


@pytest.mark.parametrize(
    "addr, why",
    [
        ("127.0.0.1", "Connection refused"),  # nothing listens
        ("192.0.2.1", None),
    ],
)  # nothing answers (unreachable or timing out)
def test_a_master_that_never_appears_is_given_up_on_within_the_timeout(tmp_path, monkeypatch, capfd, addr, why):
    plan, _ = _plan(tmp_path, "cluster.timeout_s=3")
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", addr)
    monkeypatch.setenv("MASTER_PORT", str(port))
    start = time.monotonic()
    with pytest.raises(RankFailure) as err:
        rendezvous.rendezvous(plan.rank_plan(1))
    took = time.monotonic() - start
    # 3.0 s when the machine is idle (before: ~3.3 x the timeout, in C++ frames). Under 2 x the timeout tells the
    # two apart; the rest is slack for a loaded machine (the last attempt ends at the deadline, so only
    # scheduling delays it)
    assert 3.0 <= took < 2 * 3.0, f"gave up after {took:.1f} s for a 3 s timeout"
    message = str(err.value)
    assert message.startswith(
        f"rank 1: nothing answered at {addr}:{port} (MASTER_ADDR, MASTER_PORT) within 3 s (last: "
    )
    assert message.endswith("); is rank 0 (n0:0), which serves it, started, and is the address right?")
    if why:
        assert f"(last: {why})" in message
    assert "\n" not in message and capfd.readouterr().err == ""  # no c10d retry warnings


@pytest.mark.multiprocess
def test_rank_waiting_for_a_missing_master_prints_one_line(tmp_path):
    _, path = _plan(tmp_path)
    port = free_port()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hetero_llm.cli",
            str(path),
            "--rank",
            "2",
            "--quiet",
            "--set",
            f"cluster.port={port}",
            "--set",
            "cluster.timeout_s=2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1
    assert proc.stderr == (
        f"error: rank 2: nothing answered at 127.0.0.1:{port} (node n0's host, cluster.port) within "
        "2 s (last: Connection refused); is rank 0 (n0:0), which serves it, started, and is the "
        "address right?\n"
    )
