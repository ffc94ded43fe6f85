"""The hot-switch planner: the transfers that re-lay out parameters and accumulated gradients from one
compiled plan to another over the same devices (HotSPa's switch, on our plans). Torch-free.

Devices, not ranks, are what two plans share: a device is ``node:index`` in both, whatever its rank.
Every parameter is cut at the shard boundaries of both plans (the finest common blocks, as gradient
sync cuts differently sharded replicas; ``plan.params_of`` gives the shard ranges). Then, per block:

- **Parameters** (equal on every holder): every destination holder gets the block; a device that held
  it before copies it locally, any other receives it from one source holder, chosen on the same node
  first, then in the same network domain, then anywhere; among equals the one with the fewest bytes
  assigned so far (HotSPa's NEW_GREEDY: least-loaded, intra-node first).
- **Gradients** (before the step's gradient sync, each TP group holds its *partial* sum; the TP copies of
  a replicated block inside a TP group are equal; the context-parallel ranks of a stage, one TP group each,
  hold the partials of their own positions, like replicas of the stage that saw different rows): each source
  TP group's partial goes to exactly one destination TP group, which adds it into every one of its holders of
  the block. So the sum over stages
  of the partials is preserved and the copies inside each destination stage stay equal, which is what
  the destination's gradient sync assumes. The destination stage chosen is the one that needs the fewest
  copies over the network (ideally one on the same devices), then the nearest (node before domain),
  then the least loaded.

Adjacent blocks with the same sender and receiver merge into one transfer; ``SwitchPlan.messages``
batches them per device pair (one grouped send/receive each).
"""

from __future__ import annotations

import math
from collections import defaultdict

import attrs

from hetero_llm.layout import Layout
from hetero_llm.model.params import ParamInfo, all_params
from hetero_llm.plan import Plan
from hetero_llm.switching import bucketing

FLOAT32_BYTES = 4  # parameters and accumulated gradients are float32 (master weights)
LINKS = ("local", "node", "domain", "cross_domain")  # where a transfer travels, cheapest first


@attrs.frozen
class Holder:
    """One device's shard [lo, hi) (along the shard dim) of one parameter in one plan."""

    device: str  # "node0:1"
    stage: (
        str  # its TP group's label in its plan ("p0.s1", "p0.s1.cp1" on CP rank 1): the TP copies of a block share it
    )
    lo: int
    hi: int


@attrs.frozen
class Transfer:
    """Block [lo, hi) along ``dim`` of parameter ``name`` (global coordinates), ``src`` -> ``dst`` devices.

    ``accumulate``: add into the destination (gradients, which start at zero there), else copy.
    """

    name: str
    dim: int
    lo: int
    hi: int
    src: str
    dst: str
    nbytes: int
    accumulate: bool

    @property
    def local(self) -> bool:
        return self.src == self.dst


@attrs.frozen
class SwitchPlan:
    """What a switch from ``source`` to ``target`` moves (see the module doc)."""

    source: str  # a name for each layout, for reports
    target: str
    params: tuple[Transfer, ...]
    grads: tuple[Transfer, ...]
    link_of: dict = attrs.field(eq=False, repr=False)  # (src, dst) device pair -> one of LINKS
    # device -> the target's parameter tensors there whose gradient buffers the switch allocates (zeroed) before
    # gradients are added in: every one of them when the switch moves gradients, else none
    grad_buffers: dict = attrs.field(factory=dict, eq=False, repr=False)

    @property
    def transfers(self) -> tuple[Transfer, ...]:
        return self.params + self.grads

    def messages(self) -> dict[tuple[str, str], list[Transfer]]:
        """The network transfers grouped per (sender, receiver) device pair, in a deterministic order: one
        batched send/receive each."""
        out: dict[tuple[str, str], list[Transfer]] = defaultdict(list)
        for t in self.transfers:
            if not t.local:
                out[(t.src, t.dst)].append(t)
        return dict(sorted(out.items()))

    def bytes_by_link(self) -> dict[str, int]:
        """Bytes moved over each kind of link (``LINKS``)."""
        out = dict.fromkeys(LINKS, 0)
        for t in self.transfers:
            out[self.link_of[(t.src, t.dst)]] += t.nbytes
        return out

    def bytes_by_device(self) -> dict[str, tuple[int, int]]:
        """(bytes sent, bytes received) over the network per device."""
        sent: dict[str, int] = defaultdict(int)
        received: dict[str, int] = defaultdict(int)
        for t in self.transfers:
            if not t.local:
                sent[t.src] += t.nbytes
                received[t.dst] += t.nbytes
        return {d: (sent[d], received[d]) for d in sorted(set(sent) | set(received))}

    def describe(self) -> str:
        """A few lines for ``--dry-run`` and the docs: bytes per link kind, messages, the busiest device."""
        links = self.bytes_by_link()
        lines = [
            f"switch {self.source} -> {self.target}: {len(self.params)} parameter and {len(self.grads)} "
            f"gradient transfers, {len(self.messages())} device-pair messages"
        ]
        lines.append("  " + ", ".join(f"{k} {_mib(v)}" for k, v in links.items()))
        per_device = self.bytes_by_device()
        if per_device:
            busiest = max(per_device, key=lambda d: max(per_device[d]))
            sent, received = per_device[busiest]
            lines.append(f"  busiest device {busiest}: sends {_mib(sent)}, receives {_mib(received)}")
        return "\n".join(lines)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def holders(plan: Plan) -> dict[str, list[Holder]]:
    """Every parameter's holders in ``plan``, in rank order."""
    out: dict[str, list[Holder]] = defaultdict(list)
    for r in plan.ranks:
        st = plan.stage_of(r.rank)
        label = st.label if st.cp == 1 else f"{st.label}.cp{r.cp_index}"  # each CP rank's TP group: its own partial
        for info, lo, hi in plan.params_of(r.rank):
            out[info.name].append(Holder(r.device_id, label, lo, hi))
    return out


