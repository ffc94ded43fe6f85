"""What the simulator predicts for a run of the hot-switching bench (``python -m bench.hot_switch.hot_switch``): the
switches its trace shows and its whole steps, switching or static, with the links and costs the bench probed.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from bench.hot_switch.hot_switch_config import Config


def predicted(
    cfg: Config, layout: Path, trace: Path, links: dict, probe: dict, device
) -> tuple[list[float], list[float]]:
    """Per step of the trace: ``predict.switch_seconds`` of the switches the step made, and
    ``predict.simulate_buckets``' whole step (for switching layouts), with ``probe``'s link (latency, bandwidth:
    every network link kind) and host costs (copy bandwidth, per block, per gradient buffer:
    ``hot_switch_probes.HostCosts``) over ``links``."""
    link = (probe["latency_s"], probe["bandwidth_bytes_s"])
    links = {**links, "node": link, "domain": link, "cross_domain": link}
    h = probe["host"]
    host = (h["copy_bandwidth"], h["block_overhead"], h["buffer_overhead"])
    from hetero_llm import layout as layout_mod
    from hetero_llm.switching import predict

    lay = layout_mod.load(layout)
    switches: list[float] = []
    for first, switch in trace_switch_plans(layout, trace):
        if first:
            switches.append(0.0)
        switches[-1] += predict.switch_seconds(switch, links, *host)
    steps = [
        predict.simulate_buckets(
            lay, s, device, links, copy_bandwidth=host[0], block_overhead=host[1], buffer_overhead=host[2]
        ).total
        for s in range(cfg.steps)
    ]
    return switches, steps


def trace_switch_plans(layout: Path, trace: Path) -> list[tuple[bool, object]]:
    """The switches a run made, in its trace's order (rank 0's ``SWITCH>...`` actions; every rank makes the same):
    (whether it is its step's first, its ``switch.SwitchPlan`` as the switcher made it: parameters from home into a
    bucket, the gradients when a bucket ran before it)."""
    from hetero_llm import layout as layout_mod
    from hetero_llm.plan import compile_plan
    from hetero_llm.predict import trace as tracing
    from hetero_llm.switching.transfers import step_switch

    lay = layout_mod.load(layout)
    home = compile_plan(lay)
    plans = {"home": home, **{f"b{i}": p for i, p in enumerate(home.buckets) if lay.buckets[i].pipelines}}
    out: list[tuple[bool, object]] = []
    current, ran = "home", False
    for e in tracing.read_rank_traces(trace)[0]["events"]:
        name = e["action"]
        if not name.startswith("SWITCH"):
            ran = ran or name[0] in "FBIW"
            continue
        target = name.split(">", 1)[1]
        first = current == "home"  # a step's first switch (a step starts and ends under home)
        if first:
            ran = False
        out.append((first, step_switch(home, plans[current], plans[target], params=target != "home", grads=ran)))
        current = target
    return out


def switch_peers(layout: Path, trace: Path) -> list[dict[int, set[int]]]:
    """Per switch of the run (``trace_switch_plans``): each rank's peers, the ranks it sends to or receives from in
    that switch (none for a rank whose part is local copies only: it waits for nobody)."""
    from hetero_llm import layout as layout_mod
    from hetero_llm.plan import compile_plan

    rank_of = {r.device_id: r.rank for r in compile_plan(layout_mod.load(layout)).ranks}
    out = []
    for _, switch in trace_switch_plans(layout, trace):
        peers: dict[int, set[int]] = {r: set() for r in rank_of.values()}
        for src, dst in switch.messages():
            peers[rank_of[src]].add(rank_of[dst])
            peers[rank_of[dst]].add(rank_of[src])
        out.append(peers)
    return out


def predicted_static(cfg: Config, layout: Path, links: dict, device) -> list[float]:
    """``predict.simulate_buckets`` of the static layout as one bucket under the home layout (the same
    documents, packed first-fit decreasing into the global batch's rows as the static run packs them)."""
    from hetero_llm import layout as layout_mod
    from hetero_llm.switching import predict

    one = layout.with_name(layout.stem + "_one_bucket.toml")
    static = layout_mod.load(layout)
    layout_mod.dump(
        attrs.evolve(static, buckets=(layout_mod.BucketSpec(max_len=cfg.seq_len),)), one, relative_to=one.parent
    )
    lay = layout_mod.load(one)
    return [predict.simulate_buckets(lay, s, device, links).total for s in range(cfg.steps)]
