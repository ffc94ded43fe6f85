"""The public API: what ``hetero-launch``, ``hetero-plan`` and ``hetero-sweep`` do, as functions (docs/api.md).

Load a layout or a cluster file (with ``--set`` overrides), compile its plan, predict it with the planner's cost
model, plan a cluster, run a layout to completion in child processes, read a checkpoint. Every result is a frozen
attrs record; nothing is kept between calls; bad input raises the one-line ``LayoutError`` the command lines print.
Torch-free: a run starts ``hetero-launch`` as a subprocess, and only ``load_params`` imports torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from hetero_llm import layout as layout_mod
from hetero_llm.checkpoint import folders
from hetero_llm.errors import LayoutError, RankFailure
from hetero_llm.layout import Layout
from hetero_llm.layout import reader as layout_reader
from hetero_llm.plan import Plan as Plan  # re-exported: hetero_llm.Plan
from hetero_llm.plan import compile_plan as compile_plan
from hetero_llm.planner import evaluate as pricing
from hetero_llm.planner import profile as profiling
from hetero_llm.planner.cluster import Cluster
from hetero_llm.planner.cluster import load_cluster as _load_cluster

# hetero_llm.__all__ lists the public names (re-exported from here); tests/unit/test_api.py checks the two agree
Checkpoint = folders.Checkpoint
WARMUP_STEPS = 1  # a run's first step (process start, allocation) is left out of its step times when it has more


def load(path: str | os.PathLike, overrides: Sequence[str] = ()) -> Layout:
    """A layout file, each ``overrides`` item applied as ``hetero-launch --set`` applies it, validated."""
    return layout_mod.load(path, tuple(overrides))


def loads(
    text: str, overrides: Sequence[str] = (), file: str = "<string>", base_dir: str | os.PathLike = "."
) -> Layout:
    """A layout from TOML text (relative paths in it taken from ``base_dir``), overridden and validated."""
    raw = layout_reader.parse(text, file)
    for item in overrides:
        layout_reader.apply_override(raw, item, file)
    return layout_mod.from_dict(raw, file, Path(base_dir))


def load_cluster(path: str | os.PathLike, profile_file: str | os.PathLike | None = None) -> Cluster:
    """A planner cluster file (a layout without ``[[pipelines]]``, plus ``[plan]``), checked."""
    return _load_cluster(path, profile_file)


def validate(layout: Layout) -> Layout:
    """Every rule of a layout (one built or changed in code: ``attrs.evolve``); returns it, or raises."""
    layout_mod.validate(layout)
    return layout


def layout_hash(layout: Layout) -> str:
    """A short digest of the layout as its TOML writer writes it: equal layouts, equal hashes, wherever loaded."""
    return hashlib.sha256(layout_mod.dumps(attrs.evolve(layout, file="")).encode()).hexdigest()[:16]


@attrs.frozen
class Prediction:
    """What the planner's cost model predicts for a layout (``hetero-plan --evaluate``), not measured."""

    fits: bool  # every rank's memory within its device's usable memory
    step_time_s: float  # inf when a stage does not fit
    tokens_per_s: float
    bubble: float  # idle fraction of the slowest pipeline's stages
    mfu: float
    memory_gb: tuple[float, ...]  # peak per rank (rank order: pipelines, their stages, their devices)
    capacity_gb: tuple[float, ...]  # usable memory per rank

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self) | {"step_time_s": self.step_time_s if self.fits else None}


def evaluate(layout: Layout, cluster: Cluster | str | os.PathLike | None = None) -> Prediction:
    """The cost model's prediction for ``layout``, on ``cluster``'s device kinds and network (a cluster file's, e.g.
    the one a planned layout came from) or, without one, on the layout's own CPU nodes."""
    if cluster is not None and not isinstance(cluster, Cluster):
        cluster = _load_cluster(cluster)
    ev = pricing.evaluate(pricing.cluster_for(layout, cluster), layout, layout.file)
    s = ev.score
    per_rank = [
        (s.memory[p][i] / 1e9, s.capacity[p][i] / 1e9)
        for p, pipe in enumerate(layout.pipelines)
        for i, stage in enumerate(pipe.stages)
        for _ in stage.devices
    ]
    return Prediction(
        s.feasible,
        s.step_time,
        s.tokens_per_s if s.feasible else 0.0,
        s.bubble,
        s.mfu if s.feasible else 0.0,
        tuple(m for m, _ in per_rank),
        tuple(c for _, c in per_rank),
    )


