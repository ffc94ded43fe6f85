"""The launch helpers in launch/: per-node script, per-rank script generator, SLURM example; HexiScale layouts.

Light on purpose: one real training run (run_node.sh on the one-rank reference layout); the start and
stop scripts are exercised with stand-in processes (``sleep``), which is what they manage.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from harness import free_port, rank0_off_master_layout
from hetero_llm import layout as layout_mod
from launch import gen_rank_scripts as gen

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "launch"
RUN_NODE = LAUNCH / "run_node.sh"
SBATCH = LAUNCH / "slurm_example.sbatch"


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")}
    env.update(extra)
    return env


@pytest.fixture
def uneven_layout(tmp_path: Path) -> Path:
    """One pipeline with TP sizes 1, 2, 1 on node0 (3 devices) and node1 (1 device); reference model."""
    path = tmp_path / "uneven.toml"
    model_train_data = (ROOT / "layouts" / "reference" / "reference.toml").read_text().split("[cluster]")[0]
    path.write_text(
        model_train_data
        + """[cluster]
[[cluster.nodes]]
name = "node0"
host = "10.1.2.3"
devices = ["cpu", "cpu", "cpu"]
[[cluster.nodes]]
name = "node1"
host = "10.1.2.4"
devices = ["cpu"]

[[pipelines]]
batch = 12
microbatches = 3
[[pipelines.stages]]
layers = 2
devices = ["node0:0"]
[[pipelines.stages]]
layers = 2
devices = ["node0:1", "node0:2"]
[[pipelines.stages]]
layers = 2
devices = ["node1:0"]
"""
    )
    return path


def _generate(layout: Path, out: Path, *args: str, env: dict[str, str] | None = None):
    no_rendezvous = {"MASTER_ADDR": None, "MASTER_PORT": None}  # None: unset while the command runs
    return CliRunner().invoke(
        gen.main, [str(layout), "--out", str(out), *args], env={**no_rendezvous, **(env or {})}, catch_exceptions=False
    )


def _alive(pid: int) -> bool:
    """Running and not a zombie (an orphan's zombie waits for init, which may be slow to reap)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _wait_dead(pid: int, timeout: float = 60.0) -> bool:  # a hang's bound: a loaded machine only delays an exit
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


# ------------------------------------------------------------------------------------------
# gen_rank_scripts.py


def test_generator_writes_one_script_per_rank(uneven_layout, tmp_path):
    out = tmp_path / "out"
    result = _generate(uneven_layout, out, "--set", "train.steps=2", "--", "--quiet")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == [
        "rank0_node0.sh",
        "rank1_node0.sh",
        "rank2_node0.sh",
        "rank3_node1.sh",
        "start_node0.sh",
        "start_node1.sh",
        "stop_node0.sh",
        "stop_node1.sh",
    ]
    for rank, node in [(0, "node0"), (1, "node0"), (2, "node0"), (3, "node1")]:
        script = out / f"rank{rank}_{node}.sh"
        text = script.read_text()
        assert os.access(script, os.X_OK)
        assert text.rstrip().endswith(
            f"exec hetero-launch {uneven_layout.resolve()} --rank {rank} --set train.steps=2 --quiet"
        )
        assert f"# rank {rank} of 4: {node}:" in text
        assert "MASTER_ADDR=${MASTER_ADDR:-10.1.2.3}" in text  # node0 is the master (first node)
        assert "MASTER_PORT=${MASTER_PORT:-29511}" in text
        assert "export CUDA_VISIBLE_DEVICES" not in text
    assert "rank0_node0.sh rank1_node0.sh rank2_node0.sh" in (out / "start_node0.sh").read_text()
    assert "rank3_node1.sh" in (out / "start_node1.sh").read_text()
    assert "rank0_node0.sh" not in (out / "start_node1.sh").read_text()
    assert not list(out.glob(".*.tmp"))  # atomic writes leave no temporaries behind


def test_generator_node_filter_rendezvous_and_launcher(uneven_layout, tmp_path):
    out = tmp_path / "out"
    result = _generate(
        uneven_layout,
        out,
        "--node",
        "node1",
        "--launcher",
        "python -m hetero_llm.cli",
        env={"MASTER_ADDR": "head.example", "MASTER_PORT": "29700"},
    )
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["rank3_node1.sh", "start_node1.sh", "stop_node1.sh"]
    text = (out / "rank3_node1.sh").read_text()
    assert "MASTER_ADDR=${MASTER_ADDR:-head.example}" in text and "MASTER_PORT=${MASTER_PORT:-29700}" in text
    assert f"exec python -m hetero_llm.cli {uneven_layout.resolve()} --rank 3\n" in text


def test_generator_dry_run_writes_nothing(uneven_layout, tmp_path):
    out = tmp_path / "out"
    result = _generate(uneven_layout, out, "--dry-run")
    assert result.exit_code == 0, result.output
    assert not out.exists()
    assert f"--- would write {out / 'rank3_node1.sh'}" in result.output
    assert "--rank 3" in result.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["--node", "node7"], "uneven.toml: --node: 'node7' is not a node of [cluster] (nodes: node0, node1)"),
        (["--set", "train.stpes=1"], "uneven.toml: --set train.stpes: unknown key 'stpes' (did you mean 'steps'?)"),
    ],
)
def test_generator_bad_input_exits_2(uneven_layout, tmp_path, args, message):
    result = _generate(uneven_layout, tmp_path / "out", *args)
    assert result.exit_code == 2
    assert message in result.output
    assert not (tmp_path / "out").exists()


