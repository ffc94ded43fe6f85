"""Hot switching (HotSPa) against the best static layout the planner finds, in regimes from real hardware, on a
long-tailed corpus of real text and on the embedded one; emulated devices.

Emulated-device mode (``HETERO_EMULATE_DEVICE``, docs/hot_switching.md): every compute action of every
rank lasts ``action_seconds`` of its microbatch on a modelled device (``Config.gflops``; matmuls
over every position, masked attention over the sum of squared document lengths, TP all-reduces over a
modelled TP link, the recomputed forward of a recomputing stage); the real small computation runs inside it and
the rank sleeps the rest. So the tokens/s compare layouts on the modelled device, not the load of this 2-core
host. Switches and pipeline sends are NOT emulated: they are real gloo transfers, measured as they are.

**Regimes** (``hot_switch_regimes.py``, whose docstring has the derivation): a real GPU and the link its TP 2
all-reduces over (A100 over NVLink, over PCIe, across nodes over 100 Gbit/s InfiniBand; RTX 4090 over PCIe),
scaled down together so that a layer's TP all-reduces cost the real fraction of its matmuls (``tp_comm``), for a
7B-class hidden size and bf16 activations; the testbed's link runs at the same scaled rate, so switches keep the
real ratio to compute too (for ~0.5M tokens per step on two GPUs). **Corpora**: the embedded grammar's documents
(lognormal lengths, median ``median`` tokens, log-std ``sigma``) and this Python's standard library sources split
on blank lines (real text, long-tailed). Two devices, memory cap ``cap_positions`` (half the longest row).

**Static baseline** (``hot_switch_static.py``): the planner (``plan_cluster`` over its whole static space:
DP, TP, PP, recompute per stage, every schedule it prices, with and without ZeRO-1) on the same device, link,
model, memory cap and corpus ranks static layouts; the best ``static_candidates`` of distinct structures are run
side by side with switching, and the best **measured** one is the baseline. **Switching**: the hand-made layout
(documents of 1-``short`` positions under DP 2, the rest under TP 2, home TP 2, elastic buckets, the long one
topped up), and what ``hetero-plan --buckets {short}`` writes when it predicts switching pays
(``switching/worth.py``; it then says so, and otherwise writes the static layout: no run).

Measured, interleaved in one run (every layout, then again in reverse order): tokens/s (over the real targets;
median steps after warm-up), the fraction of the step rank 0 spends in switches (``SWITCH`` trace actions,
waiting included), each switch's own time (last rank in to last rank out), and ``switch_seconds`` of the same
switches with gloo's latency and bandwidth as a switch sees them and the switch's host work (copy bandwidth, per
block, per gradient buffer) replayed on the run's real blocks (both probed just before and just after every
switching run, the prediction the mean of the two: the load of this shared host drifts within a run); peak RSS (the largest process); the modelled peak per device
(the planner's memory model, the bucket layouts' one shared parameter storage counted).

**With CP** (``--max-cp 2``, issue 36 5b; ``layouts/clusters/hot_switch_cp_a100_{ib200,nvlink}.toml`` are its
clusters in ``a100-ib200`` and ``a100-nvlink``): the planner may use CP for the static layouts and ``--buckets``;
the cap is what cp 2 with full recompute needs for one row (no device holds a whole row alone); the hand-made
layouts are not run, and the buckets ``--buckets`` priced are run even where it rejects them (named so), to check
the refusal.

Network (``--network``). ``testbed`` (the default where it can be built: root and network namespaces): the two
devices are two emulated nodes (``bench/testbed/``) of one domain, every link shaped to the TP link's rate with
no added delay. Results go to ``hot_switch_testbed.{md,json,png}`` (``--tag T``: ``hot_switch_testbed_T.*``). ``loopback``: one node of two devices
(``hot_switch.{md,json,png}``; ``--quick`` runs it unless told otherwise).

    sudo python -m bench.hot_switch.hot_switch
    python -m bench.hot_switch.hot_switch --network loopback --regimes a100-pcie --corpora text
    python -m bench.hot_switch.hot_switch --quick

The scenario is ``hot_switch_config.py`` (configuration, cluster, hand-made layouts), ``hot_switch_regimes.py``
(regimes, corpora) and ``hot_switch_static.py`` (the planner's layouts, modelled memory); this module runs and
measures it, with ``hot_switch_probes.py`` (the host's exchanges and copies), ``hot_switch_runs.py`` (one launch,
on loopback or the testbed, and its switch times) and ``hot_switch_predict.py`` (the simulator's predictions).
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path

import attrs
import click

from bench.common import benchlib as B
from bench.hot_switch.hot_switch_config import (
    QUICK,
    Config,
    bucket_rows_needed,
    device_spec,
    recompute_layout,
    switch_layout,
)
from bench.hot_switch.hot_switch_predict import predicted, predicted_static, switch_peers
from bench.hot_switch.hot_switch_probes import exchange_probe, exchange_probe_testbed, host_costs
from bench.hot_switch.hot_switch_regimes import REGIMES, text_corpus
from bench.hot_switch.hot_switch_runs import launch_with_peak, switch_times, testbed
from bench.hot_switch.hot_switch_static import modelled_peaks, planned_buckets, static_candidates

NAME = "hot_switch"
HAND = "switching dp2/tp2, elastic, top-up"  # the hand-made switching layout (hot_switch_config.switch_layout)
HAND_RC = "switching dp2 / dp2 recompute, elastic, top-up"  # hot_switch_config.recompute_layout


@attrs.frozen
class Entry:
    name: str
    layout: object  # a Layout on the bench's cluster
    switching: bool
    planner_s: float | None  # the planner's predicted step (static candidates and planned buckets)


def run_one(cfg: Config, entry: Entry, folder: Path, env: dict[str, str], tb=None) -> dict:
    from hetero_llm import layout as layout_mod

    folder.mkdir(parents=True, exist_ok=True)
    stem = "".join(c if c.isalnum() else "_" for c in entry.name)[:60]
    layout = folder / f"{stem}.toml"
    layout.write_text(layout_mod.dumps(entry.layout))
    trace = folder / (layout.stem + "_trace")
    from hetero_llm.runtime import tensor_meter

    meter = folder / (layout.stem + "_meter")  # runtime/tensor_meter.py: each rank's bytes of tensors at its peak
    meter.mkdir(exist_ok=True)
    env = {**env, tensor_meter.ENV: str(meter)}
    steps_out, peak = launch_with_peak(layout, folder / layout.stem, trace if entry.switching else None, env, tb)
    tensors = tensor_peaks(layout, meter)
    steps = B.steady(steps_out, cfg.warmup)
    seconds = [r["seconds"] for r in steps]
    out = {
        "layout": entry.name,
        "tokens_s": sum(r["tokens"] for r in steps) / sum(seconds),
        "step_s": B.median(seconds),
        "peak_rss_mb": peak / 1024,
        "tensor_peak_mb": [t["peak_bytes"] / 1e6 for t in tensors],
        "tensor_at_peak_mb": [{k: v / 1e6 for k, v in t["at_peak"].items()} for t in tensors],
        "layout_file": str(layout),
        "trace": str(trace),
        "step_seconds": [r["seconds"] for r in steps_out],
    }
    if entry.switching:
        waited, own = (B.steady(x, cfg.warmup) for x in switch_times(trace, switch_peers(layout, trace)))
        out["switch_s"] = B.median(own)
        out["switch_waiting_s"] = B.median(waited)
        out["switch_fraction"] = out["switch_waiting_s"] / out["step_s"]
    return out


def tensor_peaks(layout: Path, folder: Path) -> list[dict]:
    """Each bench device's meter report (``tensor_meter``; the device's rank in the layout's home plan)."""
    import json

    from hetero_llm import layout as layout_mod
    from hetero_llm.plan import compile_plan

    plan = compile_plan(layout_mod.load(layout))
    rank_of = {r.device_id: r.rank for r in plan.ranks}
    devices = sorted(rank_of)  # node0:0 before node0:1 / node1:0: the bench's device order
    return [json.loads((folder / f"rank{rank_of[d]}.json").read_text()) for d in devices]


