"""The command line: ``python -m bench.testbed check | demo | up | cleanup`` (and the hidden programs the
testbed runs inside its namespaces: the delay relay and the TCP probe)."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import click

from bench.testbed.bed import Testbed
from bench.testbed.netns import PREFIX, available, cleanup, list_namespaces, relay
from bench.testbed.spec import DelayMode, Fabric, grid_spec
from bench.testbed.tcp_probe import PROBE_PORT, PathMeasurement, _probe_client, _probe_serve, measure


def _fmt_rate(bits_per_s: float) -> str:
    return f"{bits_per_s / 1e9:.2f} Gbit/s" if bits_per_s >= 1e9 else f"{bits_per_s / 1e6:.1f} Mbit/s"


def _fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _grid_options(f: Any) -> Any:
    for opt in reversed(
        [
            click.option("--domains", default=2, show_default=True, help="number of domains"),
            click.option("--nodes-per-domain", default=2, show_default=True, help="nodes in each domain"),
            click.option("--bandwidth", default="1gbit", show_default=True, help="domain fabric rate (tc units)"),
            click.option("--delay", default="0.2ms", show_default=True, help="domain fabric one-way latency"),
            click.option("--cross-bandwidth", default="100mbit", show_default=True, help="cross-domain fabric rate"),
            click.option("--cross-delay", default="5ms", show_default=True, help="cross-domain fabric one-way latency"),
            click.option(
                "--delay-mode",
                type=click.Choice([m.value for m in DelayMode]),
                default="auto",
                show_default=True,
                help="how delay is made",
            ),
        ]
    ):
        f = opt(f)
    return f


def format_nodes(tb: Testbed) -> str:
    rows = [("node", "namespace", "domain", "dom0", "xdom", "speed")]
    rows += [
        (
            n.name,
            tb.namespace(n.name),
            n.domain,
            tb.address(n.name, Fabric.DOMAIN),
            tb.address(n.name, Fabric.CROSS),
            f"{n.speed:g}",
        )
        for n in tb.spec.nodes
    ]
    return _table(rows)


def format_measurements(tb: Testbed, results: list[PathMeasurement]) -> str:
    """One row per path: what was configured next to what TCP saw."""
    rows = [("path", "fabric", "bandwidth", "delay (one-way)", "RTT floor", "RTT (median)", "TCP goodput")]
    for m in results:
        spec = tb.fabric(m.src, m.fabric)
        label = f"domain {tb.spec.node(m.src).domain}" if m.fabric is Fabric.DOMAIN else "cross-domain"
        measured = (_fmt_ms(m.rtt_s), _fmt_rate(m.bits_per_s))
        rows.append((f"{m.src} -> {m.dst}", label, spec.bandwidth, spec.delay, _fmt_ms(2 * spec.delay_s), *measured))
    return _table(rows)


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


@click.group()
def main() -> None:
    """Emulated multi-domain cluster on one machine (network namespaces + veth + bridges + tc)."""


@main.command()
def check() -> None:
    """Say whether this host can build a testbed (exit 0) or why not (exit 1)."""
    ok, why = available()
    click.echo(("ok: " if ok else "unavailable: ") + why)
    sys.exit(0 if ok else 1)


@main.command()
@_grid_options
@click.option("--seconds", default=1.0, show_default=True, help="length of each bulk transfer")
def demo(delay_mode: str, seconds: float, **grid: Any) -> None:
    """Build a cluster, measure RTT and TCP goodput inside a domain and across domains, tear down."""
    spec = grid_spec(**grid)
    _exit_if_unavailable()
    with Testbed(spec, delay=delay_mode) as tb:
        click.echo(f"testbed {tb.run_id}: delay by {tb.delay_mode.value}\n{format_nodes(tb)}\n")
        first = spec.nodes[0].name
        same = next((n.name for n in spec.nodes[1:] if n.domain == spec.nodes[0].domain), None)
        other = next((n.name for n in spec.nodes if n.domain != spec.nodes[0].domain), None)
        paths = ([(same, Fabric.DOMAIN)] if same else []) + ([(other, Fabric.CROSS)] if other else [])
        results = []
        for dst, fabric in paths:
            click.echo(f"measuring {first} -> {dst} over {fabric.interface} ...", err=True)
            results.append(measure(tb, first, dst, fabric, seconds=seconds))
        click.echo(format_measurements(tb, results))
    click.echo(f"torn down; namespaces left from {tb.run_id}: {len(list_namespaces(PREFIX + tb.run_id))}")


@main.command()
@_grid_options
def up(delay_mode: str, **grid: Any) -> None:
    """Build a cluster and keep it until Ctrl-C (then tear down); poke at it with `ip netns exec`."""
    spec = grid_spec(**grid)
    _exit_if_unavailable()
    with Testbed(spec, delay=delay_mode) as tb:
        click.echo(f"testbed {tb.run_id}: delay by {tb.delay_mode.value}\n{format_nodes(tb)}")
        click.echo(f"\ne.g. ip netns exec {tb.namespace(spec.nodes[0].name)} python3 ...   (Ctrl-C tears down)")
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


@main.command("cleanup")
@click.option(
    "--all", "all_runs", is_flag=True, help=f"remove every '{PREFIX}' namespace (also those of runs still going)"
)
@click.option("--run", "run_id", default=None, help="remove the namespaces of this run id only")
def cleanup_command(all_runs: bool, run_id: str | None) -> None:
    """Remove namespaces (and their links and processes) left by killed runs."""
    if all_runs == (run_id is not None):
        raise click.UsageError("give exactly one of --all or --run RUN_ID")
    removed = cleanup(None if all_runs else run_id)
    click.echo(f"removed {len(removed)} namespace(s)" + (": " + ", ".join(removed) if removed else ""))


@main.command("relay", hidden=True)
@click.option("--pair", "pairs", multiple=True, required=True, help="IF_A,IF_B,DELAY_S")
def relay_command(pairs: tuple[str, ...]) -> None:
    relay([(a, b, float(d)) for a, b, d in (p.split(",") for p in pairs)])


@main.group(hidden=True)
def probe() -> None:
    """The measuring programs run inside the namespaces."""


@probe.command()
@click.option("--bind", required=True)
@click.option("--port", default=PROBE_PORT)
def serve(bind: str, port: int) -> None:
    _probe_serve(bind, port)


@probe.command()
@click.option("--to", "addr", required=True)
@click.option("--port", default=PROBE_PORT)
@click.option("--rounds", default=20)
@click.option("--seconds", default=1.0)
def client(addr: str, port: int, rounds: int, seconds: float) -> None:
    click.echo(json.dumps(_probe_client(addr, port, rounds, seconds)))


def _exit_if_unavailable() -> None:
    ok, why = available()
    if not ok:
        click.echo(f"error: cannot build a testbed here: {why}", err=True)
        sys.exit(2)
