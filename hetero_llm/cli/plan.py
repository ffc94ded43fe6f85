"""``hetero-plan``: parse, load, call the planner, print."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from hetero_llm.cli.common import OneLineCommand, version_option
from hetero_llm.errors import LayoutError
from hetero_llm.planner.profile import MAX_SPREAD, measure, noisiest, write


@click.command("hetero-plan", cls=OneLineCommand, context_settings={"help_option_names": ["-h", "--help"]})
@version_option("hetero-plan")
@click.argument("cluster_file", metavar="CLUSTER.toml", type=click.Path(dir_okay=False))
@click.option(
    "-o",
    "--out",
    "out",
    type=click.Path(dir_okay=False),
    help="Write the planned layout here (the cluster file without [plan], plus [[pipelines]]).",
)
@click.option("--explain", is_flag=True, help="Print the top plans side by side and why the best wins.")
@click.option("--top", type=int, default=3, show_default=True, help="Plans --explain and --json show.")
@click.option("--json", "as_json", is_flag=True, help="Print the ranked plans as JSON instead of text.")
@click.option(
    "--buckets",
    default="",
    metavar="128,512",
    help="Hot switching: also plan a layout per document-length bucket up to each bound (switching/propose.py).",
)
@click.option(
    "--profile",
    "profile_out",
    type=click.Path(dir_okay=False),
    help="Instead of planning: time one layer's and the head's forward and backward at the model's "
    "shapes on this machine's device and write (or add to) this profile file (needs torch).",
)
@click.option(
    "--kind",
    "profile_kind",
    default=None,
    help="With --profile: the device kind the times are recorded under (default: the kind of the "
    "cluster's nodes on this device, when they have one).",
)
@click.option(
    "--device",
    "profile_device",
    default=None,
    help="With --profile: the torch device to time on (default: cuda when torch sees one, else cpu).",
)
@click.option(
    "--max-spread",
    type=float,
    default=MAX_SPREAD,
    show_default=True,
    help="With --profile: refuse a measurement whose repeats vary more than this ((max - min) / median of any "
    "time): a busy machine's numbers would mislead the planner.",
)
@click.option(
    "--profile-file",
    type=click.Path(dir_okay=False),
    help="Read measured per-layer times from this profile (replaces [plan] profile).",
)
@click.option(
    "--evaluate",
    "evaluate_layout",
    type=click.Path(dir_okay=False),
    metavar="LAYOUT.toml",
    help="Instead of planning: the cost model's prediction for this layout on the cluster (step time, tokens/s, "
    "TFLOP/s per device, MFU, memory per device); with --json, as JSON.",
)
def main(
    cluster_file,
    out,
    explain,
    top,
    as_json,
    buckets,
    profile_out,
    profile_kind,
    profile_device,
    max_spread,
    profile_file,
    evaluate_layout,
):
    """Find the fastest layout for a heterogeneous cluster under the cost model, and write it."""
    from hetero_llm import api
    from hetero_llm.launch import outputs
    from hetero_llm.planner import load_cluster, output

    try:
        if profile_out is None:  # the options only measuring reads are refused, not silently ignored
            given = click.get_current_context().get_parameter_source
            for name in ("max_spread", "profile_kind", "profile_device"):
                if given(name) is not click.core.ParameterSource.DEFAULT:
                    option = {"max_spread": "--max-spread", "profile_kind": "--kind"}.get(name, "--device")
                    raise LayoutError(cluster_file, option, "only applies with --profile FILE (drop it, or measure)")
    except LayoutError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    if evaluate_layout is not None:
        _evaluate(cluster_file, evaluate_layout, profile_file, as_json)
        return
    try:
        if profile_out is not None:
            # what the cluster file reads is never written over (plan.profile is what --profile adds to)
            inputs = outputs.cluster_inputs(load_cluster(cluster_file), plan_profile=False)
            outputs.check_output_file("--profile", profile_out, inputs)
            click.echo(profile_command(cluster_file, profile_out, profile_kind, profile_device, max_spread))
            return
        if out is None and not (explain or as_json):
            raise LayoutError(
                cluster_file,
                "-o",
                "missing: name the layout file to write (-o LAYOUT.toml), print the plans with --explain or "
                "--json, or measure with --profile FILE",
            )
        planned = api.plan_cluster(
            cluster_file, out, top=top, buckets=buckets, profile_file=profile_file, progress=True
        )
    except LayoutError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    cluster, result, verdict, idle = planned.cluster, planned.result, planned.verdict, planned.idle
    if as_json:
        click.echo(
            json.dumps(
                {
                    "plans": [output.to_json(c, s) for c, s in result.ranked],
                    "idle": [{"device": d, "reason": why} for d, why in idle],
                    "evaluated": result.evaluated,
                    "seconds": result.seconds,
                    "cut_by_time": result.cut_by_time,
                    "seed_step_time": result.seed_score.step_time if result.seed_score else None,
                    "written": out,
                    "buckets": verdict.to_json() if verdict is not None else None,
                },
                indent=1,
            )
        )
        return
    click.echo(output.header(cluster, result.best, result.score, result.seed_score, result.cut_by_time).rstrip())
    for line in output.idle_lines(idle):
        click.echo(line)
    for line in verdict.lines() if verdict is not None else ():
        click.echo(line)
    if explain:
        click.echo("")
        click.echo(output.explain(cluster, result.ranked, result.seed_score))
    if result.cut_by_time:
        click.echo(f"\nNOTE: {output.cut_note(cluster)}")
    done = (
        f"wrote {out} (check it with: hetero-launch {out} --dry-run)"
        if out is not None
        else "wrote nothing (write the layout with -o LAYOUT.toml)"
    )
    click.echo(f"\nsearched {result.evaluated} plans in {result.seconds:.2f} s; {done}")


def profile_command(
    cluster_file: str, out: str, kind: str | None, device: str | None, max_spread: float = MAX_SPREAD
) -> str:
    """``hetero-plan CLUSTER --profile OUT``: measure on this machine and write (unless the repeats vary more
    than ``max_spread``); returns the summary line."""
    from hetero_llm.planner.cluster import load_cluster

    if not max_spread >= 0:
        raise LayoutError(cluster_file, "--max-spread", f"must be >= 0, got {max_spread:g}")
    cluster = load_cluster(cluster_file)
    if device is None or device.startswith("cuda"):
        torch = _torch(cluster_file)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise LayoutError(cluster_file, "--device", f"cannot time on '{device}': torch sees no CUDA device")
    dev_type = device.split(":")[0]
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
        kind = on_device[0]
    elif kind not in known:
        raise LayoutError(
            cluster_file, "--kind", f"no node of the cluster has kind {kind!r} (kinds: {', '.join(known)})"
        )
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
        times, info = measure(cluster.model, cluster.train.precision, device)
    except RuntimeError as e:  # an unknown device string, a device torch cannot use
        raise LayoutError(cluster_file, "--device", f"cannot time on '{device}': {e}") from None
    name, spread, (lo, mid, hi) = noisiest(info)
    if spread > max_spread:
        raise LayoutError(
            cluster_file,
            "--profile",
            f"the measurement is noisy: {name} ranged {lo * 1e3:.3g} / {mid * 1e3:.3g} / {hi * 1e3:.3g} ms "
            f"(min / median / max of {info['repeats']} repeats), a spread of {spread:.0%}, over --max-spread "
            f"{max_spread:.0%}; nothing written (rerun on an idle machine)",
        )
    write(out, cluster.model, cluster.train.precision, kind, times, info, previous)
    return (
        f"profiled kind '{kind}' on {info['device']} ({info['threads']} threads): layer forward "
        f"{times.layer_forward_s * 1e3:.3g} ms, backward {times.layer_backward_s * 1e3:.3g} ms; head forward "
        f"{times.head_forward_s * 1e3:.3g} ms, backward {times.head_backward_s * 1e3:.3g} ms per sequence "
        f"(medians of {info['repeats']} repeats; widest spread {spread:.0%}, {name}: min / median / max "
        f"{lo * 1e3:.3g} / {mid * 1e3:.3g} / {hi * 1e3:.3g} ms); "
        f'wrote {out} (use it: [plan] profile = "{out}" or --profile-file {out})'
    )


def _torch(cluster_file: str):
    try:
        import torch
    except ImportError:
        raise LayoutError(
            cluster_file, "--profile", "needs torch to measure (pip install torch); reading a profile does not"
        ) from None
    return torch


def _evaluate(cluster_file: str, layout_file: str, profile_file: str | None, as_json: bool) -> None:
    from hetero_llm import layout as layout_mod
    from hetero_llm.planner import evaluate, load_cluster

    try:
        cluster = load_cluster(cluster_file, profile_file)
        ev = evaluate.evaluate(cluster, layout_mod.load(layout_file), layout_file)
    except LayoutError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    click.echo(json.dumps(evaluate.to_json(ev), indent=1) if as_json else evaluate.describe(ev))


if __name__ == "__main__":
    main()
