"""The planner's predicted step times against runs with emulated device speeds on the emulated network.

    sudo python -m bench.planner.plan_vs_measured             # 10 ranked plans of a 4-slot, 2-domain cluster on the testbed
    python -m bench.planner.plan_vs_measured --loopback       # the same plans over loopback (fast links declared)
    python -m bench.planner.plan_vs_measured --quick          # 2 plans, 2 steps, loopback, devices 4x faster (the test suite)
    sudo python -m bench.planner.plan_vs_measured --trace DIR # also trace every run and break each step down as the model
                                                      # prices it (bench/planner/plan_breakdown.py: more tables, 'breakdown')
    sudo python -m bench.planner.plan_vs_measured --constants-from OLD.json --ranks 1,37 --trace DIR   # two plans again

**Network.** By default every node of the cluster file runs in its own network namespace of the testbed
(``bench/testbed/``, through ``holmes_bench.run_layout``): each domain's fabric and the cross-domain
fabric have the bandwidth and latency the cluster file declares (``tc`` shaping), and the cluster
puts its two fast devices in one domain and the two slow ones in another behind a slow link, so
plans that cross it often (data parallelism across the domains, several boundaries across) pay for
it. ``--loopback`` runs every rank on this host's loopback instead and declares fast links.

**Devices.** Every compute action of a rank lasts the duration the cost model gives its stage (forward,
backward, and for ZB-H1 the input- and weight-gradient parts; ``HETERO_EMULATE_ACTION_S``): the real
small computation runs inside it and the rank sleeps the rest, so four ranks share two cores without
contending, while activations, gradients and all-reduces really move. The device kinds are slow on
purpose (about 20 ms of forward per layer and sequence) so that modelled compute dominates.

**Measured constants.** Before the plans run, the script measures two constants of the software on this
machine and writes them into the cluster file's ``[plan]`` (``action_overhead_us``, ``p2p_latency_us``;
``--no-constants``: leave them 0): the communication library's latency per message (a gloo ping-pong
between two processes, ``benchlib.p2p_probe``), and the runtime's own time per compute action: a
two-stage 1F1B pipeline on one node with emulated actions of fixed length runs at 2 and at 8
microbatches, and the step-time growth that the model without overhead does not predict, divided by
the growth of compute actions on the critical path (from the same model), is the time per action.
The plans are then ranked by the planner with those constants; every row also shows the prediction
without them (the same layouts, re-scored), so the two models' errors and rankings compare on the
same runs.

**Which plans.** The pick (#1), then down the planner's ranking of its best ``--top`` plans, each
plan whose prediction is at least ``--min-gap`` (3%) above the last chosen one's, until ``--plans``
are chosen: neighbours in the ranking are often within run-to-run noise of each other, and a ranking
of plans that noise cannot tell apart says nothing of the model. Each chosen layout runs ``--reps``
times (interleaved: all plans, then all again); measured = median over repetitions of the median step
time after the warm-up steps; the spread between repetitions is reported as the noise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import benchlib
from bench.planner import plan_breakdown
from hetero_llm import layout as L
from hetero_llm.planner import plan_cluster
from hetero_llm.planner.candidates import Candidate, PipelineChoice, StageChoice, TPGroup
from hetero_llm.planner.cluster import load_cluster
from hetero_llm.planner.cost import PlannerCostModel
from hetero_llm.sweep import report as sweep_report

ROOT = Path(__file__).resolve().parents[2]
from hetero_llm.planner.output import layout_text  # noqa: E402

# Links: the testbed's (a slow cross-domain link between the fast node and the slow ones), or, over
# loopback, fast ones (loopback is fast, so the model must not see a slow link there).
TESTBED_LINKS = {"domain_gbps": 1, "domain_us": 100, "cross_gbps": 0.05, "cross_us": 2000}
LOOPBACK_LINKS = {"domain_gbps": 10, "domain_us": 20, "cross_gbps": 10, "cross_us": 20}


def cluster_text(
    steps: int, speed: float = 1.0, *, testbed: bool = False, action_us: float = 0.0, p2p_us: float = 0.0
) -> str:
    """The emulated cluster file; ``speed`` multiplies both device kinds' FLOPS (``--quick``: 4); ``testbed``:
    the testbed's slow cross-domain link and its interfaces (else fast links, loopback)."""
    links = TESTBED_LINKS if testbed else LOOPBACK_LINKS
    model = L.ModelSpec(
        layers=8,
        hidden=64,
        heads=4,
        vocab=64,
        seq_len=16,
        norm=L.Norm.RMSNORM,
        position=L.Position.ROPE,
        mlp=L.Mlp.SWIGLU,
    )
    train = L.TrainSpec(steps=steps, global_batch=8, seed=11, lr=3e-3, log_every=1)
    domains = tuple(
        L.DomainSpec(
            name=name,
            kind=L.DomainKind.ETHERNET,
            bandwidth_gbps=float(links["domain_gbps"]),
            latency_us=float(links["domain_us"]),
            gloo_ifname="dom0" if testbed else "",
        )
        for name in ("fast", "slow")
    )
    cross = L.CrossDomainSpec(
        bandwidth_gbps=float(links["cross_gbps"]),
        latency_us=float(links["cross_us"]),
        gloo_ifname="xdom" if testbed else "",
    )
    nodes = (
        L.NodeSpec(name="f0", devices=("cpu", "cpu"), domain="fast"),
        L.NodeSpec(name="s0", domain="slow"),
        L.NodeSpec(name="s1", domain="slow"),
    )
    cluster = L.ClusterSpec(nodes=nodes, timeout_s=120.0, domains=domains, cross_domain=cross)
    # emulated devices: priced by FLOPs only, exactly as the emulated runtime charges (predict/device.py)
    kind = {"memory_gb": 8, "link_gbps": 10, "mem_bw_gbs": 10, "pricing": "flops"}
    plan = {
        "max_tp": 2,
        "action_overhead_us": action_us,
        "p2p_latency_us": p2p_us,
        "nodes": {"f0": "emu-fast", "s*": "emu-slow"},
        "kinds": {"emu-fast": {"tflops": 0.0001 * speed, **kind}, "emu-slow": {"tflops": 0.00005 * speed, **kind}},
    }
    return L.dumps_cluster(
        {"model": model, "train": train, "data": L.DataSpec(), "cluster": cluster},
        {"plan": plan},
        comments={
            "plan.kinds.emu-fast": "about 20 ms of forward per layer and sequence (--quick: 5 ms)",
            "plan.kinds.emu-slow": "half as fast",
        },
    )