def test_generated_scripts_are_valid_bash(uneven_layout, tmp_path):
    _generate(uneven_layout, tmp_path / "out")
    for script in sorted((tmp_path / "out").glob("*.sh")):
        subprocess.run(["bash", "-n", str(script)], check=True)


def test_generator_as_a_subprocess(uneven_layout, tmp_path):
    proc = subprocess.run(
        [sys.executable, str(LAUNCH / "gen_rank_scripts.py"), str(uneven_layout), "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env=_clean_env(),
    )
    assert proc.returncode == 0, proc.stderr
    assert "on node0:" in proc.stdout and (tmp_path / "out" / "start_node0.sh").is_file()


# ------------------------------------------------------------------------------------------
# start / stop scripts


@pytest.fixture
def bystander():
    """An unrelated process that no stop script may touch."""
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


def _untouched(proc: subprocess.Popen) -> bool:
    """``proc`` is running and no signal is pending for it: a signal a stop script sent before it exited shows
    here at once, before its target is scheduled to die (no wait for that)."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines())
    return proc.poll() is None and int(status["SigPnd"], 16) == int(status["ShdPnd"], 16) == 0


def _running(proc: subprocess.Popen, program: str) -> None:
    """Until ``proc`` runs ``program`` (it has exec'd it), at most a hang's while."""
    deadline = time.monotonic() + 60
    while Path(f"/proc/{proc.pid}/comm").read_text().strip() != program:
        assert proc.poll() is None and time.monotonic() < deadline, f"{proc.args} never ran {program}"
        time.sleep(0.01)


def test_start_then_stop_kills_exactly_the_started_ranks(uneven_layout, tmp_path, bystander):
    fake = tmp_path / "fake-launch"  # stands in for hetero-launch: records its arguments, then waits
    fake.write_text('#!/usr/bin/env bash\necho "$@" > "$(dirname "$0")/args.$3"\nexec sleep 60\n')
    fake.chmod(0o755)
    out = tmp_path / "out"
    assert _generate(uneven_layout, out, "--launcher", str(fake)).exit_code == 0
    proc = subprocess.run([str(out / "start_node0.sh")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in (out / "node0.pids").read_text().splitlines()]
    assert [r[1] for r in rows] == ["0", "1", "2"]
    pids = [int(r[0]) for r in rows]
    assert all(_alive(p) for p in pids)
    deadline = time.monotonic() + 10
    while len(list(tmp_path.glob("args.*"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (tmp_path / "args.1").read_text().split() == [str(uneven_layout.resolve()), "--rank", "1"]

    again = subprocess.run([str(out / "start_node0.sh")], capture_output=True, text=True, timeout=120)
    assert again.returncode == 1 and "still running; run stop_node0.sh first" in again.stderr

    proc = subprocess.run([str(out / "stop_node0.sh")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert all(_wait_dead(p) for p in pids)
    assert _untouched(bystander)
    assert not (out / "node0.pids").exists()


def test_stop_kills_only_its_pidfile(uneven_layout, tmp_path, bystander):
    _generate(uneven_layout, tmp_path / "out")
    target = subprocess.Popen(["sleep", "60"])
    (tmp_path / "out" / "node1.pids").write_text(f"{target.pid}\n")
    proc = subprocess.run([str(tmp_path / "out" / "stop_node1.sh")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert target.wait(timeout=60) == -signal.SIGTERM
    assert _untouched(bystander)


def test_stop_leaves_a_recycled_pid_alone(uneven_layout, tmp_path, bystander):
    """A pidfile PID whose start time differs is some other process now: not ours to kill."""
    _generate(uneven_layout, tmp_path / "out")
    (tmp_path / "out" / "node1.pids").write_text(f"{bystander.pid} 3 1\n")
    proc = subprocess.run([str(tmp_path / "out" / "stop_node1.sh")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "no process of" in proc.stdout
    assert _untouched(bystander)


def test_stop_escalates_to_sigkill(uneven_layout, tmp_path):
    _generate(uneven_layout, tmp_path / "out")
    stubborn = subprocess.Popen(["bash", "-c", "trap '' TERM; exec sleep 60"])  # sleep inherits the ignored TERM
    _running(stubborn, "sleep")  # the trap is set once bash has exec'd sleep
    (tmp_path / "out" / "node1.pids").write_text(f"{stubborn.pid}\n")
    proc = subprocess.run(
        [str(tmp_path / "out" / "stop_node1.sh")],
        capture_output=True,
        text=True,
        timeout=30,
        env=_clean_env(STOP_GRACE_S="1"),
    )
    assert proc.returncode == 0, proc.stderr
    assert "sent SIGKILL" in proc.stdout
    assert stubborn.wait(timeout=60) == -signal.SIGKILL


# ------------------------------------------------------------------------------------------
# run_node.sh


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["layouts/reference/reference.toml"],
        ["layouts/reference/reference.toml", ""],
        ["layouts/reference/reference.toml", "--quiet"],
        ["no/such.toml", "node0"],
    ],
)
def test_run_node_usage_errors_exit_2(args):
    proc = subprocess.run([str(RUN_NODE), *args], capture_output=True, text=True, cwd=ROOT, env=_clean_env())
    assert proc.returncode == 2
    assert "usage: run_node.sh LAYOUT.toml NODE" in proc.stderr or "no such layout file" in proc.stderr


def test_run_node_rejects_a_bad_master_port():
    proc = subprocess.run(
        [str(RUN_NODE), "layouts/reference/reference.toml", "node0"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_clean_env(MASTER_PORT="http"),
    )
    assert proc.returncode == 2 and "MASTER_PORT must be a TCP port" in proc.stderr


def test_run_node_sets_the_environment_and_passes_arguments(tmp_path):
    fake = tmp_path / "fake-launch"
    fake.write_text(
        '#!/usr/bin/env bash\necho "args: $*"\n'
        'echo "env: $MASTER_ADDR $MASTER_PORT $OMP_NUM_THREADS $TORCH_NCCL_ASYNC_ERROR_HANDLING"\n'
    )
    fake.chmod(0o755)
    proc = subprocess.run(
        [str(RUN_NODE), "layouts/examples/two_pipelines.toml", "node0", "--quiet"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_clean_env(HETERO_LAUNCH=str(fake), MASTER_ADDR="10.9.9.9", MASTER_PORT="29600"),
    )
    assert proc.returncode == 0, proc.stderr
    assert "args: layouts/examples/two_pipelines.toml --node node0 --quiet" in proc.stdout
    threads = max(1, len(os.sched_getaffinity(0)) // 3)  # node0 has 3 ranks; nproc counts the same cores
    assert f"env: 10.9.9.9 29600 {threads} 1" in proc.stdout


def test_run_node_unknown_node_is_hetero_launchs_error():
    proc = subprocess.run(
        [str(RUN_NODE), "layouts/reference/reference.toml", "node9", "--quiet"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_clean_env(),
    )
    assert proc.returncode == 2
    assert "--node: 'node9' is not a node of [cluster] (nodes: node0)" in proc.stderr


@pytest.mark.multiprocess
def test_run_node_trains_a_real_layout():
    """The one real run here: the reference layout's single rank, one step."""
    proc = subprocess.run(
        [
            str(RUN_NODE),
            "layouts/reference/reference.toml",
            "node0",
            "--set",
            "train.steps=1",
            "--set",
            f"cluster.port={free_port()}",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_clean_env(),
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr


# ------------------------------------------------------------------------------------------
# shell syntax, SLURM example


@pytest.mark.parametrize("script", sorted(LAUNCH.glob("*.sh")) + [SBATCH], ids=lambda p: p.name)
def test_shell_syntax(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    assert os.access(script, os.X_OK) or script.suffix == ".sbatch"


@pytest.fixture
def fake_slurm(tmp_path: Path) -> dict[str, str]:
    """scontrol and srun stand-ins. srun logs its arguments and the hostfile; exits $FAIL if set; with $RUN
    set, runs its command once per task here, each with SLURM_PROCID / SLURM_NTASKS / SLURM_STEP_ID."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(
        '#!/usr/bin/env bash\n[[ $1 == show && $2 == hostnames ]] && tr , "\\n" <<<"$3"\n'
    )
    (bin_dir / "srun").write_text(
        '#!/usr/bin/env bash\necho "$* @$MASTER_PORT" >> "$SRUN_LOG"\ncp "$SLURM_HOSTFILE" "$SRUN_LOG.hosts"\n'
        '[[ -n ${FAIL:-} ]] && exit "$FAIL"\n[[ -z ${RUN:-} ]] && exit 0\n'
        "while [[ $1 == --* ]]; do [[ $1 == --ntasks=* ]] && n=${1#--ntasks=}; shift; done\n"
        'pids=(); for ((i = 0; i < n; i++)); do SLURM_PROCID=$i SLURM_NTASKS=$n SLURM_STEP_ID=0 "$@" & pids+=($!); done\n'
        'status=0; for p in "${pids[@]}"; do wait "$p" || status=$?; done; exit "$status"\n'
    )
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return _clean_env(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        SRUN_LOG=str(tmp_path / "srun.log"),
        PYTHON=sys.executable,
        HETERO_LAUNCH=f"{sys.executable} -m hetero_llm.cli",
    )


def test_sbatch_places_each_rank_on_its_node(uneven_layout, fake_slurm):
    env = dict(fake_slurm, SLURM_JOB_NODELIST="gpu-a,gpu-b", SLURM_JOB_ID="123", SLURM_CPUS_PER_TASK="6")
    proc = subprocess.run(
        ["bash", str(SBATCH), str(uneven_layout), "--quiet"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert Path(env["SRUN_LOG"]).read_text().splitlines() == [
        f"--ntasks=4 --distribution=arbitrary --kill-on-bad-exit=1 {sys.executable} -m hetero_llm.cli {uneven_layout} "
        '--set cluster.nodes[0].host="gpu-a" --set cluster.nodes[1].host="gpu-b" --quiet @20123'
    ]
    # ranks 0-2 on node0 (TP 1 then TP 2), rank 3 on node1
    assert Path(env["SRUN_LOG"] + ".hosts").read_text().split() == ["gpu-a", "gpu-a", "gpu-a", "gpu-b"]
    assert not list(Path(os.environ.get("TMPDIR", "/tmp")).glob("hetero-llm-hosts.*"))  # hostfile removed


def test_sbatch_trains_with_ranks_from_slurm_variables(fake_slurm, tmp_path):
    """Two hosts (127.0.0.1 and 127.0.0.2, both this machine), one task per rank, each rank from SLURM_PROCID."""
    layout = rank0_off_master_layout(tmp_path / "two.toml")  # rank 0 on node1, rank 1 on node0
    metrics = tmp_path / "m.jsonl"
    env = dict(fake_slurm, SLURM_JOB_NODELIST="127.0.0.1,127.0.0.2", RUN="1", MASTER_PORT=str(free_port()))
    proc = subprocess.run(
        ["bash", str(SBATCH), str(layout), "--quiet", "--metrics-jsonl", str(metrics)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert Path(env["SRUN_LOG"] + ".hosts").read_text().split() == ["127.0.0.2", "127.0.0.1"]
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3]


def test_sbatch_exits_with_the_failed_steps_status(uneven_layout, fake_slurm):
    proc = subprocess.run(
        ["bash", str(SBATCH), str(uneven_layout)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(fake_slurm, SLURM_JOB_NODELIST="gpu-a,gpu-b", FAIL="3"),
        timeout=60,
    )
    assert proc.returncode == 3


def test_sbatch_node_count_mismatch_exits_2(uneven_layout, fake_slurm):
    proc = subprocess.run(
        ["bash", str(SBATCH), str(uneven_layout)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(fake_slurm, SLURM_JOB_NODELIST="gpu-a"),
        timeout=60,
    )
    assert proc.returncode == 2
    assert "declares 2 node(s) but the job has 1 host(s) (gpu-a); make #SBATCH --nodes match" in proc.stderr


# ------------------------------------------------------------------------------------------
# HexiScale layouts: the TP sizes, layer partitions, batches and chunks docs/hexiscale.md shows


HEXISCALE = {
    "hexiscale_1_2_1": ([[1, 2, 1]], [[2, 4, 2]], [8], [4]),
    "hexiscale_two_pipelines": ([[1, 2, 1], [2, 2]], [[2, 4, 2], [5, 3]], [6, 2], [3, 2]),
    "hexiscale_three_pipelines": ([[4], [2, 2], [1, 1, 1, 1]], [[8], [5, 3], [2, 2, 2, 2]], [4, 2, 2], [2, 2, 2]),
}


@pytest.mark.parametrize("name", sorted(HEXISCALE))
def test_hexiscale_layouts_match_their_flags(name):
    lay = layout_mod.load(ROOT / "layouts" / "papers" / f"{name}.toml")
    hetero_configs, layer_partitions, global_bsz_size, chunks = HEXISCALE[name]
    assert [[s.tp for s in p.stages] for p in lay.pipelines] == hetero_configs
    assert [[s.layers for s in p.stages] for p in lay.pipelines] == layer_partitions
    assert [p.batch for p in lay.pipelines] == global_bsz_size
    assert [p.microbatches for p in lay.pipelines] == chunks
    ref = layout_mod.load(ROOT / "layouts" / "reference" / "hexiscale.toml")
    assert (lay.model, lay.data, lay.train) == (ref.model, ref.data, ref.train)
    assert [p.stages[0].tp for p in ref.pipelines] == [1] and len(ref.pipelines[0].stages) == 1


def test_hexiscale_layouts_use_uneven_nodes():
    for name in ("hexiscale_two_pipelines", "hexiscale_three_pipelines"):
        lay = layout_mod.load(ROOT / "layouts" / "papers" / f"{name}.toml")
        assert len({len(n.devices) for n in lay.cluster.nodes}) > 1, name


def test_docs_mention_every_launch_file():
    text = (ROOT / "docs" / "launch.md").read_text()
    for name in ("run_node.sh", "gen_rank_scripts.py", "slurm_example.sbatch"):
        assert name in text
