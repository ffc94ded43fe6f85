"""Liveness is decided by heartbeats, not by how long a rank waits (hetero_llm/comm/groups.py, heartbeat.py).

A rank that waits while its peers compute (a pipeline with a small share of the batch, a device idle for a
hot-switching bucket) must not be killed for waiting, however long the wait; a rank that truly stops must still
be named within ``cluster.timeout_s``. The slow peers are emulated (``HETERO_EMULATE_ACTION_S``: a rank's
forward lasts that many seconds), and every wait below outlasts both ``cluster.timeout_s`` and the 30 s that
gloo and the shared-memory rings used to allow, after which these runs died naming a waiting rank.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers_launch import start_server

from harness import LAYOUTS, assert_same_model, common_sections, free_port, launch, sections
from hetero_llm import layout
from hetero_llm.predict import trace as tracing

pytestmark = pytest.mark.multiprocess

SLOW_S = 32  # an emulated forward: longer than the 30 s floor of the old receive timeouts
TIMEOUT_S = 4.0  # cluster.timeout_s of these layouts


def _unbalanced(path: Path) -> Path:
    """The reference model over 3 pipelines of 4 rows each, 5 ranks: pipeline 0's boundary crosses nodes (a gloo
    send and receive), pipeline 1's stays inside node n2 (a shared-memory ring), pipeline 2 is one rank that holds
    every layer (it sums its gradients with all four others)."""
    model, train, data = sections(common_sections(LAYOUTS / "reference" / "reference.toml"), path)
    N, S, P = layout.NodeSpec, layout.StageSpec, layout.PipelineSpec
    cluster = layout.ClusterSpec(
        nodes=(N(name="n0"), N(name="n1"), N(name="n2", devices=("cpu", "cpu")), N(name="n3")), timeout_s=TIMEOUT_S
    )
    pipelines = (
        P(batch=4, microbatches=1, stages=(S(layers=3, devices=("n0:0",)), S(layers=3, devices=("n1:0",)))),
        P(batch=4, microbatches=1, stages=(S(layers=3, devices=("n2:0",)), S(layers=3, devices=("n2:1",)))),
        P(batch=4, microbatches=1, stages=(S(layers=6, devices=("n3:0",)),)),
    )
    layout.dump(
        layout.Layout(file=str(path), model=model, train=train, data=data, cluster=cluster, pipelines=pipelines), path
    )
    return path


ONE_STEP = ("--set", "train.steps=1")


HOT_SWITCH = f"""
[model]
layers = 2
hidden = 32
heads = 4
vocab = 64
seq_len = 32

[train]
steps = 1
global_batch = 4
seed = 5

[data]
packing = "documents"
doc_len_median = 12.0
doc_len_sigma = 0.0     # every document in bucket 0

[cluster]
timeout_s = {TIMEOUT_S}
[[cluster.nodes]]
name = "node0"
devices = ["cpu", "cpu"]

[[pipelines]]           # home: TP 2
batch = 4
microbatches = 2
[[pipelines.stages]]
layers = 2
devices = ["node0:0", "node0:1"]

[[buckets]]             # 1-12 positions: node0:0 alone, node0:1 idle
max_len = 12
[[buckets.pipelines]]
batch = 4
microbatches = 1
[[buckets.pipelines.stages]]
layers = 2
devices = ["node0:0"]

[[buckets]]             # 13-32 positions: home
max_len = 32
"""


@pytest.fixture(scope="module")
def slow_runs(tmp_path_factory):
    """The two slow runs below and their references, started side by side: the slow runs spend SLOW_S and more
    in emulated forwards (sleeps) and waits, not computing, so they overlap instead of taking that time twice.
    Each test gets its own runs' results (or their errors) as futures; each slow run is timed on its own."""
    d = tmp_path_factory.mktemp("slow")
    for sub in ("unbalanced", "unbalanced_ref", "hot", "hot_ref"):
        (d / sub).mkdir()
    one = d / "hot_ref" / "one.toml"
    one.write_text(
        HOT_SWITCH.split("[cluster]")[0]
        + '[cluster]\n[[cluster.nodes]]\nname = "node0"\ndevices = ["cpu"]\n[[pipelines]]\nbatch = 4\n'
        + 'microbatches = 2\n[[pipelines.stages]]\nlayers = 2\ndevices = ["node0:0"]\n'
    )
    switching = d / "hot" / "hot_switch.toml"
    switching.write_text(HOT_SWITCH)

    def timed(*args, **kwargs):
        started = time.monotonic()
        return launch(*args, **kwargs), time.monotonic() - started

    jobs = {
        "unbalanced": lambda: timed(
            _unbalanced(d / "unbalanced" / "unbalanced.toml"),
            d / "unbalanced",
            *ONE_STEP,
            timeout=300,
            env={"HETERO_EMULATE_ACTION_S": f"0:F={SLOW_S},2:F={SLOW_S}"},
        ),
        "unbalanced_ref": lambda: launch(LAYOUTS / "reference" / "reference.toml", d / "unbalanced_ref", *ONE_STEP),
        "hot": lambda: timed(
            switching,
            d / "hot",
            "--trace",
            str(d / "hot" / "trace"),
            timeout=300,
            env={"HETERO_EMULATE_ACTION_S": f"0:F={SLOW_S}"},
        ),
        "hot_ref": lambda: launch(one, d / "hot_ref"),
    }
    start_server(dict(os.environ))  # before the threads launch side by side
    with ThreadPoolExecutor(len(jobs)) as pool:
        yield {name: pool.submit(job) for name, job in jobs.items()}


