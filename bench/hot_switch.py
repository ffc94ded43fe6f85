"""Hot switching (HotSPa) against the best static layout that fits, on a long-tailed corpus, emulated devices.

Emulated-device mode (``HETERO_EMULATE_DEVICE``, docs/hot_switching.md): every compute action of every
rank lasts ``action_seconds`` of its microbatch on a modelled device (``--gflops``; matmuls
over every position, masked attention over the sum of squared document lengths, TP all-reduces over a
modelled TP link); the real small computation runs inside it and the rank sleeps the rest. So the
tokens/s compare layouts on the modelled device, not the load of this 2-core host. Switches and
pipeline sends are NOT emulated: they are real gloo transfers, measured as they are.

Corpus: the embedded grammar's documents with lognormal lengths (median ``median`` tokens, log-std
``sigma``; about 84% of documents within 128 positions, 5-10% between 256 and 512). Two devices.

Memory cap (per device): the activations of ``cap_positions`` positions through every layer (modelled
as 16 float32 tensors of ``hidden`` per position and layer, split by TP; the microbatches a device holds
at once). A 512-position document alone needs 512 under data parallelism and 256 under TP 2, so the
only static layout that fits is TP 2 with one row per microbatch (DP 2 and PP 2 with 1F1B both hold 512:
PP's first stage keeps two microbatches of half the layers). Switching: documents of 1-``short``
positions under DP 2 (one row of ``short`` per microbatch: ``short`` positions), the rest under TP 2 (one
row of 512 per microbatch: 256), home TP 2. Two ways: **elastic** buckets (``elastic = true``: each step
runs as many one-row microbatches as its documents need, HotSPa's way), the same with the long bucket's
rows **topped up** with short documents (``top_up = true``: positions that are computed anyway), and
**fixed** ones (each bucket's microbatch count is the most rows any step of the run needs, so a step that
needs fewer pads with empty rows, which cost their positions' compute like any row).

TP link: chosen so that, at TP 2, a layer's two forward all-reduces cost ``tp_comm`` of its forward
matmuls (the regime HotSPa targets: TP across a slow link for long sequences). Measured, interleaved in one
run (static, switching, then again): tokens/s (over the real targets; median steps after warm-up),
the fraction of the step rank 0 spends in switches (``SWITCH`` trace actions, waiting included), each
switch's own time (last rank in to last rank out), and ``bucket_sim.switch_seconds`` of the same switches
with gloo's latency and bandwidth as a switch sees them (``hot_switch_probes.exchange_probe``: two processes idle
for 10 ms, then one exchange both ways, timed last in to last out; probed before every switching run), a
memory-copy bandwidth and a host cost per block (the switch's own block code over the bench's real switches,
each round after 0.1 s asleep, as a rank reaches a switch).

Network (``--network``). ``testbed`` (the default where it can be built: root and network namespaces): the two
devices are two emulated nodes (``bench/testbed/``) of one domain, every link shaped to the TP link's rate with
no added delay, so switches, TP all-reduces and the probes cross the link the model charges for (a cluster's
switch crosses its network; on this host's loopback a switch of ~1 MB takes ~1 ms, as long as the scheduling
noise of two busy cores). Results go to ``hot_switch_testbed.{md,json,png}``. ``loopback``: one node of two
devices (``hot_switch.{md,json,png}``; ``--quick`` runs it unless told otherwise).

    sudo python -m bench.hot_switch
    python -m bench.hot_switch --network loopback
    python -m bench.hot_switch --quick

The scenario (configuration, cluster, layouts) is ``bench/hot_switch_config.py``; this module runs and measures it,
with ``hot_switch_probes.py`` (the host's exchanges and copies), ``hot_switch_runs.py`` (one launch, on loopback or
the testbed, and its switch times) and ``hot_switch_predict.py`` (the simulator's predictions of a run).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from pathlib import Path

import attrs
import click

from bench import benchlib as B
from bench.hot_switch_config import (
    FLOAT32,
    LAYOUTS,
    QUICK,
    Config,
    activation_positions,
    bucket_rows_needed,
    device_spec,
    layout_text,
)
from bench.hot_switch_predict import predicted, predicted_static
from bench.hot_switch_probes import copy_costs, exchange_probe, exchange_probe_testbed
from bench.hot_switch_runs import launch_with_peak, switch_times, testbed

NAME = "hot_switch"


def run_one(cfg: Config, name: str, folder: Path, rows: tuple[int, int], env: dict[str, str], tb=None) -> dict:
    switching = LAYOUTS[name] != "static"
    folder.mkdir(parents=True, exist_ok=True)
    layout = folder / (name.replace(",", "").replace(" ", "_").replace("/", "_") + ".toml")
    layout.write_text(layout_text(cfg, LAYOUTS[name], rows))
    trace = folder / (layout.stem + "_trace")
    steps_out, peak = launch_with_peak(layout, folder / layout.stem, trace if switching else None, env, tb)
    steps = B.steady(steps_out, cfg.warmup)
    seconds = [r["seconds"] for r in steps]
    out = {
        "layout": name,
        "tokens_s": sum(r["tokens"] for r in steps) / sum(seconds),
        "step_s": B.median(seconds),
        "peak_rss_mb": peak / 1024,
        "layout_file": str(layout),
        "trace": str(trace),
        "step_seconds": [r["seconds"] for r in steps_out],
    }
    if switching:
        waited, own = (B.steady(x, cfg.warmup) for x in switch_times(trace))
        out["switch_s"] = B.median(own)
        out["switch_waiting_s"] = B.median(waited)
        out["switch_fraction"] = out["switch_waiting_s"] / out["step_s"]
    return out


def network_line(cfg: Config) -> str:
    if cfg.network == "testbed":
        return (
            f"on two testbed nodes joined by {cfg.tp_gbps * 1000:.0f} Mbit/s links, the TP link's rate, no added "
            f"delay: switches, TP all-reduces and the probes cross them"
        )
    return "one node; switches and TP all-reduces over loopback"


def scenario(cfg: Config, links: dict, copy_bw: float, per_block: float):
    """One comparison (static and switching, interleaved) on one emulated device. Before each switching run,
    ``hot_switch_probes.exchange_probe`` measures gloo's latency and bandwidth as a switch sees them (two processes
    that were idle, one exchange both ways); that run's predictions use them."""
    from hetero_llm.predict.device import EmulatedDevice

    spec = device_spec(cfg)
    device = EmulatedDevice.parse(spec)
    env = {"HETERO_EMULATE_DEVICE": f"*:{spec}"}
    rows = bucket_rows_needed(cfg)
    runs: dict[str, list[dict]] = {name: [] for name in LAYOUTS}
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        tb = stack.enter_context(testbed(cfg)) if cfg.network == "testbed" else None

        def probe() -> tuple[float, float]:  # the link as a switch sees it
            if tb:
                return exchange_probe_testbed(tb, cfg.probe_reps, 1 << 17)
            return exchange_probe(reps=cfg.probe_reps, big=1 << 17)

        if tb:  # the static runs' links (pipeline sends): the testbed's, not loopback's
            link = probe()
            links = {**links, "node": link, "domain": link, "cross_domain": link}
        for r in range(cfg.rounds):
            order = list(LAYOUTS) if r % 2 == 0 else list(reversed(LAYOUTS))
            for name in order:
                B.say(f"round {r + 1}/{cfg.rounds}: {name}")
                if LAYOUTS[name] != "static":  # probed just before the run
                    latency, bandwidth = probe()
                    run_links = {**links, **{k: (latency, bandwidth) for k in ("node", "domain", "cross_domain")}}
                result = run_one(cfg, name, Path(tmp) / f"r{r}", rows, env, tb)
                if LAYOUTS[name] != "static":
                    result["probe"] = {"latency_s": latency, "bandwidth_bytes_s": bandwidth}
                    switches, steps = predicted(
                        cfg, Path(result["layout_file"]), Path(result["trace"]), run_links, copy_bw, per_block, device
                    )
                    result["predicted_switch_s"] = B.median(B.steady(switches, cfg.warmup))
                    result["predicted_step_s"] = B.median(B.steady(steps, cfg.warmup))
                else:
                    result["predicted_step_s"] = B.median(
                        B.steady(predicted_static(cfg, Path(result["layout_file"]), links, device), cfg.warmup)
                    )
                runs[name].append(result)
    results = []
    for name, reps in runs.items():
        switching = LAYOUTS[name] != "static"
        positions = activation_positions(cfg, switching)
        row = {
            "layout": name,
            "tp_comm": cfg.tp_comm,
            "tokens_s": B.median([x["tokens_s"] for x in reps]),
            "step_s": B.median([x["step_s"] for x in reps]),
            "peak_rss_mb": max(x["peak_rss_mb"] for x in reps),
            "activation_positions": positions,
            "activation_mb": 16 * cfg.hidden * FLOAT32 * positions * cfg.layers / 2**20,
            "fits_cap": positions <= cfg.cap_positions,
        }
        row["predicted_step_s"] = B.median([x["predicted_step_s"] for x in reps])
        if switching:
            for key in ("switch_s", "switch_waiting_s", "switch_fraction", "predicted_switch_s"):
                row[key] = B.median([x[key] for x in reps])
            row["prediction_error"] = row["predicted_switch_s"] / row["switch_s"] - 1  # vs the switch's own time
        results.append(row)
    probes = {
        k: [x["probe"][k] for reps in runs.values() for x in reps if "probe" in x]
        for k in ("latency_s", "bandwidth_bytes_s")
    }
    static = max(
        (r for r in results if r["layout"].startswith("static") and r["fits_cap"]), key=lambda r: r["tokens_s"]
    )
    for r in results:
        r["vs_best_static"] = r["tokens_s"] / static["tokens_s"]
    table = B.markdown_table(
        [
            "layout",
            "tokens/s",
            "x best static",
            "step s",
            "predicted step s",
            "switch % of step",
            "switch s with wait",
            "switch s",
            "predicted switch s",
            "act. positions (MB)",
            "fits cap",
            "peak RSS MB",
        ],
        [
            [
                r["layout"],
                r["tokens_s"],
                r["vs_best_static"],
                r["step_s"],
                r.get("predicted_step_s", float("nan")),
                100 * r.get("switch_fraction", float("nan")),
                r.get("switch_waiting_s", float("nan")),
                r.get("switch_s", float("nan")),
                r.get("predicted_switch_s", float("nan")),
                f"{r['activation_positions']} ({r['activation_mb']:.1f})",
                "yes" if r["fits_cap"] else "no",
                r["peak_rss_mb"],
            ]
            for r in results
        ],
    )
    markdown = "\n".join(
        [
            f"## TP all-reduces = {cfg.tp_comm:g} x the forward matmuls",
            "",
            f"Model: {cfg.layers} layers, hidden {cfg.hidden}, {cfg.heads} heads, seq_len {cfg.seq_len}, global batch "
            f"{cfg.global_batch} rows of packed documents (lognormal lengths, median {cfg.median:g} tokens, log-std "
            f'{cfg.sigma:g}). Two emulated devices ({network_line(cfg)}), HETERO_EMULATE_DEVICE="*:{spec}" (TP 2 all-reduces = '
            f"{cfg.tp_comm:g} x the forward matmuls). Buckets: 1-{cfg.short} positions under DP 2, the rest under "
            f"TP 2, microbatches of 1 row: elastic, as many as each step's rows need; fixed, {rows[0]} per device and "
            f"{rows[1]} (the most any step needs). Static: TP 2, {cfg.global_batch} microbatches of 1 row. Memory cap: "
            f"{cfg.cap_positions} positions through every layer per "
            f"device (DP 2 or PP 2 would need {cfg.seq_len}).",
            "",
            table,
            "",
            f"Best static layout that fits: {static['layout']}. gloo exchanges probed before each switching run: latency "
            f"per message {', '.join(f'{x * 1e6:.0f}' for x in probes['latency_s'])} us, bandwidth "
            f"{', '.join(f'{x / 1e9:.2f}' for x in probes['bandwidth_bytes_s'])} GB/s; local copies "
            f"{copy_bw / 1e9:.2f} GB/s, host work per block {per_block * 1e6:.0f} us. Predicted / measured switch "
            f"time: "
            + ", ".join(
                f"{r['layout']} {r['predicted_switch_s'] / r['switch_s']:.2f}" for r in results if "switch_s" in r
            )
            + ".",
            "",
            "",
        ]
    )
    payload = {
        "config": attrs.asdict(cfg),
        "device": spec,
        "fixed_bucket_microbatches": rows,
        "results": results,
        "runs": runs,
        "probes": probes,
    }
    return markdown, payload, results


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
@click.option("--out-dir", type=click.Path(file_okay=False, path_type=Path), default=B.RESULTS, show_default=True)
def main(quick: bool, network: str, out_dir: Path) -> None:
    if network == "auto":
        network = "testbed" if not quick and _testbed_available() else "loopback"
    elif network == "testbed" and not _testbed_available():
        sys.exit("hot_switch: --network testbed needs root and network namespaces (python -m bench.testbed check)")
    cfg = attrs.evolve(QUICK if quick else Config(), network=network)
    name = NAME + ("_testbed" if network == "testbed" else "")
    info, load_before = B.machine(), B.load_average()
    B.say("probing gloo exchanges and memory copies on this host")
    latency, bandwidth = exchange_probe(reps=5 if quick else 40, big=1 << 17)
    copy_bw, per_block = copy_costs(cfg, reps=3 if quick else 15)
    links = {
        "local": (0.0, copy_bw),
        "node": (latency, bandwidth),
        "domain": (latency, bandwidth),
        "cross_domain": (latency, bandwidth),
    }  # the static runs' pipeline sends; switching runs probe again
    sections, payloads = [], []
    base = cfg
    for tp_comm in base.scenarios:
        cfg = attrs.evolve(base, tp_comm=tp_comm)
        markdown, payload, results = scenario(cfg, links, copy_bw, per_block)
        sections.append(markdown)
        payloads.append(payload)
    load_after = B.load_average()
    title = (
        f"# Hot switching vs the best static layout ({'quick' if quick else 'full'}, emulated devices, "
        f"{'two testbed nodes' if network == 'testbed' else 'loopback'})"
    )
    markdown = "\n".join(
        [
            title,
            "",
            f"`{B.command_line()}`",
            "",
            *sections,
            f"Machine: {B.machine_line(info)}; {B.load_line(load_before, load_after)}.",
            "",
        ]
    )
    payload = {
        "machine": info,
        "load_before": load_before,
        "load_after": load_after,
        "p2p": {
            "latency_s": latency,
            "bandwidth_bytes_s": bandwidth,
            "copy_bytes_s": copy_bw,
            "per_block_s": per_block,
        },
        "scenarios": payloads,
        "results": [r for p in payloads for r in p["results"]],
    }  # every scenario's rows (see tp_comm)
    md, js = B.write_results(out_dir, name, markdown, payload)
    plot(payloads[0]["results"], out_dir / f"{name}.png")
    print(markdown)
    B.say(f"wrote {md}, {js}")


def _testbed_available() -> bool:
    from bench import testbed as T

    return os.geteuid() == 0 and T.available()[0]


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.6, 3.4), dpi=120)
    colors = ["#7a7a7a" if r["layout"].startswith("static") else "#2b7bba" for r in results]
    ax.bar(range(len(results)), [r["tokens_s"] for r in results], color=colors)
    for i, r in enumerate(results):
        ax.text(i, r["tokens_s"] * 1.02, f"{r['vs_best_static']:.2f}x", ha="center", fontsize=8)
    ax.set_xticks(range(len(results)), [r["layout"].replace("switching ", "switch\n") for r in results], fontsize=8)
    ax.set_ylabel("tokens / s (median)")
    ax.set_title("hot switching vs static layouts (2 emulated devices)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    main()