def network_line(cfg: Config) -> str:
    if cfg.network == "testbed":
        return (
            f"on two testbed nodes joined by {cfg.tp_gbps * 1000:.0f} Mbit/s links, the TP link's rate, no added "
            f"delay: switches, TP all-reduces and the probes cross them"
        )
    return "one node; switches and TP all-reduces over loopback"


def entries(cfg: Config, folder: Path) -> tuple[float, list[Entry], list[str]]:
    """(the memory cap in GB, the layouts to run, ``hetero-plan --buckets``' verdict lines)."""
    memory, statics = static_candidates(cfg, folder)
    planned, verdict = planned_buckets(cfg, folder, memory)
    out = [Entry(x.name, x.layout, False, x.predicted_s) for x in statics]
    if cfg.hand:
        out.append(Entry(HAND, switch_layout(cfg, "top-up", bucket_rows_needed(cfg)), True, None))
        out.append(Entry(HAND_RC, recompute_layout(cfg), True, None))
    if planned is not None:
        out.append(Entry(planned.name, planned.layout, True, planned.predicted_s))
    return memory, out, verdict


def scenario(cfg: Config, links: dict):
    """One comparison (the planner's static layouts and switching, interleaved) on one regime and corpus. Before
    and after each switching run, ``hot_switch_probes.exchange_probe`` measures gloo's latency and bandwidth as a
    switch sees them (two processes that were idle, one exchange both ways) and ``host_costs`` the switch's host
    work on the layout's real blocks (the switcher's own code, each switch after what precedes it in a run); that
    run's predictions are the mean of the two probes' (``cfg.switching_only``: the static layouts are not run)."""
    from hetero_llm import layout as layout_mod
    from hetero_llm.predict.device import EmulatedDevice

    spec = device_spec(cfg)
    device = EmulatedDevice.parse(spec)
    env = {"HETERO_EMULATE_DEVICE": f"*:{spec}"}
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        memory, layouts, verdict = entries(cfg, Path(tmp))
        modelled = {e.name: modelled_peaks(cfg, Path(tmp), memory, e.layout) for e in layouts}
        runs: dict[str, list[dict]] = {e.name: [] for e in layouts}
        tb = stack.enter_context(testbed(cfg)) if cfg.network == "testbed" else None

        def probe(busy_s: float = 0.0) -> tuple[float, float]:  # the link as a switch sees it
            if tb:
                return exchange_probe_testbed(tb, cfg.probe_reps, 1 << 17, busy_s=busy_s)
            return exchange_probe(reps=cfg.probe_reps, big=1 << 17, busy_s=busy_s)

        def probe_switch(layout) -> dict:  # the layout's switches' host work, then the link as a switch sees it
            probed = Path(tmp) / "probed.toml"
            probed.write_text(layout_mod.dumps(layout))
            host = host_costs(probed, range(cfg.warmup, cfg.steps), reps=cfg.probe_host_reps)
            latency, bandwidth = probe(busy_s=host.switch_s)  # the later rank comes from a switch's host work
            return {"latency_s": latency, "bandwidth_bytes_s": bandwidth, "host": attrs.asdict(host)}

        if tb:  # the static runs' links (pipeline sends): the testbed's, not loopback's
            link = probe()
            links = {**links, "node": link, "domain": link, "cross_domain": link}
        for r in range(cfg.rounds):
            for e in layouts if r % 2 == 0 else list(reversed(layouts)):
                if cfg.switching_only and not e.switching:
                    continue
                B.say(f"{cfg.corpus}, {cfg.regime}, round {r + 1}/{cfg.rounds}: {e.name}")
                before = probe_switch(e.layout) if e.switching else None  # probed just before the run ...
                result = run_one(cfg, e, Path(tmp) / f"r{r}", env, tb)
                path = Path(result["layout_file"])
                if e.switching:
                    result["probes"] = [before, probe_switch(e.layout)]  # ... and just after it: the mean of both
                    predictions = [
                        predicted(cfg, path, Path(result["trace"]), links, p, device) for p in result["probes"]
                    ]
                    for key, i in (("predicted_switch_s", 0), ("predicted_step_s", 1)):
                        result[key] = statistics.mean(B.median(B.steady(x[i], cfg.warmup)) for x in predictions)
                else:
                    steps = predicted_static(cfg, path, links, device)
                    result["predicted_step_s"] = B.median(B.steady(steps, cfg.warmup))
                runs[e.name].append(result)
    results = []
    for e in layouts:
        reps = runs[e.name]
        if not reps:  # --switching-only: the static layouts were not run
            continue
        row = {
            "layout": e.name,
            "switching": e.switching,
            "regime": cfg.regime,
            "corpus": cfg.corpus,
            "tp_comm": cfg.tp_comm,
            "tokens_s": B.median([x["tokens_s"] for x in reps]),
            "step_s": B.median([x["step_s"] for x in reps]),
            "predicted_step_s": B.median([x["predicted_step_s"] for x in reps]),
            "planner_step_s": e.planner_s,
            "peak_rss_mb": max(x["peak_rss_mb"] for x in reps),
            "modelled_peak_mb": max(modelled[e.name]) / 1e6,
            "modelled_peak_mb_per_device": [x / 1e6 for x in modelled[e.name]],
            "tensor_peak_mb_per_device": [max(x["tensor_peak_mb"][d] for x in reps) for d in range(2)],
            "tensor_at_peak_mb": reps[0]["tensor_at_peak_mb"],
            "fits_cap": max(modelled[e.name]) <= memory * 1e9 * (1 - 0.1),
        }
        if e.switching:
            for key in ("switch_s", "switch_waiting_s", "switch_fraction", "predicted_switch_s"):
                row[key] = B.median([x[key] for x in reps])
            row["predicted_over_measured_switch"] = row["predicted_switch_s"] / row["switch_s"]
        results.append(row)
    static = max((r for r in results if not r["switching"]), key=lambda r: r["tokens_s"], default=None)
    for r in results:
        r["vs_best_static"] = r["tokens_s"] / static["tokens_s"] if static else float("nan")
    probes = {
        k: [p[k] for reps in runs.values() for x in reps for p in x.get("probes", [])]
        for k in ("latency_s", "bandwidth_bytes_s", "host")
    }
    markdown = report(cfg, spec, memory, results, static, verdict, probes)
    payload = {"config": attrs.asdict(cfg), "device": spec, "memory_gb": memory, "results": results, "runs": runs}
    payload |= {"planner_buckets": verdict, "probes": probes, "derivation": REGIMES[cfg.regime].derivation()}
    return markdown, payload, results


