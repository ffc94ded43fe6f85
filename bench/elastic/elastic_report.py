"""The results of bench/elastic/elastic.py: its markdown report and its loss plot."""

from __future__ import annotations

from pathlib import Path

from bench.common import benchlib as B


def report(setup: dict, info, before, after, recoveries, per_round, cost, worst, continuous) -> str:
    """The results' markdown; ``setup``: the run's ``name``, ``gflops`` per node, ``link`` (Gbit/s, us), ``saves``
    (--checkpoint-every, --snapshot-every), ``steps``, ``at`` (the steps n2 is lost and back after), ``testbed``
    and ``cut`` (n2 lost by cutting its link, not by killing it)."""
    gbps, us = setup["link"]
    testbed, cut, at, steps = setup["testbed"], setup["cut"], setup["at"], setup["steps"]
    where = (
        f"the netns testbed (bench/testbed/: each node a network namespace, its torchrun agent and workers inside, "
        f"one domain of veth links shaped to {gbps:g} Gbit/s and {us:g} us one way)"
        if testbed
        else "one machine (every agent on loopback)"
    )
    speeds = ", ".join(f"{n} {g:g}" for n, g in setup["gflops"].items())
    lost = "cut off (its link down: its processes live on, a hang)" if cut else "killed (agent and workers, SIGKILL)"
    verdict = "met" if all(r["recovery_s"] <= 15 for r in recoveries) else "MISSED"
    close = "met" if all(abs(r["ratio"] - 1) <= 0.10 for r in per_round) else "MISSED"
    lines = [
        *B.report_head(setup["name"], info, before, after),
        f"Mode: emulated nodes on {where}; emulated devices (HETERO_EMULATE_DEVICE, GFLOP/s per device: {speeds}; "
        f"the planner's [plan.kinds] say the same, priced by FLOPs; links {gbps:g} Gbit/s, {us:g} us declared), "
        f"{steps} steps, node n2 {lost} after step {at[0]} and started again after step {at[1]}; "
        f"--checkpoint-every {setup['saves'][0]} --snapshot-every {setup['saves'][1]}.",
        "",
        f"## Recoveries (target <= 15 s excluding redone steps: {verdict})",
        "",
        B.markdown_table(
            [
                "event",
                "members after",
                "join s (training goes on)",
                "detection s",
                "restart s (rendezvous + worker start)",
            ]
            + ["planning s", "restore s", "recovery s", "resumed at step", "steps redone"],
            [
                [
                    what,
                    r["members"],
                    B.fmt(r["join_s"]),
                    B.fmt(r["detection_s"]),
                    f"{B.fmt(r['restart_s'])} ({B.fmt(r['rendezvous_s'])} + {B.fmt(r['worker_start_s'])})",
                    B.fmt(r["planning_s"]),
                    B.fmt(r["restore_s"]),
                ]
                + [B.fmt(r["recovery_s"]), r["resumed_at"], r["steps_redone"]]
                for what, r in zip(("n2 cut off" if cut else "n2 killed", "n2 back"), recoveries)
            ],
        ),
        "",
        f"## tokens/s per membership vs the planner's prediction (target within 10%: {close})",
        "",
        "Measured: the median over the round's steps but its first (which includes the round's start).",
        "",
        B.markdown_table(
            [
                "members",
                "plan",
                "steps",
                "measured tokens/s",
                "predicted tokens/s",
                "ratio",
                "step s (measured, predicted)",
            ],
            [
                [r["members"], f"{r['plan']} ({r['shape']})", r["steps"], B.fmt(r["tokens_s"])]
                + [B.fmt(r["predicted_tokens_s"]), f"{r['ratio']:.3f}"]
                + [f"{r['measured_step_s']:.3f}, {r['predicted_step_s']:.3f}"]
                for r in per_round
            ],
        ),
        "",
    ]
    if cost:
        lines += [
            "## What a save every step costs (one-process run of the reference model, wall time vs no save)",
            "",
            B.markdown_table(
                ["saved into", "runs", "ms per step"],
                [[c["where"], c["runs"], B.fmt(c["save_ms_per_step"])] for c in cost],
            ),
            "",
        ]
    lines.append(
        f"Losses vs the one-process run: max relative difference {worst:.2e} over {steps} steps; "
        f"steps 1..{steps} each recorded once: {continuous}."
    )
    return "\n".join(lines)


def plot(rows: list[dict], ref: list[float], recoveries: list[dict], path: Path, lost: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    steps = [r["step"] for r in rows]
    ax.plot(steps, ref, "k-", label="one process, uninterrupted")
    ax.plot(steps, [r["loss"] for r in rows], "o", mfc="none", label=f"elastic: {lost}, then back")
    for rec, what in zip(recoveries, (lost, "n2 back")):
        ax.axvline(rec["resumed_at"] + 0.5, color="grey", ls=":")
        ax.text(rec["resumed_at"] + 0.6, max(ref), what, fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
