"""``hetero-place``: Holmes' NIC-aware placement of a model on a cluster file (planner/place.py)."""

from __future__ import annotations

from pathlib import Path

import click

from hetero_llm import layout
from hetero_llm.cli.common import OneLineCommand, one_line_errors, version_option
from hetero_llm.launch import outputs


@click.command("hetero-place", cls=OneLineCommand, context_settings={"help_option_names": ["-h", "--help"]})
@version_option("hetero-place")
@click.argument("cluster_file", metavar="CLUSTER.toml", type=click.Path(dir_okay=False))
@click.option(
    "-o",
    "--out",
    "out",
    required=True,
    type=click.Path(dir_okay=False),
    help="Write the placed layout here (the cluster file plus [[pipelines]]).",
)
@click.option(
    "--pipelines",
    type=int,
    default=0,
    show_default="as many as the smallest domain allows",
    help="Data-parallel pipelines.",
)
@click.option("--tp", type=int, default=1, show_default=True, help="Devices per stage (inside one node).")
@click.option("--microbatches", type=int, default=0, show_default="2 x stages", help="Microbatches per pipeline.")
def main(cluster_file, out, pipelines, tp, microbatches):
    """Place a model on a cluster NIC-aware (Holmes): TP in a node, DP in a domain, stages across domains."""
    from hetero_llm.planner import place

    with one_line_errors():
        sections = layout.read_cluster_file(cluster_file, "placement")[2]
        outputs.check_output_file(
            "--out",
            out,
            [
                ("the cluster file", cluster_file),  # nor the files it names
                *outputs.spec_inputs(sections["model"], sections["data"], Path(cluster_file).parent),
            ],
        )
        placement = place.place_file(cluster_file, out, place.PlaceOptions(pipelines, tp, microbatches))
    click.echo(place.report(placement))
    click.echo(f"\nwrote {out} (check it with: hetero-launch {out} --dry-run)")


if __name__ == "__main__":
    main()
