"""The hot-switching step on one rank: each bucket of a step's documents under its own layout.

A step takes the documents ``documents.fill_documents`` draws (the ones a static layout with packing
trains on), sorts them into the layout's buckets by length and packs each bucket into rows of its
``max_len`` (``bucketing.bucket_rows``, top-up included; an elastic bucket's microbatch count follows its
rows). Then, shortest bucket first, every bucket with documents runs under its layout (a
*slot*: the bucket's plan, this rank's shards in it, its stage runner), the switch planner's
transfers moving state between slots: parameters always from the home layout (nothing has changed
them since its last optimizer step), accumulated gradients from the slot that ran before. After the
last bucket the gradients switch back to the home layout, where the training loop (train/loop.py) syncs them and steps AdamW.
A bucket without documents is skipped, without a switch. Each switch is one batched exchange (one
flat message per device pair, one ``batch_isend_irecv``: ``p2p.exchange``) and is traced as its own action
(``SWITCH>b1``).

The processes are the home layout's ranks; a bucket's groups are created once over them
(``groups.layout_groups``) and its routes are mapped to their world ranks. Every switch exchanges in one more
group over all of them (``groups.switch_group``), made after the buckets' at construction: on every rank in
the same order before the first step, so no switch creates a communicator (NCCL's are made then).
"""

from __future__ import annotations

import functools
import time

import attrs
import torch

from hetero_llm.comm import collectives, p2p
from hetero_llm.comm.groups import Comms, layout_groups, switch_group
from hetero_llm.comm.streams import Streams
from hetero_llm.data import documents
from hetero_llm.model.document_mask import DocumentMask
from hetero_llm.plan import Plan
from hetero_llm.plan.rank import StageRoutes
from hetero_llm.runtime import tensor_meter
from hetero_llm.runtime.emulation import Emulation
from hetero_llm.runtime.interpreter import Microbatch, StageRunner, Trace
from hetero_llm.switching.bucketing import bucket_rows, bucket_split
from hetero_llm.switching.transfers import SwitchPlan, Transfer, step_switch


@attrs.define(eq=False)
class Slot:
    """One layout on this rank: its plan, this rank's shards (name -> (dim, lo)), and its runner."""

    name: str
    plan: Plan
    rank: int | None  # this process's rank in ``plan``; None when the layout leaves its device idle
    params: dict[str, torch.Tensor]
    coords: dict[str, tuple[int, int]]
    runner: StageRunner | None
    dynamic: bool = False

    @property
    def contributes_loss(self) -> bool:
        """Whether this rank's summed loss is the one counted (last stage, TP rank 0)."""
        return self.rank is not None and self.plan.rank_plan(self.rank).counts_loss