def report(cfg: Config, spec: str, memory: float, results, static, verdict, probes) -> str:
    def nan(x):
        return float("nan") if x is None else x

    table = B.markdown_table(
        [
            "layout",
            "tokens/s",
            "x best static",
            "step s",
            "simulated step s",
            "planner step s",
            "switch % of step",
            "switch s",
            "predicted switch s",
            "predicted / measured",
            "modelled peak MB",
            "modelled MB per device",
            "measured tensor peak MB per device",
            "peak RSS MB",
        ],
        [
            [
                r["layout"],
                r["tokens_s"],
                r["vs_best_static"],
                r["step_s"],
                r["predicted_step_s"],
                nan(r["planner_step_s"]),
                100 * r.get("switch_fraction", float("nan")),
                r.get("switch_s", float("nan")),
                r.get("predicted_switch_s", float("nan")),
                r.get("predicted_over_measured_switch", float("nan")),
                f"{r['modelled_peak_mb']:.2f}" + ("" if r["fits_cap"] else " (over the cap)"),
                " / ".join(f"{x:.2f}" for x in r["modelled_peak_mb_per_device"]),
                " / ".join(f"{x:.2f}" for x in r["tensor_peak_mb_per_device"]),
                r["peak_rss_mb"],
            ]
            for r in results
        ],
    )
    corpus = (
        f"the standard library's sources split on blank lines ({cfg.text_path})"
        if cfg.corpus == "text"
        else f"the embedded grammar, lognormal lengths (median {cfg.median:g} tokens, log-std {cfg.sigma:g})"
    )
    return "\n".join(
        [
            f"## {REGIMES[cfg.regime].name}, {cfg.corpus} corpus",
            "",
            f'Regime: {REGIMES[cfg.regime].derivation()}. Emulated: HETERO_EMULATE_DEVICE="*:{spec}" (TP 2 all-reduces '
            f"= {cfg.tp_comm:.3g} x the forward matmuls), two devices ({network_line(cfg)}). Model: {cfg.layers} layers, "
            f"hidden {cfg.hidden}, seq_len {cfg.seq_len}, global batch {cfg.global_batch} rows of packed documents from "
            f"{corpus}. Memory cap {memory * 1e3 * 0.9:.2f} MB per device (planner kind memory_gb {memory:.5g}, "
            f"10% margin: static {'cp 2 with full recompute' if cfg.max_cp > 1 else 'TP 2'} with one row per microbatch).",
            "",
            table,
            "",
            f"Best static measured: {static['layout'] if static else 'none run (--switching-only)'}. "
            f"hetero-plan --buckets {cfg.short}:",
            "",
            "```",
            *verdict,
            "```",
            "",
            f"gloo exchanges probed before and after each switching run: latency per message "
            f"{', '.join(f'{x * 1e6:.0f}' for x in probes['latency_s'])} us, bandwidth "
            f"{', '.join(f'{x / 1e9:.3f}' for x in probes['bandwidth_bytes_s'])} GB/s. A switch's host work "
            f"replayed before and after each switching run (hot_switch_probes.host_costs; per probe: copy GB/s, us per block, "
            f"us per gradient buffer; a step's host work ms, median [lowest, highest] as in a run, hot, "
            f"and as fitted): "
            + "; ".join(
                f"{h['copy_bandwidth'] / 1e9:.2f}, {h['block_overhead'] * 1e6:.1f}, {h['buffer_overhead'] * 1e6:.1f}; "
                f"{h['step_s'] * 1e3:.2f} [{h['step_spread'][0] * 1e3:.2f}, {h['step_spread'][1] * 1e3:.2f}], "
                f"{h['hot_step_s'] * 1e3:.2f}, {h['fitted_step_s'] * 1e3:.2f}"
                for h in probes["host"]
            )
            + ".",
            "",
            "",
        ]
    )


