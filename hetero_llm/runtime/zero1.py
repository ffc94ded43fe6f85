"""ZeRO-1 AdamW (``train.optimizer = 'adamw_zero1'``): each holder of a block keeps the moments of its slice only.

Per step, for every unit of ``plan.zero1_slices`` this rank is in:

1. ``start_reduce`` (the schedule's ``RS`` action, right after the stage's last backward): pack the block's
   gradient in holder order (TP-replicated shards scaled by 1/replicas, as ``grad_sync.sync_grads`` does) and start
   a reduce-scatter on the unit's group: each holder receives the summed gradient of its slice only.
2. ``finish_reduce``: wait, and return this rank's share of the squared global norm. Every element's summed
   gradient now lives on exactly one rank (its slice's), so the sum over ranks counts each element once.
3. ``step``: clip by the global coefficient, AdamW on this rank's slices (views into its parameter shards).
4. ``start_gather``: each holder contributes its updated slice; an all-gather on the unit's group starts.
5. ``wait_gather`` (the ``AG`` action, right before the stage's first forward of the next step): copy every
   other holder's slice into this rank's parameters.

The update is elementwise, so splitting it changes no number: layouts stay invariant.
"""

from __future__ import annotations

import math

import torch

from hetero_llm.comm import collectives
from hetero_llm.comm.groups import Comms
from hetero_llm.comm.streams import NO_STREAMS, Streams
from hetero_llm.plan.rank import RankPlan
from hetero_llm.plan.zero1_slices import Slice, ZeroUnit
from hetero_llm.schedule import Kind