class Switcher:
    """Runs the buckets of every step on one rank (see the module doc)."""

    def __init__(
        self,
        home: Plan,
        rank: int,
        comms: Comms,
        params: dict[str, torch.Tensor],
        coords: dict[str, tuple],
        home_runner: StageRunner,
        compute_of,
        trace: Trace | None,
        streams: Streams,
    ):
        lay = home.layout
        self.layout, self.trace = lay, trace
        self.device = comms.device
        self.me = home.ranks[rank].device_id
        self.world_rank = {r.device_id: r.rank for r in home.ranks}
        self.home = Slot(
            "home",
            home,
            rank,
            params,
            {n: (c[0] or 0, c[1]) for n, c in coords.items()},
            home_runner,
            home.rank_plan(rank).dynamic,
        )
        self.slots: list[Slot] = []
        for i, bucket in enumerate(lay.buckets):
            if not bucket.pipelines:
                self.slots.append(self.home)
                continue
            plan = home.buckets[i]  # compiled with the home plan
            self.slots.append(self._slot(f"b{i}", plan, comms, compute_of, streams))
        # every switch's exchange runs in one group made now, on every rank, after the buckets' (see switch_group)
        self._exchange = functools.partial(p2p.exchange, group=switch_group(home.rank_plan(rank), comms.device))
        self._plans: dict[tuple, SwitchPlan] = {}

    def _slot(self, name: str, plan: Plan, comms: Comms, compute_of, streams: Streams) -> Slot:
        mine = [r.rank for r in plan.ranks if r.device_id == self.me]
        rank = mine[0] if mine else None
        world_of = {r.rank: self.world_rank[r.device_id] for r in plan.ranks}
        rp = plan.rank_plan(rank) if rank is not None else None
        groups = layout_groups(plan.groups, rp, world_of)  # every rank, in order
        if rank is None or rp is None:  # the layout leaves this device idle
            return Slot(name, plan, None, {}, {}, None)
        params, coords = {}, {}
        for info, lo, hi in plan.params_of(rank):
            shape = list(info.shape)
            dim = info.shard_dim or 0
            shape[dim] = hi - lo
            params[info.name] = torch.zeros(shape, device=self.device, requires_grad=True)
            coords[info.name] = (dim, lo)
        st = plan.stage_of(rank)
        bucket_comms = Comms(
            comms.rank,
            comms.device,
            groups,
            groups[rp.tp_group] if rp.tp_group else None,
            tuple(world_of[r] for r in st.ranks),
        )
        routes = _world_routes(rp.routes, world_of)
        emulation = Emulation.from_env(comms.rank)
        tp_waits = collectives.TpWaits() if emulation.active else None
        runner = StageRunner(
            bucket_comms,
            params,
            st,
            plan.layout.model,
            collectives.tp_ops(bucket_comms, tp_waits),
            routes,
            self.trace,
            emulation,
            compute_of(rp),
            streams,
            split_backward=rp.split_backward,
            tp_waits=tp_waits,
        )
        return Slot(name, plan, rank, params, coords, runner, rp.dynamic)

    def copies(self) -> list[torch.Tensor]:
        """This rank's parameter shards of the bucket layouts: the copies beside the home layout's."""
        return [p for s in self.slots if s is not self.home for p in s.params.values()]

    # -- one step --------------------------------------------------------------------------------

    def step(self, step: int, source) -> tuple[torch.Tensor, int]:
        """Run every bucket of ``step``; leaves the summed gradients in the home parameters' ``.grad``.
        Returns this rank's share of the summed token loss and the step's target count."""
        lay = self.layout
        docs = documents.fill_documents(source, lay.train.seed, step, lay.train.global_batch, lay.model.seq_len)
        global_tokens = sum(len(d) - 1 for d in docs)
        loss = torch.zeros((), dtype=torch.float64, device=self.device)
        current, accumulated = self.home, False
        for index, (slot, rows) in enumerate(zip(self.slots, bucket_rows(lay, docs))):
            if rows is None:
                continue  # no documents: no switch either
            if slot is not current:
                self._switch(current, slot, accumulated)
            if slot.runner is not None:
                assert slot.rank is not None  # a slot has a runner when this device has a rank in its layout
                mbs, plan = self._work(index, slot, rows)
                run = (
                    slot.runner.run_dynamic(mbs, global_tokens)
                    if slot.dynamic
                    else slot.runner.run(plan.actions(slot.rank), mbs, global_tokens)
                )
                if slot.contributes_loss:
                    loss += run
                tensor_meter.checkpoint()  # the bucket's gradients beside its activations
            current, accumulated = slot, True
        if current is not self.home:
            self._switch(current, self.home, accumulated)
        return loss, global_tokens

    def _work(self, index: int, slot: Slot, rows: documents.PackedRows) -> tuple[list[Microbatch], Plan]:
        """This rank's microbatches of bucket ``index`` in this step, and the plan whose schedule runs them: the
        slot's, or for an elastic bucket one compiled for this step's microbatch count (once per count)."""
        elastic = self.layout.buckets[index].elastic
        assert slot.rank is not None  # step runs the slots this device has a rank in
        rounds, split = bucket_split(slot.plan.layout.pipelines, rows.num_rows, elastic)
        offset, size, count = split[slot.plan.ranks[slot.rank].pipeline]
        mbs = [
            Microbatch(
                torch.from_numpy(p.inputs), torch.from_numpy(p.targets), DocumentMask.from_spans(p.spans, p.positions)
            )
            for p in rows.share(offset, size, count)
        ]
        if not elastic or rounds == 1:
            return mbs, slot.plan
        return mbs, self.home.plan.buckets[index].for_rounds(rounds)

    # -- switches --------------------------------------------------------------------------------

    def _switch(self, source: Slot, target: Slot, grads: bool, params: bool = True) -> None:
        """Parameters from home into ``target``; with ``grads``, the accumulated gradients from ``source``."""
        t0 = time.perf_counter()
        params = params and target is not self.home  # home's own parameters never left it
        key = (source.name, target.name, grads, params)
        if key not in self._plans:
            self._plans[key] = step_switch(
                self.home.plan,
                source.plan,
                target.plan,
                params=params,
                grads=grads,
                source_name=source.name,
                target_name=target.name,
            )
        relayout(
            self._plans[key], self.me, self.world_rank, self.home, source, target, grads, self.device, self._exchange
        )
        if self.trace is not None:
            self.trace.append((f"SWITCH>{target.name}", t0, time.perf_counter()))
        if grads:
            release_gradients(source)


