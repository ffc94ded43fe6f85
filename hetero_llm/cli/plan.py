"""``hetero-plan``: parse, load, call the planner, print."""

from __future__ import annotations

import json

import click

from hetero_llm.cli.common import OneLineCommand, one_line_errors, version_option
from hetero_llm.errors import LayoutError
from hetero_llm.planner.profile import MAX_SPREAD


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

    with one_line_errors():
        if profile_out is None:  # the options only measuring reads are refused, not silently ignored
            given = click.get_current_context().get_parameter_source
            for name in ("max_spread", "profile_kind", "profile_device"):
                if given(name) is not click.core.ParameterSource.DEFAULT:
                    option = {"max_spread": "--max-spread", "profile_kind": "--kind"}.get(name, "--device")
                    raise LayoutError(cluster_file, option, "only applies with --profile FILE (drop it, or measure)")
        if evaluate_layout is not None:
            _evaluate(cluster_file, evaluate_layout, profile_file, as_json)
            return
        if profile_out is not None:
            click.echo(
                _profiled(api.profile_cluster(cluster_file, profile_out, profile_kind, profile_device, max_spread))
            )
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
    if as_json:
        click.echo(json.dumps(planned.to_json(), indent=1))
    else:
        click.echo(_report(planned, explain))


def _report(planned, explain: bool) -> str:
    """What ``hetero-plan`` prints: the best plan, the idle devices, the buckets' verdict, with ``explain`` the top
    plans side by side, and what was searched and written."""
    from hetero_llm.planner import output

    cluster, result, verdict, out = planned.cluster, planned.result, planned.verdict, planned.out
    lines = [output.header(cluster, result.best, result.score, result.seed_score, result.cut_by_time).rstrip()]
    lines += output.idle_lines(planned.idle)
    lines += verdict.lines() if verdict is not None else ()
    if explain:
        lines += ["", output.explain(cluster, result.ranked, result.seed_score)]
    if result.cut_by_time:
        lines.append(f"\nNOTE: {output.cut_note(cluster)}")
    done = (
        f"wrote {out} (check it with: hetero-launch {out} --dry-run)"
        if out is not None
        else "wrote nothing (write the layout with -o LAYOUT.toml)"
    )
    lines.append(f"\nsearched {result.evaluated} plans in {result.seconds:.2f} s; {done}")
    return "\n".join(lines)


def _profiled(p) -> str:
    """The line ``hetero-plan --profile`` prints: the times measured and where they went."""
    times, info, (name, spread, (lo, mid, hi)) = p.times, p.info, p.noisiest
    return (
        f"profiled kind '{p.kind}' on {info['device']} ({info['threads']} threads): layer forward "
        f"{times.layer_forward_s * 1e3:.3g} ms, backward {times.layer_backward_s * 1e3:.3g} ms; head forward "
        f"{times.head_forward_s * 1e3:.3g} ms, backward {times.head_backward_s * 1e3:.3g} ms per sequence "
        f"(medians of {info['repeats']} repeats; widest spread {spread:.0%}, {name}: min / median / max "
        f"{lo * 1e3:.3g} / {mid * 1e3:.3g} / {hi * 1e3:.3g} ms); "
        f'wrote {p.out} (use it: [plan] profile = "{p.out}" or --profile-file {p.out})'
    )


def _evaluate(cluster_file: str, layout_file: str, profile_file: str | None, as_json: bool) -> None:
    """``--evaluate LAYOUT``: the cost model's prediction for a layout on the cluster, printed."""
    from hetero_llm import layout as layout_mod
    from hetero_llm.planner import evaluate, load_cluster

    ev = evaluate.evaluate(load_cluster(cluster_file, profile_file), layout_mod.load(layout_file), layout_file)
    click.echo(json.dumps(evaluate.to_json(ev), indent=1) if as_json else evaluate.describe(ev))


if __name__ == "__main__":
    main()