class ShardedAdamW:
    """AdamW over this rank's slices; parameters stay whole (float32) on every holder."""

    def __init__(
        self,
        rp: RankPlan,
        state,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        comms: Comms,
        streams: Streams = NO_STREAMS,
    ):
        self.state_of_rank = state  # train.RankState: params, coords, replicas, decay
        self.rank, self.comms, self.streams = rp.rank, comms, streams
        (self.beta1, self.beta2), self.eps, self.weight_decay = betas, eps, weight_decay
        self.steps = 0
        mine = rp.optimizer_slices  # this rank's slices, resolved by the plan (zero1_slices.owned)
        assert mine is not None, "ShardedAdamW runs a plan with optimizer.zero1 (its RankPlans have optimizer_slices)"
        self.units: list[tuple[ZeroUnit, list[Slice]]] = [(u, list(sl)) for u, sl in mine.units]
        self.local: list[Slice] = list(mine.local)
        self.slices: list[Slice] = [s for _, sl in self.units for s in sl] + self.local
        self.exp_avg = [torch.zeros_like(self._view(s, "data")) for s in self.slices]
        self.exp_avg_sq = [torch.zeros_like(m) for m in self.exp_avg]
        # Parameters whose every row this rank holds is in a reduce-scattered block: once packed for the
        # reduce-scatter their whole gradient is dead (the summed slices come back), so it is freed at once.
        kept = {s[0] for s in self.local} | {e[0] for u, _ in self.units if not u.reduce for e in u.entries}
        self._freed_after_reduce = sorted({e[0] for u, _ in self.units if u.reduce for e in u.entries} - kept)
        self._reductions: list = []
        self._grads: list[torch.Tensor] = []
        self._gathers: list = []

    # -- views ----------------------------------------------------------------------------------

    def _view(self, s: Slice, what: str) -> torch.Tensor:
        """The parameter (``data``) or its gradient (``grad``) restricted to slice ``s``."""
        name, dim, lo, hi = s
        p = self.state_of_rank.params[name]
        shard_lo = self.state_of_rank.coords[name][1]
        t = p.detach() if what == "data" else p.grad
        return t.narrow(dim, lo - shard_lo, hi - lo)

    @property
    def state_bytes(self) -> int:
        """Bytes of AdamW moments this rank keeps."""
        return sum(m.numel() * m.element_size() for m in self.exp_avg + self.exp_avg_sq)

    def hooks(self) -> dict:
        """What the runtime runs at the schedule's optimizer actions."""
        return {Kind.RS: self.start_reduce, Kind.AG: self.wait_gather}

    # -- the step ---------------------------------------------------------------------------------

    def _packed(self, unit: ZeroUnit, what: str, only: int | None = None) -> torch.Tensor:
        """The unit's blocks (``grad``: scaled for TP replicas) flattened holder by holder, each holder's part
        padded to ``unit.chunk``; ``only``: just that holder's part."""
        parts = []
        holders = unit.ranks if only is None else (only,)
        for r in holders:
            views = [self._view(s, what) for s in unit.slices(r)]
            if what == "grad":
                views = [
                    v / self.state_of_rank.replicas[s[0]] if self.state_of_rank.replicas[s[0]] > 1 else v
                    for v, s in zip(views, unit.slices(r))
                ]
            flat = [v.reshape(-1) for v in views]
            pad = unit.chunk - unit.elements(r)
            ref = self.state_of_rank.params[unit.entries[0][0]]
            parts += flat + ([torch.zeros(pad, dtype=ref.dtype, device=ref.device)] if pad else [])
        return torch.cat(parts)

    def start_reduce(self) -> None:
        """Start every reduce-scatter this rank takes part in (the ``RS`` action).

        A gradient that is only reduce-scattered is freed as soon as the last unit holding a block of it is
        packed, so the packed copy does not sit beside the whole gradient for the rest of the step.
        """
        left = {
            name: sum(name in {e[0] for e in u.entries} for u, _ in self.units if u.reduce)
            for name in self._freed_after_reduce
        }
        self._reductions = []
        for unit, _ in self.units:
            if not unit.reduce:
                self._reductions.append((unit, None))
                continue
            packed = self._packed(unit, "grad")
            for name in {e[0] for e in unit.entries} & left.keys():
                left[name] -= 1
                if not left[name]:
                    self.state_of_rank.params[name].grad = None
            pending = collectives.start_reduce_scatter(self.comms, packed, unit.group, self.streams)
            self._reductions.append((unit, pending))

    def finish_reduce(self) -> torch.Tensor:
        """Wait for the reduce-scatters; this rank's share of the squared global norm (float64, on the device)."""
        if not self._reductions and self.units:
            self.start_reduce()  # defensive: the compiler gives every stage an RS0 (schedule.add_optimizer_actions)
        grads = []
        for (_unit, pending), (_, slices) in zip(self._reductions, self.units):
            if pending is None:  # TP replicas: the local gradient is the whole gradient
                grads += [self._view(s, "grad") for s in slices]
                continue
            flat, offset = pending.wait()[0], 0
            for s in slices:
                shape = self._view(s, "data").shape
                n = math.prod(shape)
                grads.append(flat[offset : offset + n].view(shape))
                offset += n
        grads += [self._view(s, "grad") for s in self.local]
        self._reductions, self._grads = [], grads
        device = self.comms.device
        if not grads:
            return torch.zeros((), dtype=torch.float64, device=device)
        return torch.stack(torch._foreach_norm(grads)).double().pow(2).sum()

    @torch.no_grad()
    def step(self, lr: float, clip: float = 1.0) -> None:
        """Clip by ``clip`` (the global coefficient) and update this rank's slices (the gradient is consumed)."""
        self.steps += 1
        grads, self._grads = self._grads, []
        if not grads:
            return
        if clip < 1.0:
            torch._foreach_mul_(grads, clip)
        bias1 = 1 - self.beta1**self.steps
        bias2_sqrt = math.sqrt(1 - self.beta2**self.steps)
        params = [self._view(s, "data") for s in self.slices]
        decay = [self.state_of_rank.decay[s[0]] for s in self.slices]
        if self.weight_decay:
            decayed = [p for p, d in zip(params, decay) if d]
            if decayed:
                torch._foreach_mul_(decayed, 1 - lr * self.weight_decay)
        torch._foreach_lerp_(self.exp_avg, grads, 1 - self.beta1)
        torch._foreach_mul_(self.exp_avg_sq, self.beta2)
        torch._foreach_addcmul_(self.exp_avg_sq, grads, grads, 1 - self.beta2)
        denom = torch._foreach_sqrt(self.exp_avg_sq)
        torch._foreach_div_(denom, bias2_sqrt)
        torch._foreach_add_(denom, self.eps)
        torch._foreach_addcdiv_(params, self.exp_avg, denom, -lr / bias1)
        self.zero_grad()  # before the all-gather's buffers are made: the gradients are dead now

    def start_gather(self) -> None:
        """Start the all-gathers of the updated slices (right after ``step``)."""
        self._gathers = [
            (
                unit,
                collectives.start_all_gather(
                    self.comms, self._packed(unit, "data", only=self.rank), unit.group, self.streams
                ),
            )
            for unit, _ in self.units
        ]

    def wait_gather(self) -> None:
        """Wait for the all-gathers and write the other holders' slices into this rank's parameters (the ``AG``
        action; a no-op when none is pending)."""
        gathers, self._gathers = self._gathers, []
        for unit, pending in gathers:
            self._unpack(unit, pending.wait()[0], self.state_of_rank.params)

    def _unpack(self, unit: ZeroUnit, flat: torch.Tensor, into: dict[str, torch.Tensor], moments: bool = False) -> None:
        for j, r in enumerate(unit.ranks):
            if r == self.rank and not moments:
                continue
            offset = j * unit.chunk
            for name, dim, lo, hi in unit.slices(r):
                target = into[name]
                shard_lo = self.state_of_rank.coords[name][1]
                view = target.detach().narrow(dim, lo - shard_lo, hi - lo)
                n = view.numel()
                with torch.no_grad():
                    view.copy_(flat[offset : offset + n].view(view.shape))
                offset += n

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.state_of_rank.params.values():
            p.grad = None

    # -- checkpoints: moments of the rank's whole shards, as plain AdamW keeps them -------------------

    def full_moments(self) -> dict[str, dict[str, torch.Tensor]]:
        """``{name: {"exp_avg", "exp_avg_sq"}}`` over this rank's whole shards, gathered from the other holders
        (a collective: every rank calls it at the same step). Saves stay in plain AdamW's format, so any layout
        resumes them, with or without ZeRO-1."""
        params = self.state_of_rank.params
        out = {key: {n: torch.zeros_like(p.detach()) for n, p in params.items()} for key in ("exp_avg", "exp_avg_sq")}
        for key, mine in (("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)):
            own = dict(zip(self.slices, mine))
            for s in self.slices:
                self._slice_of(out[key], s).copy_(own[s])
            for unit, slices in self.units:
                chunk = [own[s].reshape(-1) for s in slices]
                pad = unit.chunk - unit.elements(self.rank)
                flat = torch.cat(chunk + ([chunk[0].new_zeros(pad)] if pad else []))
                gathered = collectives.start_all_gather(self.comms, flat, unit.group, self.streams).wait()[0]
                self._unpack(unit, gathered, out[key], moments=True)
        return {n: {key: out[key][n] for key in out} for n in params}

    def load_moments(self, moments: dict[str, dict[str, torch.Tensor]], steps: int) -> None:
        """Take this rank's slices of whole-shard moments (``moments[key][name]``, as ``checkpoint.shards.restore`` gives them)."""
        self.steps = steps
        for key, mine in (("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)):
            for s, m in zip(self.slices, mine):
                m.copy_(self._slice_of(moments[key], s).to(m.device))

    def _slice_of(self, tensors: dict[str, torch.Tensor], s: Slice) -> torch.Tensor:
        name, dim, lo, hi = s
        return tensors[name].narrow(dim, lo - self.state_of_rank.coords[name][1], hi - lo)
