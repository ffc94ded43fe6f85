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

**One parameter storage for every bucket layout.** A rank's shards of every bucket layout are views into one
flat float32 buffer (``Switcher.storage``), sized to the largest of them; the home layout keeps its own (it holds
the parameters between steps). Only one bucket layout runs at a time, and a switch takes its parameters from
home, never from the layout before, so the next layout may overwrite the last one's: a rank holds home's
shards and one bucket layout's, whatever the number of buckets. Gradients live in one layout at a time (a
switch allocates the target's and then releases the source's).

**Context parallelism in a bucket.** A bucket's stage may have its own ``cp``: its plan is compiled for rows of
the bucket's ``max_len`` (``Plan.row_width``: the zigzag chunks and re-chunking boundaries cut those), its CP
ranks hold the stage's parameters like replicas and take their columns of every microbatch
(``context_rows.context_columns``). A bucket under a context-parallel home layout runs home's parameters through
a runner of its own (the home stages compiled for its rows' width), without a switch.
"""

from __future__ import annotations

import functools
import math
import time

import attrs
import torch

from hetero_llm.comm import collectives, p2p
from hetero_llm.comm.groups import Comms, layout_groups, switch_group
from hetero_llm.comm.ring import Ring
from hetero_llm.comm.streams import Streams
from hetero_llm.data import documents
from hetero_llm.model.document_mask import DocumentMask
from hetero_llm.plan import Plan
from hetero_llm.plan.rank import StageRoutes
from hetero_llm.runtime import context_rows, tensor_meter
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
    ring: Ring | None = None  # this rank's context-parallel ring in the layout (None: its stage has cp 1)
    home_like: bool = False  # the home layout's parameters, on rows of another width: no switch into or out of it

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
            context_rows.ring_of(home.rank_plan(rank), comms),
        )
        home_cp = any(st.cp > 1 for st in home.stages)  # home's plan cuts rows of seq_len: a narrower bucket's own
        # One flat buffer for every bucket layout's shards on this device: the largest layout's (module doc)
        self.storage = torch.zeros(
            max([_numel(p, self.me) for b, p in zip(lay.buckets, home.buckets) if b.pipelines] + [0]),
            device=self.device,
        )
        self.slots: list[Slot] = []
        for i, bucket in enumerate(lay.buckets):
            if not bucket.pipelines and not (home_cp and bucket.max_len != lay.model.seq_len):
                self.slots.append(self.home)
                continue
            plan = home.buckets[i]  # compiled with the home plan
            self.slots.append(self._slot(f"b{i}", plan, comms, compute_of, streams, home_like=not bucket.pipelines))
        # every switch's exchange runs in one group made now, on every rank, after the buckets' (see switch_group)
        self._exchange = functools.partial(p2p.exchange, group=switch_group(home.rank_plan(rank), comms.device))
        self._plans: dict[tuple, SwitchPlan] = {}

    def _slot(self, name: str, plan: Plan, comms: Comms, compute_of, streams: Streams, home_like: bool = False) -> Slot:
        mine = [r.rank for r in plan.ranks if r.device_id == self.me]
        rank = mine[0] if mine else None
        world_of = {r.rank: self.world_rank[r.device_id] for r in plan.ranks}
        rp = plan.rank_plan(rank) if rank is not None else None
        groups = layout_groups(plan.groups, rp, world_of)  # every rank, in order
        if rank is None or rp is None:  # the layout leaves this device idle
            return Slot(name, plan, None, {}, {}, None)
        if home_like:  # home's parameters themselves (the same plan's shards, at the same ranks)
            params, coords = self.home.params, self.home.coords
        else:
            params, coords = self._views(plan, rank)
        st = plan.stage_of(rank)
        bucket_comms = Comms(
            comms.rank,
            comms.device,
            groups,
            groups[rp.tp_group] if rp.tp_group else None,
            tuple(world_of[r] for r in st.ranks),
        )
        ring = context_rows.ring_of(rp, bucket_comms)
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
            ring=ring,
        )
        return Slot(name, plan, rank, params, coords, runner, rp.dynamic, ring, home_like)

    def _views(self, plan: Plan, rank: int) -> tuple[dict[str, torch.Tensor], dict[str, tuple[int, int]]]:
        """``rank``'s shards of ``plan`` as views into the shared storage, from its start (module doc)."""
        params, coords, offset = {}, {}, 0
        for info, lo, hi in plan.params_of(rank):
            shape = list(info.shape)
            dim = info.shard_dim or 0
            shape[dim] = hi - lo
            n = math.prod(shape)
            params[info.name] = self.storage.narrow(0, offset, n).view(shape).requires_grad_(True)
            coords[info.name] = (dim, lo)
            offset += n
        return params, coords

    def copies(self) -> list[torch.Tensor]:
        """This rank's parameter shards of the bucket layouts beside the home layout's: views of one storage
        (the tensor meter counts a storage once), and their gradients while a layout holds them."""
        return [self.storage] + [
            p for s in self.slots if not s.home_like and s is not self.home for p in s.params.values()
        ]

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
            if self._held(slot) is not current:
                self._switch(current, self._held(slot), accumulated)
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
            current, accumulated = self._held(slot), True
        if current is not self.home:
            self._switch(current, self.home, accumulated)
        return loss, global_tokens

    def _held(self, slot: Slot) -> Slot:
        """The slot whose parameters ``slot`` runs: home for a home-like one (no switch into it), else itself."""
        return self.home if slot.home_like else slot

    def _work(self, index: int, slot: Slot, rows: documents.PackedRows) -> tuple[list[Microbatch], Plan]:
        """This rank's microbatches of bucket ``index`` in this step, and the plan whose schedule runs them: the
        slot's, or for an elastic bucket one compiled for this step's microbatch count (once per count)."""
        elastic = self.layout.buckets[index].elastic
        assert slot.rank is not None  # step runs the slots this device has a rank in
        rounds, split = bucket_split(slot.plan.layout.pipelines, rows.num_rows, elastic)
        offset, size, count = split[slot.plan.ranks[slot.rank].pipeline]
        mbs = [_microbatch(p, slot.ring) for p in rows.share(offset, size, count)]
        if not elastic:
            return mbs, slot.plan
        return mbs, self.home.plan.buckets[index].for_rounds(rounds)  # itself when its unit is its shares

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


def _microbatch(piece: documents.PackedRows, ring: Ring | None) -> Microbatch:
    """One microbatch of a bucket's rows: with document masks, or on a context-parallel stage (``ring``) this
    rank's columns of the rows (as wide as the bucket's ``max_len``) and their documents."""
    if ring is not None:
        inputs, targets, shard = context_rows.context_columns(
            ring, piece.inputs.shape[1], piece.inputs, piece.targets, piece.spans, piece.positions
        )
        return Microbatch(inputs, targets, ctx=shard)
    docs = DocumentMask.from_spans(piece.spans, piece.positions)
    return Microbatch(torch.from_numpy(piece.inputs), torch.from_numpy(piece.targets), docs)


def _numel(plan: Plan, device: str) -> int:
    """The float32 elements of ``device``'s shards in ``plan`` (0: the layout leaves it idle)."""
    rank = next((r.rank for r in plan.ranks if r.device_id == device), None)
    if rank is None:
        return 0
    return sum(
        math.prod(info.shape) // info.shape[info.shard_dim or 0] * (hi - lo) for info, lo, hi in plan.params_of(rank)
    )


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