def plan_switch(
    source: Plan, target: Plan, *, grads: bool = True, source_name: str = "", target_name: str = ""
) -> SwitchPlan:
    """The transfers that take ``source``'s parameters (and, with ``grads``, accumulated gradients) to
    ``target``'s layout. Both plans must be of the same model on the same cluster."""
    if source.layout.model != target.layout.model:
        raise ValueError("a switch needs two layouts of the same [model]")
    cluster = source.layout.cluster
    devices = [r.device_id for r in source.ranks] + [r.device_id for r in target.ranks]
    node_of = {d: d.partition(":")[0] for d in devices}
    domain_of = {d: cluster.domain_of(node_of[d]) for d in devices}

    def link(src: str, dst: str) -> str:
        if src == dst:
            return "local"
        if node_of[src] == node_of[dst]:
            return "node"
        return "domain" if domain_of[src] == domain_of[dst] else "cross_domain"

    order = {d: i for i, d in enumerate(dict.fromkeys(devices))}
    load: dict[str, int] = defaultdict(int)  # bytes each device has been given to send

    def sender(candidates: list[str], dst: str) -> str:
        best = min(candidates, key=lambda d: (LINKS.index(link(d, dst)), load[d], order[d]))
        return best

    src_holders, dst_holders = holders(source), holders(target)
    params, grad_moves = [], []
    stage_load: dict[str, int] = defaultdict(int)  # gradient bytes each target stage takes in
    for info in all_params(source.layout.model):
        dim = info.shard_dim or 0
        before, after = src_holders[info.name], dst_holders[info.name]
        cuts = sorted({x for h in before + after for x in (h.lo, h.hi)})
        for lo, hi in zip(cuts, cuts[1:]):
            nbytes = _block_bytes(info, dim, lo, hi)
            have = [h for h in before if h.lo <= lo and hi <= h.hi]
            need = [h for h in after if h.lo <= lo and hi <= h.hi]
            have_devices = list(dict.fromkeys(h.device for h in have))
            for h in need:
                src = h.device if h.device in have_devices else sender(have_devices, h.device)
                if src != h.device:
                    load[src] += nbytes
                params.append(Transfer(info.name, dim, lo, hi, src, h.device, nbytes, False))
            if grads:
                grad_moves += _move_partials(info.name, dim, lo, hi, nbytes, have, need, sender, load, stage_load, link)
    link_of = {(t.src, t.dst): link(t.src, t.dst) for t in params + grad_moves}
    buffers = {r.device_id: len(target.params_of(r.rank)) for r in target.ranks} if grads else {}
    return SwitchPlan(source_name, target_name, tuple(_merge(params)), tuple(_merge(grad_moves)), link_of, buffers)


def _move_partials(name, dim, lo, hi, nbytes, have, need, sender, load, stage_load, link) -> list[Transfer]:
    """Each source TP group's partial of block [lo, hi) into every holder of one target TP group (``Holder.stage``)."""
    by_stage_src: dict[str, list[str]] = defaultdict(list)
    for h in have:
        by_stage_src[h.stage].append(h.device)
    by_stage_dst: dict[str, list[str]] = defaultdict(list)
    for h in need:
        by_stage_dst[h.stage].append(h.device)
    out = []
    for _stage, src_devices in by_stage_src.items():

        def cost(target_stage: str) -> tuple[int, int, int]:
            # copies over the network, then how far they travel, then how much the stage already takes in
            far = [min(LINKS.index(link(s, d)) for s in src_devices) for d in by_stage_dst[target_stage]]  # noqa: B023
            return sum(f > 0 for f in far), sum(far), stage_load[target_stage]

        target_stage = min(by_stage_dst, key=cost)
        stage_load[target_stage] += nbytes
        for dst in by_stage_dst[target_stage]:
            src = dst if dst in src_devices else sender(src_devices, dst)
            if src != dst:
                load[src] += nbytes
            out.append(Transfer(name, dim, lo, hi, src, dst, nbytes, True))
    return out