def emulation_env(cluster, cand) -> str:
    """HETERO_EMULATE_ACTION_S for a candidate: per rank, its stage's modelled action durations (the device's
    compute and TP time; the measured per-action overhead is the runtime's, so it is not emulated)."""
    times = plan_breakdown.emulated(PlannerCostModel(cluster), cand)
    items, rank = [], 0
    for p, pipe in enumerate(cand.pipelines):
        for i, s in enumerate(pipe.stages):
            spec = ";".join(f"{k}={times[(p, i)][k]:.6f}" for k in plan_breakdown.KINDS)
            for _ in s.group.devices:
                items.append(f"{rank}:{spec}")
                rank += 1
    return ",".join(items)


def spread_over_ranking(predicted: list[float], plans: int, min_gap: float) -> list[int]:
    """Indices into a ranking (``predicted`` ascending): the first, then each whose prediction is at least
    ``1 + min_gap`` times the last chosen one's, until ``plans`` are chosen (fewer if the ranking ends)."""
    chosen: list[int] = []
    for i, p in enumerate(predicted):
        if len(chosen) == plans:
            break
        if not chosen or p >= predicted[chosen[-1]] * (1 + min_gap):
            chosen.append(i)
    return chosen


def critical_actions(cluster, cand: Candidate) -> float:
    """Compute actions on the critical path of ``cand``'s step: d(predicted step) / d(per-action overhead)."""
    import attrs

    probe = 1e-3
    plain = PlannerCostModel(attrs.evolve(cluster, limits=attrs.evolve(cluster.limits, action_overhead_us=0.0)))
    more = PlannerCostModel(attrs.evolve(cluster, limits=attrs.evolve(cluster.limits, action_overhead_us=probe * 1e6)))
    return (more.score(cand).step_time - plain.score(cand).step_time) / probe


