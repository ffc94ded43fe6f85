"""The planner's benchmarks and the layouts benchmarks write (bench/published.py, plan_meter, plan_split_gap,
context_speed): --quick runs end to end, and every generated layout loads back to what it was built from.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers_bench import _headers, _run

from bench.common import benchlib
from bench.hot_switch import hot_switch_config as hot

ROOT = Path(__file__).resolve().parents[2]


def test_bench_layouts_load_back_to_what_they_were_built_from(tmp_path):
    """Every layout and cluster file the benches write, built as schema objects, is one the loader accepts (it
    checks them as it checks a user's file) and reloads to those objects; the GPU bench's CUDA and NCCL layouts
    and the full-size configurations too, which no CPU test run writes."""
    import attrs

    from bench.comm import holmes_bench
    from bench.gpu import gpu_bench_cases
    from bench.launch import control_plane, launch_time
    from bench.memory import plan_memory, soak, zero1_memory
    from bench.planner import plan_bench, plan_vs_measured
    from hetero_llm import layout
    from hetero_llm.planner.cluster import load_cluster

    def reloads(made: layout.Layout) -> None:
        path = tmp_path / "made.toml"
        layout.dump(made, path)
        assert layout.load(path) == attrs.evolve(made, file=str(path))

    reloads(launch_time.launch_layout("x.toml"))
    reloads(control_plane.scale_layout("x.toml", 64))
    reloads(soak.soak_layout("x.toml", 10_050))
    for _, pipelines in zero1_memory.LAYOUTS:
        for optimizer in zero1_memory.OPTIMIZERS:
            reloads(zero1_memory.optimizer_layout("x.toml", pipelines, 512, 4, 3, optimizer))
    sections = plan_memory.cluster_sections(512, 1376, 4, 128, 8, 2)
    for schedule, chunks in plan_memory.SCHEDULES:
        reloads(plan_memory.schedule_layout(sections, "x.toml", schedule, chunks, 4, 8))
    for cfg in (hot.Config(), hot.QUICK, attrs.evolve(hot.Config(), network="testbed")):
        for mode in ("static", "top-up", "elastic", "fixed"):
            reloads(hot.switch_layout(cfg, mode, (2, 3)))
        reloads(hot.recompute_layout(cfg))

    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(bytes(range(256)) * 16)
    texts = [
        benchlib.layout_toml(benchlib.ModelConfig(), [4, 4], 4, "interleaved", chunks=2),
        benchlib.layout_toml(benchlib.ModelConfig(), [8], 1, "zbh1"),
    ]
    case = gpu_bench_cases.Case(gpu_bench_cases.SIZES["124m"], 1024, 16)
    for devices, kw in (
        (["cuda:0"], {"backend": "nccl", "compile_mode": "blocks"}),
        (["cuda:0"] * 2, {"stages": 2, "microbatches": 4}),
        (["cuda:0"] * 2, {}),
    ):
        texts.append(gpu_bench_cases.layout_toml(case, devices=devices, steps=20, corpus=corpus, **kw))
    for text in texts:
        (tmp_path / "text.toml").write_text(text)
        layout.load(tmp_path / "text.toml")

    holmes = tmp_path / "holmes.toml"
    holmes.write_text(
        holmes_bench.cluster_file(
            hidden=512,
            layers=4,
            heads=8,
            seq_len=32,
            batch=4,
            steps=8,
            domain_gbps=1.0,
            domain_us=100.0,
            cross_gbps=0.1,
            cross_us=1000.0,
        )
    )
    _, _, holmes_sections = layout.read_cluster_file(holmes, "the test")
    naive = layout.load(holmes_bench.naive_layout(holmes, tmp_path / "naive.toml", 2))
    assert attrs.evolve(naive, pipelines=()) == layout.Layout(file=naive.file, pipelines=(), **holmes_sections)
    domain = {n.name: n.domain for n in naive.cluster.nodes}  # one pipeline per domain
    assert [{domain[d.split(":")[0]] for s in p.stages for d in s.devices} for p in naive.pipelines] == [
        {"ib"},
        {"roce"},
    ]
    for text in (
        plan_bench.large_cluster(1024, 0, 2500, 30.0),
        plan_bench._draw_small(901),
        layout.dumps_cluster(sections),
        plan_vs_measured.cluster_text(6, testbed=True, action_us=812.5, p2p_us=61.25),
    ):
        path = tmp_path / "cluster.toml"
        path.write_text(text)
        load_cluster(path)


def test_published_quick(tmp_path):
    """``bench.planner.published --quick``: a table row per published number; the Megatron 1.7B row's FLOPs redone by hand
    from the paper's formula and its step time, which is ``hetero-plan --evaluate``'s for the committed files; and
    the cluster files and layouts it writes are the committed ones."""
    from click.testing import CliRunner

    from hetero_llm.cli.plan import main as plan_main

    files = tmp_path / "files"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.planner.published", "--quick", "--budget", "1", "--out-dir", str(tmp_path)]
        + ["--files-dir", str(files)],
        capture_output=True,
        text=True,
        timeout=300,
        env=benchlib.clean_env(),
        cwd=ROOT,
    )
    assert proc.returncode == 0, f"published --quick failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    md = (tmp_path / "published.md").read_text()
    for table in (
        ["row", "GPUs", "metric", "published", "predicted", "predicted/published", "within 15%"],
        ["cluster", "published layout", "its step s", "pick's step s", "pick/published", "planner's pick", "plan s"],
    ):
        assert table in _headers(md)
    payload = json.loads((tmp_path / "published.json").read_text())
    rows = {r["row"]: r for r in payload["results"]}
    assert set(rows) == {
        "megatron_1.7b",
        "h100_gpt_1.3b_eager",
        "h100_gpt_1.3b_compiled",
        "h100_gpt_124m_eager",
        "h100_gpt_124m_compiled",
        "holmes_nic_aware",
        "holmes_default",
    }
    for r in rows.values():  # each row in the printed table, with its ratio
        assert f"| {r['row']} " in md and f"| {r['ratio']:.2f} " in md
        assert r["ratio"] == pytest.approx(r["predicted"] / r["published"], rel=1e-12)

    r = rows["megatron_1.7b"]
    assert (r["gpus"], r["published"]) == (32, 137.0)
    B, s, l, h, V = 512, 2048, 24, 2304, 51200  # global batch, sequence, layers, hidden, vocabulary
    flops = 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))
    assert r["published_flops_per_step"] == pytest.approx(flops, rel=1e-12)
    assert r["predicted"] == pytest.approx(flops / r["step_time_s"] / 32 / 1e12, rel=1e-12)
    cli = CliRunner().invoke(plan_main, [str(ROOT / r["cluster"]), "--evaluate", str(ROOT / r["layout"]), "--json"])
    assert cli.exit_code == 0, cli.output
    assert json.loads(cli.output)["step_time"] == pytest.approx(r["step_time_s"], rel=1e-12)

    written = sorted(p.relative_to(files) for p in files.rglob("*.toml"))
    # Megatron 1.7B's cluster and layout; each H100 row's eager and compiled clusters and its layout; Holmes' and
    # Megatron-LM's clusters and layouts on Holmes' nodes
    assert len(written) == 2 + 2 * 3 + 2 * 2
    for rel in written:
        assert (files / rel).read_text() == (ROOT / rel).read_text(), f"{rel}: rerun python -m bench.planner.published"
    assert {p["cluster"] for p in payload["picks"]} == {rows[n]["cluster"] for n in rows}


@pytest.mark.multiprocess
def test_plan_meter_quick(tmp_path):
    """The planner's pick for small_cpu.toml trained with the tensor meter: every rank's measured peak within 10% of
    the memory model's bytes for its stage, and not above them (the model must not say a layout fits when the
    tensors it holds do not)."""
    _run("memory.plan_meter", tmp_path)
    payload = json.loads((tmp_path / "plan_meter.json").read_text())
    assert len(payload["results"]) == 4  # one a rank
    for row in payload["results"]:
        assert 0.9 <= row["ratio"] <= 1.0, row
    assert "load average" in (tmp_path / "plan_meter.md").read_text()


def test_plan_split_gap_quick(tmp_path):
    """The gaps the sub-solvers leave: the plan's predicted step over a descent's, never below 1 (the descent keeps
    only shorter steps), with the splits and rows it found."""
    _run("planner.plan_split_gap", tmp_path)
    payload = json.loads((tmp_path / "plan_split_gap.json").read_text())
    assert len(payload["results"]) == 4  # the two CPU clusters and two generated ones
    for row in payload["results"]:
        assert row["split_gap"] >= 1 and row["rows_gap"] >= 1
        assert [sum(p) for p in row["better_splits"]] == [sum(p) for p in row["planned_splits"]]
    assert "Layer split minimising the step" in (tmp_path / "plan_split_gap.md").read_text()


def test_context_speed_layouts_match_their_cluster_files(tmp_path):
    """bench.context.context_speed's cp 1 and cp 2 layouts load, and ``hetero-plan --evaluate`` prices them on its cluster
    file's emulated device: the same model and rows, cp 2's step about half cp 1's (every rank's work 1/cp)."""
    from bench.context import context_speed
    from hetero_llm import layout

    steps = {}
    for cp in (1, 2):
        lay, cluster = context_speed.texts(cp, 256, 3, 4, 2, gflops=1.0)
        assert [s.cp for s in layout.loads(lay).pipelines[0].stages] == [cp]
        (tmp_path / f"l{cp}.toml").write_text(lay)
        (tmp_path / f"c{cp}.toml").write_text(cluster)
        steps[cp] = context_speed.predicted(tmp_path / f"c{cp}.toml", tmp_path / f"l{cp}.toml")["step_time"]
    assert 0.45 < steps[2] / steps[1] < 0.55