def test_ranks_waiting_on_slow_peers_survive_and_train_the_one_process_model(slow_runs):
    """Ranks 0 and 2 take SLOW_S per forward: rank 1 waits that long in a gloo receive, rank 3 on a shared-memory
    ring, rank 4 (and then 1 and 3) in the gradient all-reduce."""
    run, took = slow_runs["unbalanced"].result()
    assert took > SLOW_S  # the waits were as long as meant
    assert_same_model(run, slow_runs["unbalanced_ref"].result())


def test_a_device_idle_for_a_whole_bucket_waits_it_out(slow_runs):
    """Rank 1 has no part in bucket 0: it waits for rank 0's gradients (the switch back home) while rank 0 runs
    the bucket, SLOW_S and more."""
    run, took = slow_runs["hot"].result()
    assert took > SLOW_S
    assert_same_model(run, slow_runs["hot_ref"].result())
    events = [e["action"] for e in tracing.read_rank_traces(run.workdir / "trace")[1]["events"]]
    idle = events[events.index("SWITCH>b0") + 1 : events.index("SWITCH>home")]
    assert not [a for a in idle if a[:1] in "FB"], idle  # rank 1 computed nothing in bucket 0: it waited


def _ranks(launcher: int) -> dict[int, int]:
    """rank -> pid of the ranks a launcher forked (each names itself hl-rank<R>)."""
    out = {}
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            name = (entry / "comm").read_text().strip()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == launcher and name.startswith("hl-rank"):
            out[int(name.removeprefix("hl-rank"))] = int(entry.name)
    return out


def _alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("how", ["SIGSTOP", "SIGKILL"])
def test_a_stopped_or_killed_rank_is_still_named_while_its_peers_wait(tmp_path, how):
    """Rank 2 is stopped or killed in one of its slow forwards: rank 3 waits for it on a shared-memory ring,
    ranks 0, 1 and 4 in the gradient sync. Its peers' heartbeats name a stopped rank within cluster.timeout_s (or
    the launcher, at twice that); a killed one at once."""
    path = _unbalanced(tmp_path / "unbalanced.toml")
    metrics = tmp_path / "metrics.jsonl"
    cmd = [sys.executable, "-m", "hetero_llm.cli", str(path), "--quiet", "--metrics-jsonl", str(metrics)]
    cmd += ["--set", "train.steps=100000", "--set", f"cluster.port={free_port()}"]
    env = {**os.environ, "HETERO_EMULATE_ACTION_S": "0:F=2,2:F=2"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 300  # a hang's bound: a loaded machine only delays the first step
        while not (metrics.exists() and metrics.read_text().strip()):  # a step done: every rank trains
            assert proc.poll() is None and time.monotonic() < deadline, "no step within 300 s"
            time.sleep(0.1)
        ranks = _ranks(proc.pid)
        assert sorted(ranks) == [0, 1, 2, 3, 4]
        # Wherever in its step rank 2 is hit (most of a step is its 2 s forward), its peers end up waiting for it:
        # rank 3 on the ring, the others in the gradient sync. Nothing but the failure ends this 100000-step job,
        # and the line says what ended it (the rank's exit, its peers' heartbeats after cluster.timeout_s, or the
        # launcher at twice that), so the bound on the wait is a hang's, not a speed.
        os.kill(ranks[2], getattr(signal, how))
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1
    if how == "SIGKILL":
        assert "error: rank 2 (n2:0, pipeline 1 stage 0) failed: killed by SIGKILL" in err, err
    else:
        assert re.fullmatch(
            r"error: rank 2 \(n2:0\) stopped responding: (no heartbeat for \d+ s \(cluster.timeout_s 4; a stopped "
            r"or hung process\); rank \d gave up waiting for it(; \d other rank\(s\) gave up too)?|its process has "
            r"been stopped \(SIGSTOP\) for \d+ s \(twice cluster.timeout_s 4\)); stopped the other ranks",
            err.strip(),
        ), err
    assert "Traceback" not in err
    deadline = time.monotonic() + 60  # ranks exit once stopped; a loaded machine only delays it
    while any(_alive(pid) for pid in ranks.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [r for r, pid in ranks.items() if _alive(pid)], "ranks left running"