def two_stage(cluster, microbatches: int) -> Candidate:
    """One 1F1B pipeline over the two devices of node f0 (TP 1), half the layers each."""
    node = cluster.node("f0")
    half = cluster.model.layers // 2
    stages = tuple(
        StageChoice(TPGroup(node.name, node.domain, (f"{node.name}:{i}",), node.kind), n)
        for i, n in enumerate((half, cluster.model.layers - half))
    )
    return Candidate((PipelineChoice(cluster.train.global_batch, microbatches, stages),), "1f1b")


def measure_constants(tmp: Path, steps: int, warmup: int, reps: int, speed: float) -> dict:
    """The runtime's time per compute action and gloo's latency per message, on this machine (loopback)."""
    latency, bandwidth = benchlib.p2p_probe(reps=50)
    benchlib.say(f"gloo ping-pong: {latency * 1e6:.0f} us one way, {bandwidth / 1e9:.2f} GB/s")
    (tmp / "calib.toml").write_text(cluster_text(steps, speed))
    cluster = load_cluster(tmp / "calib.toml")
    cost = PlannerCostModel(cluster)
    runs = {}
    for rep in range(reps):
        for m in (2, 8):
            cand = two_stage(cluster, m)
            score = cost.score(cand)
            path = tmp / f"calib{m}.toml"
            path.write_text(layout_text(cluster, cand, score, None))
            env = {"HETERO_EMULATE_ACTION_S": emulation_env(cluster, cand)}
            rows = benchlib.run_layout(path, tmp / f"calib{m}_{rep}", env=env)
            runs.setdefault(m, []).append(statistics.median(r["seconds"] for r in rows[warmup:]))
            benchlib.say(
                f"calibration: 2 stages, {m} microbatches: predicted {score.step_time:.4f} s (no overhead), "
                f"measured {runs[m][-1]:.4f} s"
            )
    measured = {m: statistics.median(v) for m, v in runs.items()}
    predicted = {m: cost.score(two_stage(cluster, m)).step_time for m in (2, 8)}
    actions = {m: critical_actions(cluster, two_stage(cluster, m)) for m in (2, 8)}
    per_action = ((measured[8] - predicted[8]) - (measured[2] - predicted[2])) / (actions[8] - actions[2])
    per_action = max(per_action, 0.0)
    benchlib.say(
        f"runtime time per compute action: {per_action * 1e3:.2f} ms "
        f"({actions[8] - actions[2]:.0f} more actions on the critical path at 8 microbatches than at 2)"
    )
    return {
        "action_overhead_us": per_action * 1e6,
        "p2p_latency_us": latency * 1e6,
        "p2p_bandwidth_Bps": bandwidth,
        "calibration": {
            "measured_s": measured,
            "each_rep_s": runs,
            "predicted_no_overhead_s": predicted,
            "critical_actions": actions,
        },
    }


def kendall(xs: list[float], ys: list[float]) -> float:
    """Kendall's tau-b, as every sweep report computes it (``hetero_llm.sweep.report``; 1 for a single plan)."""
    if len(xs) < 2:
        return 1.0
    tau = sweep_report.kendall_tau(xs, ys)
    return float("nan") if tau is None else tau