@attrs.frozen
class Planned:
    """What ``hetero-plan CLUSTER`` found: the search's result, the cluster as the best plan runs it, the devices
    it leaves idle, the hot-switching verdict (with ``buckets``) and the layout file written (or None)."""

    cluster: Cluster
    result: Any  # planner.search.Result: best, score, ranked, evaluated, seconds, seed_score, cut_by_time
    idle: tuple[tuple[str, str], ...]  # (device, why it is left idle)
    verdict: Any = None  # switching.worth.Verdict with buckets, else None
    out: str | None = None

    @property
    def layout(self) -> Layout:
        """The best plan as the layout it is written as (without the buckets)."""
        from hetero_llm.planner import output

        return output.planned_layout(self.cluster, self.result.best)

    def to_json(self) -> dict[str, Any]:
        """The ranked plans, the idle devices, the search's counts and the buckets' verdict, as ``hetero-plan
        --json`` prints them."""
        from hetero_llm.planner import output

        result, verdict = self.result, self.verdict
        return {
            "plans": [output.to_json(c, s) for c, s in result.ranked],
            "idle": [{"device": d, "reason": why} for d, why in self.idle],
            "evaluated": result.evaluated,
            "seconds": result.seconds,
            "cut_by_time": result.cut_by_time,
            "seed_step_time": result.seed_score.step_time if result.seed_score else None,
            "written": self.out,
            "buckets": verdict.to_json() if verdict is not None else None,
        }


def plan_cluster(
    cluster_file: str | os.PathLike,
    out: str | os.PathLike | None = None,
    *,
    top: int = 3,
    buckets: str = "",
    profile_file: str | os.PathLike | None = None,
    progress: bool = False,
) -> Planned:
    """``hetero-plan CLUSTER [-o OUT]``: search the cluster's layouts for the fastest under the cost model; write
    the best as ``out`` (checked as the layout it would be either way). ``buckets`` ("128,512"): also plan hot
    switching's buckets and keep them when whole steps are faster (switching/propose.py, switching/worth.py)."""
    from hetero_llm.launch import outputs
    from hetero_llm.planner import output, planned_cluster
    from hetero_llm.planner import plan_cluster as search
    from hetero_llm.planner.cluster import check_devices

    cluster_file = str(cluster_file)
    out = None if out is None else str(out)
    profile_file = None if profile_file is None else str(profile_file)
    if top < 1:
        raise LayoutError(cluster_file, "--top", f"must be >= 1, got {top}")
    cluster = _load_cluster(cluster_file, profile_file)
    check_devices(cluster)  # what the layout's validation would refuse after the search
    if out is not None:  # before the search
        outputs.check_output_file("--out", out, outputs.cluster_inputs(cluster, profile_file))
        output.check_out_path(cluster, out)
    bounds = None
    if buckets:
        from hetero_llm.switching import propose

        bounds = propose.parse_bounds(buckets, cluster)  # bad bounds: before the search
    result = search(cluster, top, progress=progress)
    cluster = planned_cluster(cluster, result.best)  # with the plan's train.optimizer
    planned: tuple[Any, ...] = ()
    verdict = None
    if bounds:
        from hetero_llm.switching import propose, worth

        # each bucket's plan, then whole steps priced (switches, memory held) against the best static plan
        verdict = worth.judge(cluster, result.best, result.score, propose.propose(cluster, bounds, result.best))
        planned = verdict.buckets if verdict.switching else ()
    if out is not None:
        output.write_layout(cluster, out, result.best, result.score, result.seed_score, planned, result.cut_by_time)
    else:  # nothing written, but the plan is checked as the layout it would be
        output.check_layout(cluster, result.best, result.score, result.seed_score, planned)
    return Planned(cluster, result, tuple(output.idle_devices(cluster, result.best)), verdict, out)


@attrs.frozen
class Profiled:
    """What ``hetero-plan CLUSTER --profile OUT`` measured on this machine, written into ``out``."""

    kind: str  # the device kind the times are recorded under
    out: str
    times: Any  # planner.profile.KindTimes: one layer's and the head's forward and backward, per sequence
    info: Mapping[str, Any]  # the device, its threads, the repeats and each time's measurements
    noisiest: tuple[str, float, Sequence[float]]  # the time whose repeats varied most: its name, spread, min/median/max