def _block_bytes(info: ParamInfo, dim: int, lo: int, hi: int) -> int:
    return (hi - lo) * math.prod(info.shape) // info.shape[dim] * FLOAT32_BYTES


def _merge(transfers: list[Transfer]) -> list[Transfer]:
    """Adjacent blocks of one tensor with the same sender and receiver as one transfer."""
    out: list[Transfer] = []
    for t in sorted(transfers, key=lambda t: (t.name, t.src, t.dst, t.lo)):
        last = out[-1] if out else None
        if last is not None and (last.name, last.src, last.dst, last.hi) == (t.name, t.src, t.dst, t.lo):
            out[-1] = attrs.evolve(last, hi=t.hi, nbytes=last.nbytes + t.nbytes)
        else:
            out.append(t)
    return out


def step_switch(
    home: Plan, source: Plan, target: Plan, *, params: bool, grads: bool, source_name: str = "", target_name: str = ""
) -> SwitchPlan:
    """A switch inside a hot-switching step: parameters from ``home`` (no optimizer step has changed them since
    it took the last one, so every layout's copy equals home's), accumulated gradients from ``source``."""
    moved = plan_switch(source, target, grads=grads, source_name=source_name, target_name=target_name)
    if not params:
        return attrs.evolve(moved, params=())
    fresh = moved if source is home else plan_switch(home, target, grads=False)
    return attrs.evolve(moved, params=fresh.params, link_of={**moved.link_of, **fresh.link_of})


def _cp_lines(plan: Plan) -> list[str]:
    """A bucket's context-parallel groups and the positions of its rows each CP rank holds (``--dry-run``)."""
    out = []
    for st in plan.stages:
        if st.cp > 1:
            held = []
            for r in st.cp_ranks(0):
                ctx = plan.context(r)
                assert ctx is not None  # a rank of a cp > 1 stage
                (a, b), (c, d) = ctx.chunks
                held.append(f"{plan.ranks[r].device_id} {a}-{b - 1} + {c}-{d - 1}")
            out.append(f"    {st.label}: cp {st.cp} over rows of {plan.row_width}, positions held: " + ", ".join(held))
    return out


def describe_buckets(layout: Layout, home: Plan) -> str:
    """The ``--dry-run`` report of hot switching: each bucket's layout, and the switches of a step in which
    every bucket has documents (home -> shortest -> ... -> longest -> home; none between equal layouts):
    parameters from home, gradients from the layout before."""
    lines = ["hot switching buckets (shortest first; each runs under its own layout, the home layout takes the step):"]
    plans = list(home.buckets)  # compiled with the home plan
    low = 0
    for i, (bucket, plan) in enumerate(zip(layout.buckets, plans)):
        shape = " | ".join(
            "[" + ", ".join(str(st.tp) + (f" cp {st.cp}" if st.cp > 1 else "") for st in p.stages) + f"] x{p.batch}"
            for p in plan.layout.pipelines
        )
        where = "home layout" if not bucket.pipelines else f"{plan.world_size} ranks"
        unit = sum(bucketing.bucket_shares(plan.layout.pipelines, bucket.elastic))
        lines.append(
            f"  bucket {i}: documents of {low + 1}-{bucket.max_len} positions, rows of {bucket.max_len}, {where}, "
            f"schedule {plan.layout.train.schedule.value}, TP per stage (x share): {shape}"
            + (", elastic (as many microbatches as a step's rows need)" if bucket.elastic else "")
            + f"; a step's rows: its documents', in units of {unit}"
        )
        lines += _cp_lines(plan)
        low = bucket.max_len
    lines.append(_switch_communicators(layout, home, plans))
    names = ["home"] + [f"bucket {i}" for i in range(len(plans))] + ["home"]
    chain = [home] + plans + [home]
    for i, ((a, name_a), (b, name_b)) in enumerate(zip(zip(chain, names), zip(chain[1:], names[1:]))):
        if a.layout.pipelines == b.layout.pipelines:
            continue
        # nothing has accumulated before the first bucket; home's parameters never left it
        switch = step_switch(
            home,
            a,
            b,
            params=b.layout.pipelines != home.layout.pipelines,
            grads=i > 0,
            source_name=name_a,
            target_name=name_b,
        )
        lines.append(switch.describe())
    return "\n".join(lines)


def _switch_communicators(layout: Layout, home: Plan, plans: list[Plan]) -> str:
    """The communicators hot switching adds to the home layout's (``switcher.Switcher``), in their order."""
    made = [
        f"bucket {i}'s {len(p.groups)} group{'s' if len(p.groups) != 1 else ''}"
        for i, (b, p) in enumerate(zip(layout.buckets, plans))
        if b.pipelines
    ]
    return (
        "  communicators made after the home layout's (on every rank, in this order, before the first step): "
        + "".join(f"{m}, " for m in made)
        + f"then the switch group of all {home.world_size} ranks; each switch is one batched point-to-point "
        f"(batch_isend_irecv, {layout.cluster.backend.value}) in it"
    )