# C901: a benchmark script's flags and its one run, step by step in the order they happen (plan, pick, measure,
# report); its parts are the functions above
def main() -> None:  # noqa: C901
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 plans, 2 steps, loopback, faster devices (the test suite)")
    ap.add_argument("--loopback", action="store_true", help="every rank on loopback (fast links declared), no testbed")
    ap.add_argument(
        "--no-constants",
        action="store_true",
        help="do not measure the per-action overhead and the per-message latency: leave them 0 in the cluster file",
    )
    ap.add_argument("--plans", type=int, default=10)
    ap.add_argument("--top", type=int, default=200, help="plans of the planner's ranking to choose from")
    ap.add_argument("--min-gap", type=float, default=0.03, help="least relative gap between chosen plans' predictions")
    ap.add_argument("--reps", type=int, default=2, help="runs of each layout (interleaved)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--tag", default="", help="suffix of the result files (plan_vs_measured_TAG.*)")
    ap.add_argument("--ranks", default="", help="run these plans of the ranking (e.g. '1,37') instead of spreading")
    ap.add_argument(
        "--constants-from",
        default="",
        help="take action_overhead_us and p2p_latency_us from an earlier run's JSON instead of measuring them",
    )
    ap.add_argument(
        "--trace",
        default="",
        metavar="DIR",
        help="trace every run into DIR/planN_R (hetero-launch --trace) and break each plan's step down as the model "
        "prices it (bench/planner/plan_breakdown.py: more tables, 'breakdown' in the JSON)",
    )
    args = ap.parse_args()
    speed = 1.0
    if args.quick:  # the measured step stays above the modelled one at any speed: the emulated actions are a floor
        args.plans, args.steps, args.warmup, args.reps, args.top, speed = 2, 2, 1, 1, 20, 4.0
        args.loopback, args.no_constants = True, True
    testbed = not args.loopback
    if testbed:
        from bench import testbed as T

        ok, why = T.available()
        if not ok:
            sys.exit(f"plan_vs_measured: the testbed needs root and network namespaces ({why}); or run --loopback")
    for var in ("HETERO_EMULATE_SLOWDOWN", "HETERO_EMULATE_JITTER", "HETERO_EMULATE_ACTION_S", "HETERO_EMULATE_DEVICE"):
        os.environ.pop(var, None)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    load_before, t_start = os.getloadavg(), time.time()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        constants = {"action_overhead_us": 0.0, "p2p_latency_us": 0.0}
        if args.constants_from:
            constants = json.loads(Path(args.constants_from).read_text())["summary"]["constants"]
        elif not args.no_constants:
            constants = measure_constants(tmp, args.steps, args.warmup, args.reps, speed)
        (tmp / "cluster.toml").write_text(
            cluster_text(
                args.steps,
                speed,
                testbed=testbed,
                action_us=constants["action_overhead_us"],
                p2p_us=constants["p2p_latency_us"],
            )
        )
        (tmp / "plain.toml").write_text(cluster_text(args.steps, speed, testbed=testbed))
        cluster = load_cluster(tmp / "cluster.toml")
        plain = PlannerCostModel(load_cluster(tmp / "plain.toml"))  # the model without the measured constants
        cost = PlannerCostModel(cluster)
        ranked = plan_cluster(cluster, top=args.top).ranked
        picks = spread_over_ranking([s.step_time for _, s in ranked], args.plans, args.min_gap)
        if args.ranks:
            picks = [int(r) - 1 for r in args.ranks.split(",")]
        chosen = [(i, ranked[i]) for i in picks]
        benchlib.say(
            f"{len(ranked)} ranked plans, predictions {ranked[0][1].step_time:.4f} .. "
            f"{ranked[-1][1].step_time:.4f} s; chosen #{', #'.join(str(i + 1) for i in picks)}"
        )
        measured: dict[int, list[float]] = {i: [] for i in picks}
        broken: dict[int, list[dict]] = {i: [] for i in picks}
        paths = {}
        for i, (cand, score) in chosen:
            paths[i] = tmp / f"plan{i}.toml"
            paths[i].write_text(layout_text(cluster, cand, score, None))
        import contextlib

        with contextlib.ExitStack() as stack:
            tb = None
            if testbed:
                from bench.comm import holmes_bench
                from hetero_llm import layout as layout_mod

                tb = stack.enter_context(T.Testbed(holmes_bench.testbed_spec(layout_mod.load(paths[picks[0]]))))
            for rep in range(args.reps):
                for n, (i, (cand, score)) in enumerate(chosen):
                    env = {"HETERO_EMULATE_ACTION_S": emulation_env(cluster, cand)}
                    trace = Path(args.trace) / f"plan{i + 1}_{rep}" if args.trace else None
                    if tb is not None:
                        got = holmes_bench.run_layout(
                            tb,
                            paths[i],
                            tmp / f"run{i}_{rep}",
                            steps=args.steps,
                            warmup=args.warmup,
                            port=29600 + rep * 100 + n,
                            env=env,
                            trace=trace,
                        )
                        steps = list(got.step_s)
                    else:
                        run = benchlib.run_layout(paths[i], tmp / f"run{i}_{rep}", env=env, trace=trace)
                        steps = [r["seconds"] for r in run]
                    measured[i].append(statistics.median(steps[args.warmup :]))
                    if trace is not None:
                        broken[i].append(plan_breakdown.breakdown(cost, cand, trace, steps, args.warmup))
                    benchlib.say(
                        f"rep {rep} plan #{i + 1}: predicted {score.step_time:.4f} s, measured {measured[i][-1]:.4f} s"
                    )
        for i, (cand, score) in chosen:
            shape = " / ".join(
                "+".join(f"{s.layers}L/tp{s.group.tp}@{s.group.node}" for s in p.stages) for p in cand.pipelines
            )
            rows.append(
                {
                    "rank": i + 1,
                    "schedule": cand.schedule,
                    "pipelines": shape,
                    "rows": cand.pipelines[0].rows,
                    "predicted_s": score.step_time,
                    "predicted_plain_s": plain.score(cand).step_time,
                    "measured_s": statistics.median(measured[i]),
                    "each_rep_s": measured[i],
                    **({"breakdown": broken[i]} if args.trace else {}),
                }
            )
    load_after = os.getloadavg()

    def stats(key: str) -> dict:
        errors = [abs(r[key] - r["measured_s"]) / r["measured_s"] for r in rows]
        return {
            "mean_error": statistics.mean(errors),
            "max_error": max(errors),
            "kendall_tau": kendall([r[key] for r in rows], [r["measured_s"] for r in rows]),
        }

    noise = [abs(r["each_rep_s"][0] - r["each_rep_s"][-1]) / statistics.mean(r["each_rep_s"]) for r in rows]
    best = min(r["measured_s"] for r in rows)
    summary = {
        "plans": len(rows),
        "network": "testbed" if testbed else "loopback",
        **stats("predicted_s"),
        "without_constants": stats("predicted_plain_s"),
        "pick_vs_best_measured": rows[0]["measured_s"] / best,
        "rep_spread_median": statistics.median(noise),
        "rep_spread_max": max(noise),
        "constants": constants,
        "load_before": load_before,
        "load_after": load_after,
        "seconds": time.time() - t_start,
    }
    lines = [
        *benchlib.report_head("plan_vs_measured", benchlib.machine(), load_before, load_after),
        "| # | schedule | pipelines (layers/TP@node per stage) | rows/mb | predicted s | without constants s "
        "| measured s (each rep) | error | error without |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        e, e0 = ((r[k] - r["measured_s"]) / r["measured_s"] for k in ("predicted_s", "predicted_plain_s"))
        reps = ", ".join(f"{x:.4f}" for x in r["each_rep_s"])
        lines.append(
            f"| {r['rank']} | {r['schedule']} | {r['pipelines']} | {r['rows']} | {r['predicted_s']:.4f} | "
            f"{r['predicted_plain_s']:.4f} | {r['measured_s']:.4f} ({reps}) | {e:+.1%} | {e0:+.1%} |".replace("+-", "-")
        )
    w = summary["without_constants"]
    lines += [
        "",
        f"network: {summary['network']}; measured constants: action_overhead_us = "
        f"{constants['action_overhead_us']:.0f}, p2p_latency_us = {constants['p2p_latency_us']:.0f}",
        "",
        f"with the constants: mean |error| {summary['mean_error']:.1%} (max {summary['max_error']:.1%}), Kendall "
        f"tau {summary['kendall_tau']:.2f}; without: mean |error| {w['mean_error']:.1%} (max {w['max_error']:.1%}), "
        f"Kendall tau {w['kendall_tau']:.2f}; the planner's pick is {summary['pick_vs_best_measured']:.3f}x the "
        f"best measured step; repetitions differ by {summary['rep_spread_median']:.1%} (median, max "
        f"{summary['rep_spread_max']:.1%})",
    ]
    if args.trace:  # the first repetition's breakdown of each plan
        lines += ["", plan_breakdown.markdown([{**r, "breakdown": r["breakdown"][0]} for r in rows])]
    text = "\n".join(lines) + "\n"
    print(text)
    name = "plan_vs_measured" + (f"_{args.tag}" if args.tag else "")
    (out / f"{name}.json").write_text(
        json.dumps(
            {"rows": rows, "summary": summary, "command": benchlib.command_line(), "git": benchlib.git_state()},
            indent=1,
            default=str,
        )
    )
    (out / f"{name}.md").write_text(text)


if __name__ == "__main__":
    main()
