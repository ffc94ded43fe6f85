"""The rendezvous (hetero_llm/comm/rendezvous.py): served where the ranks look for it, bound to the master's
address, every wait bounded by ``cluster.timeout_s`` and every failure one line.

The multi-host proof (a distinct address per node, rank 0 on a node that is not the master) runs on the
namespace testbed in tests/integration/test_testbed_launch.py; these run anywhere.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest
import torch.distributed  # noqa: F401  (imported here, so the timed rendezvous below does not include it)
from helpers_rendezvous import _plan

from harness import (
    LAYOUTS,
    assert_one_error_line,
    common_sections,
    free_port,
    invoke_cli,
    rank0_off_master_layout,
    write_layout,
)
from hetero_llm import layout as layout_mod
from hetero_llm.comm import rendezvous
from hetero_llm.errors import LayoutError, RankFailure
from hetero_llm.plan import compile_plan

COMMON = common_sections(LAYOUTS / "reference" / "reference.toml")

TWO_PIPELINES = [(6, 2, [(3, 1), (3, 1)]), (6, 2, [(6, 1)])]  # n0: ranks 0, 1; n1: rank 2


def test_the_lowest_rank_on_the_master_node_serves(tmp_path):
    plan, _ = _plan(tmp_path)
    assert rendezvous.server_rank(plan) == 0
    plan, _ = _plan(tmp_path, "cluster.master=n1")  # rank 0 is on n0, not on the master node
    assert rendezvous.server_rank(plan) == 2
    ep = rendezvous.endpoint(plan, {})
    assert (ep.host, ep.port, ep.server, ep.coordinator, ep.prefix) == ("127.0.0.1", plan.layout.cluster.port, 2, 2, "")


def test_torchrun_agent_store_has_no_server_and_a_prefix_per_attempt(tmp_path):
    plan, _ = _plan(tmp_path, "cluster.master=n1")
    env = {
        "MASTER_ADDR": "10.0.0.9",
        "MASTER_PORT": "29999",
        "TORCHELASTIC_RUN_ID": "x",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "1",
    }
    ep = rendezvous.endpoint(plan, env)
    assert (ep.host, ep.port, ep.server, ep.coordinator, ep.prefix) == ("10.0.0.9", 29999, None, 0, "attempt-1/")
    ep = rendezvous.endpoint(plan, {**env, "TORCHELASTIC_USE_AGENT_STORE": "False"})
    assert ep.server == 0  # torch's rule without the agent's store: rank 0 serves at MASTER_ADDR


@pytest.mark.parametrize("port", ["abc", "70000", "0", "-1"])
def test_bad_master_port_is_one_line(tmp_path, monkeypatch, port):
    _, path = _plan(tmp_path)
    monkeypatch.setenv("MASTER_PORT", port)
    assert_one_error_line(
        invoke_cli(path, "--dry-run"),
        f"environment: MASTER_PORT: '{port}' is not a TCP port "
        "(1..65535); set one, or unset it to use cluster.port (29511)",
    )


def test_listens_on_the_masters_address_only(capfd):
    port = free_port()
    sock = rendezvous.listen("127.0.0.1", port, "rank 0")
    try:
        assert sock.getsockname() == ("127.0.0.1", port)
    finally:
        sock.close()
    # not an address of this machine (MASTER_ADDR seen through NAT): every interface, said on stderr
    sock = rendezvous.listen("192.0.2.1", port, "rank 0")  # TEST-NET-1: never local
    try:
        assert sock.getsockname() == ("0.0.0.0", port)
    finally:
        sock.close()
    assert capfd.readouterr().err == (
        "warning: rank 0: 192.0.2.1 is not an address of this machine; serving the "
        f"rendezvous on every interface, port {port}\n"
    )


def test_port_in_use_is_one_line():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        with pytest.raises(
            RankFailure,
            match=rf"^rank 0 could not serve the rendezvous on 127\.0\.0\.1:{port}: "
            r"Address already in use \(port in use: set MASTER_PORT or cluster.port\)$",
        ):
            rendezvous.listen("127.0.0.1", port, "rank 0")


def test_an_unresolvable_host_is_one_line_at_once(tmp_path, monkeypatch, capfd):
    plan, _ = _plan(tmp_path, "cluster.timeout_s=120")
    monkeypatch.setenv("MASTER_ADDR", "no-such-host.invalid")
    start = time.monotonic()
    with pytest.raises(
        RankFailure,
        match=r"^rank 1: the rendezvous host 'no-such-host.invalid' \(MASTER_ADDR, "
        r"cluster.port\) does not resolve \(.+\); fix it$",
    ):
        rendezvous.rendezvous(plan.rank_plan(1))
    assert time.monotonic() - start < 60  # not the 120 s timeout: the lookup's answer, however slow the resolver
    assert capfd.readouterr().err == ""


def test_a_master_node_without_ranks_is_refused(tmp_path):
    path = write_layout(tmp_path / "l.toml", COMMON, [(12, 3, [(6, 1)])])
    path.write_text(
        path.read_text().replace(
            "[[pipelines]]", '[[cluster.nodes]]\nname = "spare"\ndevices = ["cpu"]\n\n[[pipelines]]', 1
        )
    )
    result = invoke_cli(path, "--dry-run", "--set", "cluster.master=spare")
    assert_one_error_line(
        result,
        f"{path}: cluster.master: the master node 'spare' runs no rank, so nothing would "
        "serve the rendezvous at its host; make a node with ranks the master (cluster.master)",
    )


def test_endpoint_is_torch_free_and_checked_before_anything_starts(tmp_path):
    _, path = _plan(tmp_path)
    code = (
        "import sys; from hetero_llm import layout; from hetero_llm.comm import rendezvous; from hetero_llm.plan import compile_plan; "
        f"rendezvous.endpoint(compile_plan(layout.load({str(path)!r}))); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
    with pytest.raises(LayoutError):
        rendezvous.endpoint(compile_plan(layout_mod.load(path)), {"MASTER_PORT": "x"})


def test_dry_run_says_where_the_ranks_meet_and_who_serves(tmp_path, monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    path = rank0_off_master_layout(tmp_path / "l.toml", ("127.0.0.1", "127.0.0.2"))
    result = invoke_cli(path, "--dry-run")
    assert result.exit_code == 0, result.stderr
    assert (
        "rendezvous: 127.0.0.1:29511 (node node0's host, cluster.port), served by rank 1 (node0:0)"
        in result.stdout.splitlines()
    )