@click.command()
@click.option("--quick", is_flag=True, help="A tiny model and one round: checks the script end to end (seconds).")
@click.option(
    "--network",
    type=click.Choice(["auto", "testbed", "loopback"]),
    default="auto",
    show_default=True,
    help="testbed: the two devices on two emulated nodes (network namespaces, needs root) joined by a link "
    "shaped to the TP link's rate; loopback: one node. auto: the testbed where it can be built, except "
    "with --quick.",
)
@click.option("--regimes", default="", help=f"Comma-separated, of {', '.join(REGIMES)} (default: the config's).")
@click.option("--corpora", default="", help="Comma-separated, of grammar, text (default: both).")
@click.option("--rounds", type=int, default=0, help="Rounds of every layout (default: the config's, 2).")
@click.option("--out-dir", type=click.Path(file_okay=False, path_type=Path), default=B.RESULTS, show_default=True)
@click.option("--tag", default="", help="Appended to the results' name (one invocation per part of a long run).")
@click.option("--steps", type=int, default=0, help="Steps per run, the first 2 skipped (default: the config's, 6).")
@click.option(
    "--max-cp",
    type=int,
    default=1,
    show_default=True,
    help="The planner's plan.max_cp (2: issue 36 5b: CP allowed, the cap forces a split even recomputing, only "
    "the planner's layouts run, and the buckets --buckets rejects too).",
)
@click.option(
    "--switching-only", is_flag=True, help="Run the switching layouts only: the switch-time rows, no x best static."
)
def main(
    quick: bool,
    network: str,
    regimes: str,
    corpora: str,
    rounds: int,
    out_dir: Path,
    tag: str,
    steps: int,
    max_cp: int,
    switching_only: bool,
) -> None:
    if network == "auto":
        network = "testbed" if not quick and _testbed_available() else "loopback"
    elif network == "testbed" and not _testbed_available():
        sys.exit("hot_switch: --network testbed needs root and network namespaces (python -m bench.testbed check)")
    base = attrs.evolve(QUICK if quick else Config(), network=network)
    if regimes:
        base = attrs.evolve(base, regimes=tuple(x.strip() for x in regimes.split(",")))
    if corpora:
        base = attrs.evolve(base, corpora=tuple(x.strip() for x in corpora.split(",")))
    if rounds:
        base = attrs.evolve(base, rounds=rounds)
    if steps:
        base = attrs.evolve(base, steps=steps)
    base = attrs.evolve(base, switching_only=switching_only)
    if max_cp > 1:
        base = attrs.evolve(base, max_cp=max_cp, hand=False, run_rejected=True)
    for x in base.regimes:
        if x not in REGIMES:
            sys.exit(f"hot_switch: --regimes: unknown regime {x!r} (known: {', '.join(REGIMES)})")
    name = NAME + ("_testbed" if network == "testbed" else "") + (f"_{tag}" if tag else "")
    info, load_before = B.machine(), B.load_average()
    B.say("probing gloo exchanges on this host")
    latency, bandwidth = exchange_probe(reps=5 if quick else 40, big=1 << 17)
    links = {
        "local": (0.0, math.inf),
        "node": (latency, bandwidth),
        "domain": (latency, bandwidth),
        "cross_domain": (latency, bandwidth),
    }  # the static runs' pipeline sends; switching runs probe again
    sections, payloads = [], []
    with tempfile.TemporaryDirectory() as corpus_dir:
        text = str(text_corpus(Path(corpus_dir)))
        for corpus in base.corpora:
            for regime in base.regimes:
                cfg = attrs.evolve(base, regime=regime, corpus=corpus, text_path=text)
                markdown, payload, _ = scenario(cfg, links)
                sections.append(markdown.replace(text, "stdlib.txt"))
                payloads.append(payload)
    load_after = B.load_average()
    title = (
        f"Hot switching vs the best static layout ({'quick' if quick else 'full'}, emulated devices, "
        f"{'two testbed nodes' if network == 'testbed' else 'loopback'})"
    )
    markdown = "\n".join([*B.report_head(title, info, load_before, load_after), *sections])
    payload = {
        "machine": info,
        "load_before": load_before,
        "load_after": load_after,
        "p2p": {"latency_s": latency, "bandwidth_bytes_s": bandwidth},
        "scenarios": payloads,
        "results": [r for p in payloads for r in p["results"]],
    }
    md, js = B.write_results(out_dir, name, markdown, payload)
    plot(payloads, out_dir / f"{name}.png")
    print(markdown)
    B.say(f"wrote {md}, {js}")


def _testbed_available() -> bool:
    from bench import testbed as T

    return os.geteuid() == 0 and T.available()[0]


def plot(payloads: list[dict], path: Path) -> None:
    """Tokens/s over the best measured static layout, per scenario: static candidates grey, switching blue."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.6), dpi=120)
    x, ticks = 0, []
    for p in payloads:
        start = x
        for r in p["results"]:
            ax.bar(x, r["vs_best_static"], color="#2b7bba" if r["switching"] else "#7a7a7a")
            x += 1
        ticks.append(((start + x - 1) / 2, f"{p['config']['regime']}\n{p['config']['corpus']}"))
        x += 1
    ax.axhline(1.0, color="black", linewidth=0.6)
    ax.set_xticks([t for t, _ in ticks], [n for _, n in ticks], fontsize=7)
    ax.set_ylabel("tokens/s / best static")
    ax.set_title("planner's static layouts (grey) vs hot switching (blue), 2 emulated devices", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    main()