def profile_cluster(
    cluster_file: str | os.PathLike,
    out: str | os.PathLike,
    kind: str | None = None,
    device: str | None = None,
    max_spread: float = profiling.MAX_SPREAD,
) -> Profiled:
    """``hetero-plan CLUSTER --profile OUT``: time one layer and the head at the cluster's model shapes on
    ``device`` (default: cuda when torch sees one, else cpu) and write (or add to) the profile ``out`` under
    ``kind`` (default: the one kind of the cluster's nodes on that device), unless the repeats vary more than
    ``max_spread`` ((max - min) / median). Never over a file the cluster file reads. Needs torch."""
    from hetero_llm.launch import outputs

    cluster_file, out = str(cluster_file), str(out)
    # what the cluster file reads is never written over (plan.profile is what --profile adds to)
    outputs.check_output_file("--profile", out, outputs.cluster_inputs(_load_cluster(cluster_file), plan_profile=False))
    if not max_spread >= 0:
        raise LayoutError(cluster_file, "--max-spread", f"must be >= 0, got {max_spread:g}")
    cluster = _load_cluster(cluster_file)
    if device is None or device.startswith("cuda"):
        torch = _torch(cluster_file)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise LayoutError(cluster_file, "--device", f"cannot time on '{device}': torch sees no CUDA device")
    kind = _profile_kind(cluster, cluster_file, device.split(":")[0], kind)
    previous = None
    if Path(out).exists():
        try:
            previous = json.loads(Path(out).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise LayoutError(
                cluster_file, "--profile", f"'{out}' exists and is not a profile ({e}); remove it or name another file"
            ) from None
    _torch(cluster_file)
    try:
        times, info = profiling.measure(cluster.model, cluster.train.precision, device)
    except RuntimeError as e:  # an unknown device string, a device torch cannot use
        raise LayoutError(cluster_file, "--device", f"cannot time on '{device}': {e}") from None
    name, spread, (lo, mid, hi) = profiling.noisiest(info)
    if spread > max_spread:
        raise LayoutError(
            cluster_file,
            "--profile",
            f"the measurement is noisy: {name} ranged {lo * 1e3:.3g} / {mid * 1e3:.3g} / {hi * 1e3:.3g} ms "
            f"(min / median / max of {info['repeats']} repeats), a spread of {spread:.0%}, over --max-spread "
            f"{max_spread:.0%}; nothing written (rerun on an idle machine)",
        )
    profiling.write(out, cluster.model, cluster.train.precision, kind, times, info, previous)
    return Profiled(kind, out, times, info, (name, spread, (lo, mid, hi)))


def _profile_kind(cluster: Cluster, cluster_file: str, dev_type: str, kind: str | None) -> str:
    """The device kind a profile's times are recorded under: ``kind``, a kind of the cluster's nodes; by default
    the one kind of the nodes whose devices are all of type ``dev_type``."""
    known = sorted({n.kind.name for n in cluster.nodes})
    if kind is None:
        on_device = sorted(
            {
                n.kind.name
                for n, spec in zip(cluster.nodes, cluster.spec.nodes)
                if all(d.split(":")[0] == dev_type for d in spec.devices)
            }
        )
        if len(on_device) != 1:
            raise LayoutError(
                cluster_file,
                "--kind",
                f"name the device kind to record the times under (nodes on "
                f"'{dev_type}' have kinds {on_device or 'none'}; the cluster's kinds: {', '.join(known)})",
            )
        return on_device[0]
    if kind not in known:
        raise LayoutError(
            cluster_file, "--kind", f"no node of the cluster has kind {kind!r} (kinds: {', '.join(known)})"
        )
    return kind


def _torch(cluster_file: str):
    try:
        import torch
    except ImportError:
        raise LayoutError(
            cluster_file, "--profile", "needs torch to measure (pip install torch); reading a profile does not"
        ) from None
    return torch


@attrs.frozen
class RunResult:
    """One ``hetero-launch`` run to its end: its per-step metrics (the ``--metrics-jsonl`` records) and figures."""

    status: str  # "ok", "failed" (a nonzero exit) or "timeout"
    exit_code: int | None  # None when stopped at the timeout
    error: str  # the run's last "error: ..." line ("" when it succeeded)
    steps: tuple[Mapping[str, Any], ...]  # step, loss, lr, grad_norm, tokens, seconds (valid_loss where evaluated)
    workdir: str  # metrics.jsonl, stdout.txt, stderr.txt (and the checkpoint when asked)
    wall_s: float
    peak_rss_gb: float | None  # the largest resident memory of any of the run's processes (a rank, on CPU)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def _seconds(self) -> list[float]:
        s = [float(r["seconds"]) for r in self.steps]
        return s[WARMUP_STEPS:] if len(s) > WARMUP_STEPS else s

    @property
    def step_time_s(self) -> float | None:
        """Median step time, the first step left out when there are more."""
        return statistics.median(self._seconds()) if self.steps else None

    @property
    def step_time_p90_s(self) -> float | None:
        s = sorted(self._seconds())
        return s[min(len(s) - 1, int(0.9 * len(s)))] if s else None

    @property
    def tokens_per_s(self) -> float | None:
        t = self.step_time_s
        return float(self.steps[-1]["tokens"]) / t if t else None

    @property
    def final_loss(self) -> float | None:
        return float(self.steps[-1]["loss"]) if self.steps else None

    @property
    def valid_loss(self) -> float | None:
        """The last held-out loss the run measured (train.eval_every), or None."""
        held = [r["valid_loss"] for r in self.steps if "valid_loss" in r]
        return float(held[-1]) if held else None

    def check(self) -> RunResult:
        """This result when the run succeeded, else ``RankFailure`` with its error line and exit code."""
        if not self.ok:
            failure = RankFailure(self.error or f"hetero-launch ended with status {self.status} ({self.exit_code})")
            failure.exit_code = self.exit_code if self.exit_code is not None else 124
            raise failure
        return self


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# variables that would make the launcher a rank of someone else's job (torchrun's, srun's) or meet at their port
_FOREIGN = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_LOCALID")


def run(
    layout_file: str | os.PathLike,
    workdir: str | os.PathLike,
    overrides: Sequence[str] = (),
    *,
    timeout_s: float = 600.0,
    env: Mapping[str, str] | None = None,
    args: Sequence[str] = (),
) -> RunResult:
    """``hetero-launch LAYOUT --set ... --quiet --metrics-jsonl WORKDIR/metrics.jsonl`` to its end, on a port of its
    own, in a process group stopped whole at ``timeout_s``. ``args``: more hetero-launch options (``--checkpoint
    DIR``). A bad layout is raised (``LayoutError``) before anything starts; a failing run is returned (``status``)."""
    from hetero_llm.launch.node import _die_with_parent

    load(layout_file, overrides)  # the one-line error here, not a child's exit code
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    metrics = work / "metrics.jsonl"
    metrics.unlink(missing_ok=True)  # a rerun's rows only
    cmd = [sys.executable, "-m", "hetero_llm.cli", str(Path(layout_file).resolve()), "--quiet"]
    cmd += ["--metrics-jsonl", str(metrics.resolve()), *args]
    for item in (*overrides, f"cluster.port={_free_port()}"):
        cmd += ["--set", item]
    child_env = {k: v for k, v in os.environ.items() if k not in _FOREIGN} | dict(env or {})
    start = time.monotonic()
    with open(work / "stdout.txt", "wb") as out, open(work / "stderr.txt", "wb") as err:
        # its own process group (the timeout stops it whole), and it dies with this process (a killed sweep
        # leaves no launch running: the launcher's ranks die with the launcher)
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=err, env=child_env, start_new_session=True, preexec_fn=_die_with_parent
        )
        code, peak = _wait(proc, timeout_s)
    wall = time.monotonic() - start
    errors = [ln for ln in (work / "stderr.txt").read_text(errors="replace").splitlines() if ln.startswith("error:")]
    if code is None:
        status, error = "timeout", f"error: stopped after the timeout of {timeout_s:g} s"
    else:
        status, error = ("ok", "") if code == 0 else ("failed", errors[-1] if errors else f"error: exit code {code}")
    rows = metrics.read_text().splitlines() if metrics.exists() else []
    steps = tuple(json.loads(line) for line in rows if line.strip())
    return RunResult(status, code, error, steps, str(work), wall, peak)


def _wait(proc: subprocess.Popen, timeout_s: float) -> tuple[int | None, float | None]:
    """The exit code (None: killed at the timeout, with its whole process group) and the peak resident memory
    of the launcher and the ranks it waited for, in GB (Linux reports the largest single process)."""
    deadline = time.monotonic() + timeout_s
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, usage.ru_maxrss * 1024 / 1e9
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None, None
        time.sleep(0.05)  # polling a child: no decision depends on it but the timeout's


def read_checkpoint(path: str | os.PathLike, verify: bool = False) -> Checkpoint:
    """The complete save ``path`` names (a ``--checkpoint DIR``: its newest; or a step folder): its step, world size,
    parameter shapes and files. ``verify``: also check every rank file's size and sha256 (``CheckpointError`` if one
    differs from what the save recorded)."""
    ckpt = folders.find(path)
    if verify:
        folders.verify(ckpt, progress=False)
    return ckpt


def load_params(path: str | os.PathLike) -> dict[str, Any]:
    """Every parameter of a save as one full tensor per global name, whatever layout saved it (imports torch)."""
    from hetero_llm.checkpoint import shards

    return shards.load_full_params(str(path))