def relayout(
    plan: SwitchPlan,
    me: str,
    world_rank: dict[str, int],
    home: Slot,
    source: Slot,
    target: Slot,
    grads: bool,
    device: torch.device,
    exchange=p2p.exchange,
) -> None:
    """This device's (``me``) part of the switch ``plan``: parameters from ``home``, with ``grads`` the accumulated
    gradients from ``source`` (the target's gradient buffers zeroed first; the caller then ``release_gradients``);
    local blocks copied, each peer's blocks packed into one flat message, ``exchange``d, and unpacked. The
    benchmark's probe runs it with an ``exchange`` that sends nothing, to time a switch's host work as the switch
    does it."""
    moves = [(t, home) for t in plan.params] + [(t, source) for t in plan.grads]
    if grads:
        for p in target.params.values():
            p.grad = torch.zeros_like(p)
    sends: dict[int, list[tuple[Transfer, Slot]]] = {}
    receives: dict[int, list[Transfer]] = {}
    with torch.no_grad():
        for t, origin in moves:
            if t.src == me and t.dst == me:
                _apply(target, t, _block(origin, t))  # a local block: one pass, source view to target
            elif t.src == me:
                sends.setdefault(world_rank[t.dst], []).append((t, origin))
            elif t.dst == me:
                receives.setdefault(world_rank[t.src], []).append(t)
        send_flat = {}
        for peer, items in sends.items():  # each block written once, straight into the peer's flat message
            send_flat[peer] = flat = torch.empty(sum(t.nbytes // 4 for t, _ in items), device=device)
            for (t, origin), piece in zip(items, flat.split([t.nbytes // 4 for t, _ in items])):
                piece.view(_block_shape(origin, t)).copy_(_block(origin, t))
        recv_flat = {peer: torch.empty(sum(t.nbytes // 4 for t in ts), device=device) for peer, ts in receives.items()}
        exchange(send_flat, recv_flat)
        for peer, ts in receives.items():
            pieces = recv_flat[peer].split([t.nbytes // 4 for t in ts])
            for t, piece in zip(ts, pieces):
                _apply(target, t, piece.view(_block_shape(target, t)))


def release_gradients(source: Slot) -> None:
    """After a switch that moved the accumulated gradients out of ``source``: the tensor meter's checkpoint (the
    target's gradients beside the source's, a switch's most), then the source's released (the target holds them
    now). Outside the switch's traced time: the meter is a benchmark's instrument (0.3-0.8 ms a checkpoint on the
    bench's 2-core host), not a switch's work."""
    tensor_meter.checkpoint()
    for p in source.params.values():
        p.grad = None


def _world_routes(routes: StageRoutes, world_of: dict[int, int]) -> StageRoutes:
    def one(r):
        return None if r is None else attrs.evolve(r, src=world_of[r.src], dst=world_of[r.dst])

    return StageRoutes(
        one(routes.recv_f),
        tuple(map(one, routes.send_f)),
        one(routes.recv_b),
        tuple(map(one, routes.send_b)),
        routes.groups,
    )


def _block(slot: Slot, t: Transfer) -> torch.Tensor:
    """The block ``t`` moves, a view of ``slot``'s parameter (or of its accumulated gradient)."""
    dim, lo = slot.coords[t.name]
    p = slot.params[t.name]
    whole = p.detach() if not t.accumulate else (p.grad if p.grad is not None else torch.zeros_like(p))
    return whole.narrow(dim, t.lo - lo, t.hi - t.lo)


def _block_shape(slot: Slot, t: Transfer) -> tuple[int, ...]:
    dim, _ = slot.coords[t.name]
    shape = list(slot.params[t.name].shape)
    shape[dim] = t.hi - t.lo
    return tuple(shape)


def _apply(slot: Slot, t: Transfer, block: torch.Tensor) -> None:
    dim, lo = slot.coords[t.name]
    p = slot.params[t.name]
    if t.accumulate:
        assert p.grad is not None  # a switch with gradients zeroes the target's first (relayout)
        p.grad.narrow(dim, t.lo - lo, t.hi - t.lo).add_(block)
    else:
        p.detach().narrow(dim, t.lo - lo, t.hi - t.lo).copy_(block)
