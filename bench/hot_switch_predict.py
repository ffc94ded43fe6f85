"""What the simulator predicts for a run of the hot-switching bench (``python -m bench.hot_switch``): the
switches its trace shows and its whole steps, switching or static, with the links and costs the bench probed.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from bench.hot_switch_config import Config


def predicted(
    cfg: Config, layout: Path, trace: Path, links: dict, probe: dict, device
) -> tuple[list[float], list[float]]:
    """Per step of the trace: ``bucket_sim.switch_seconds`` of the switches the step made, and
    ``bucket_sim.simulate_buckets``' whole step (for switching layouts), with ``probe``'s link (latency, bandwidth:
    every network link kind) and host costs (copy bandwidth, per block, per gradient buffer:
    ``hot_switch_probes.HostCosts``) over ``links``."""
    link = (probe["latency_s"], probe["bandwidth_bytes_s"])
    links = {**links, "node": link, "domain": link, "cross_domain": link}
    h = probe["host"]
    host = (h["copy_bandwidth"], h["block_overhead"], h["buffer_overhead"])
    from hetero_llm import layout as layout_mod
    from hetero_llm.plan import compile_plan
    from hetero_llm.predict import trace as tracing
    from hetero_llm.switching import predict as bucket_sim
    from hetero_llm.switching.transfers import bucket_plans, step_switch

    lay = layout_mod.load(layout)
    home = compile_plan(lay)
    plans = {"home": home, **{f"b{i}": p for i, p in enumerate(bucket_plans(lay)) if lay.buckets[i].pipelines}}
    events = tracing.read_rank_traces(trace)[0]["events"]
    switches: list[float] = []
    current, ran = "home", False
    for e in events:
        name = e["action"]
        if not name.startswith("SWITCH"):
            ran = ran or name[0] in "FBIW"
            continue
        target = name.split(">", 1)[1]
        if current == "home":  # a step's first switch (a step starts and ends under home)
            switches.append(0.0)
            ran = False
        switch = step_switch(home, plans[current], plans[target], params=target != "home", grads=ran)
        switches[-1] += bucket_sim.switch_seconds(switch, links, *host)
        current = target
    steps = [
        bucket_sim.simulate_buckets(
            lay, s, device, links, copy_bandwidth=host[0], block_overhead=host[1], buffer_overhead=host[2]
        ).total
        for s in range(cfg.steps)
    ]
    return switches, steps


def predicted_static(cfg: Config, layout: Path, links: dict, device) -> list[float]:
    """``bucket_sim.simulate_buckets`` of the static layout as one bucket under the home layout (the same
    documents, packed first-fit decreasing into the global batch's rows as the static run packs them)."""
    from hetero_llm import layout as layout_mod
    from hetero_llm.switching import predict as bucket_sim

    one = layout.with_name(layout.stem + "_one_bucket.toml")
    static = layout_mod.load(layout)
    layout_mod.dump(
        attrs.evolve(static, buckets=(layout_mod.BucketSpec(max_len=cfg.seq_len),)), one, relative_to=one.parent
    )
    lay = layout_mod.load(one)
    return [bucket_sim.simulate_buckets(lay, s, device, links).total for s in range(cfg.steps)]
