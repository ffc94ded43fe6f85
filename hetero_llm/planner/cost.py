"""The planner's cost model: step time and memory of a candidate layout, from first principles. Torch-free.

Every number comes from the model's shapes, the device catalogue (``catalogue.py``: datasheets, published
measurements and one calibrated constant, each named; docs/planner.md lists them) and the cluster's links.
Per transformer layer and sequence of S tokens (hidden H, MLP width F with ``nm`` weight matrices):

- compute of a **roofline** kind (every built-in GPU): each operation the runtime launches priced by
  ``roofline.Roofline`` (matmuls at the achieved rate for their shape, attention, memory-bound norms,
  activations, residuals and cross-entropy, as the run executes them: ``plan.execution``, eager by default
  with the host's dispatch per op, compiled, or hand-fused); of a **flops** kind (``cpu``, the
  emulated devices): forward FLOPs ``S (8 H^2 + 2 nm H F) + 2 Q H`` (+ ``2 S H V`` for the head) over TP x
  the kind's tflops, a backward twice that, its weight part the matmuls once: exactly what the emulated
  runtime charges (predict/device.action_seconds). Full recompute adds one forward to every backward.
  ``Q``: a row's sum of squared document lengths, ``S^2`` unless ``[plan.documents]`` (documents.py) says.
  Context parallelism (a stage's ``cp``): ``1 / cp`` of the tokens per device, plus its ring (context.py).
- TP: Megatron's two all-reduces per layer in forward and two in backward (four when the backward
  recomputes), ring all-reduce ``2 (t-1)/t x bytes / link``, over the kind's intra-node link at its NCCL
  efficiency.
- stage boundary: ``rows S H`` activation elements; inside a node over the slower of the two kinds'
  links, else over one of the domain's NICs (or the cross-domain network), then an all-gather inside the
  receiving TP group (the runtime sends one piece to each receiver). Under gloo a message over a network
  link moves only once its receive is posted (``rendezvous``), and the runtime posts a receive right before
  the compute that needs it: a stage busy when the data was sent waits a round trip once it is free.
- gradient sync: every rank's gradient shard is all-reduced (ring) with one holder per pipeline; a rank
  sends ``2 (P-1)/P`` of its shard, ``plan.grad_bytes`` per element (4: the runtime reduces float32),
  over the narrowest network its holders span; a node's ranks share its ``plan.nics`` NICs. NCCL clusters
  reach the domain kind's bus efficiency. The runtime syncs after the last backward, so the whole sync is
  added; ``plan.grad_overlap`` (a published system's torch DDP) hides it behind the last backward. The
  optimizer step reads param, grad and both AdamW moments and writes three of them back: 28 bytes per
  parameter over the achieved memory bandwidth.
- memory per device: ``memory.MemoryModel``, the base class of this cost model.

Step time = the slowest pipeline's simulated step (``simulate.simulate`` on the schedule's actions)
+ gradient sync + optimizer step: the runtime syncs after the last backward and steps after the sync.

Two measured constants of the software, 0 unless the cluster file gives them (``[plan]``): the runtime's
own time per compute action (``action_overhead_us``: added to every F, B, I and W of every stage, so a
schedule with more actions per microbatch, interleaving's chunks or ZB-H1's split backward, pays more)
and the communication library's latency per message (``p2p_latency_us``: added to every link's latency,
for stage boundaries and each step of a gradient all-reduce ring). Both are what a benchmark measured on
its machine (bench/planner/plan_vs_measured.py), not fitted to the plans it compares.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from hetero_llm.layout import P2P, Backend, Compile
from hetero_llm.planner import context, pipesim
from hetero_llm.planner.candidates import ByIdentity, Candidate, PipelineChoice, Score, TPGroup
from hetero_llm.planner.catalogue import DDP_BUCKET_BYTES, DOMAIN_FRACTION, ROOFLINE
from hetero_llm.planner.cluster import Cluster
from hetero_llm.planner.memory import MemoryModel
from hetero_llm.planner.roofline import COMPILED, EAGER, Roofline
from hetero_llm.planner.spans import (
    DOMAIN,
    DOMAIN_BW,
    EMBED_PARAMS,
    HEAD_PARAMS,
    INTRA_BW,
    LAYER_PARAMS,
    MEM_BW,
    NODE,
    TP,
    UID,
    Spans,
    ordered_sums,
)


def execution_modes(cluster: Cluster) -> tuple[str, str]:
    """How the layers' and the head's element-wise work runs (``plan.execution``; 'auto': the runtime's, eager
    unless train.compile = 'blocks' compiles each block, the head staying eager)."""
    mode = cluster.limits.execution
    if mode == "auto":
        return (COMPILED if cluster.train.compile is Compile.BLOCKS else EAGER), EAGER
    return mode, mode


OPTIMIZER_BYTES = 28  # AdamW reads weight, grad, two moments (16 B) and writes weight and moments (12 B)


class PlannerCostModel(MemoryModel):
    """Costs of stages, pipelines and whole candidates on one cluster (memoised: the search asks often)."""

    def __init__(self, cluster: Cluster):
        super().__init__(cluster)
        limits = cluster.limits
        # NCCL reaches a fraction of a NIC's line rate (catalogue.DOMAIN_FRACTION); gloo clusters (the emulated
        # testbed) are priced at their declared bandwidth
        frac = {d.name: DOMAIN_FRACTION[d.kind] for d in cluster.spec.domains}
        if cluster.spec.backend is not Backend.NCCL:
            frac = {}
        self.domain_bw = {d: bw * frac.get(d, 1.0) for d, bw in cluster.network.domain_bw}
        self.cross_bw = cluster.network.cross_bw * min(frac.values(), default=1.0)
        self.domain_lat = dict(cluster.network.domain_latency)
        self.nics = {n.name: n.nics for n in cluster.nodes}
        self.domain_index = {d.name: i for i, d in enumerate(cluster.spec.domains)}
        self.grad_bytes = limits.grad_bytes
        self.grad_overlap = limits.grad_overlap
        self.vocab_parallel = limits.vocab_parallel
        self.square = cluster.documents.square_sum(self.S)  # a row's attention: S^2 unless [plan.documents] says
        self.roofline = Roofline(self.model, self.act_bytes, limits.attention, *execution_modes(cluster), self.square)
        self.action_overhead = cluster.limits.action_overhead_us * 1e-6
        self.p2p_latency = cluster.limits.p2p_latency_us * 1e-6
        # gloo moves a network message only once its receive is posted; a node's shared-memory rings (its CPU
        # ranks' boundaries, cluster.nodes[].p2p) do not wait for it, and neither does NCCL (not modelled)
        self.gloo = cluster.spec.backend is not Backend.NCCL
        self.shm_nodes = {
            n.name for n in cluster.spec.nodes if n.p2p is P2P.SHM or (n.p2p is P2P.AUTO and set(n.devices) == {"cpu"})
        }
        # measured times hold for the shapes they were measured at (hetero-plan --buckets plans other
        # sequence lengths: those use the FLOP model)
        profile = cluster.profile
        self.profile = profile if profile is not None and profile.fits(self.model, cluster.train.precision) else None
        self._sim = functools.lru_cache(maxsize=200_000)(self._simulate)
        self._sync_opt: dict[tuple, tuple[float, float]] = {}
        self._pipeline_times = ByIdentity()  # by the stages' tuple, and rows, microbatches, schedule, chunks
        self._sync_by_stages = ByIdentity()  # by the pipelines' stage tuples (without grad_overlap)
        self._sync_parts = ByIdentity()  # _sync_part's, by a pipeline's stages' tuple
        self._stage_times: dict[tuple, tuple[float, float, float, float]] = {}

    def _group_facts(self, g: TPGroup, uid: int) -> tuple:
        """``MemoryModel``'s, then DOMAIN, INTRA_BW, DOMAIN_BW (spans.py's columns)."""
        domain = self.domain_index.setdefault(g.domain, len(self.domain_index))
        # nan: a domain without a network of its own (a cluster of one node), which no sync crosses
        own = (domain, self.intra_bw(g), self.domain_bw.get(g.domain, math.nan))
        return super()._group_facts(g, uid) + own

    # ---------------------------------------------------------------- per layer arithmetic
    def layer_matmul_flops(self) -> float:
        """Forward FLOPs of one layer's matmuls for one sequence."""
        return self.S * (8 * self.H**2 + 2 * self.nm * self.H * self.F)

    def layer_forward_flops(self) -> float:
        return self.layer_matmul_flops() + 2 * self.square * self.H

    def head_forward_flops(self) -> float:
        return 2 * self.S * self.H * self.V

    def model_flops_per_step(self) -> float:
        """Forward + backward FLOPs of one step without recompute (what MFU counts)."""
        per_seq = 3 * (self.L * self.layer_forward_flops() + self.head_forward_flops())
        return per_seq * self.cluster.train.global_batch

    # ---------------------------------------------------------------- time
    def allreduce(self, nbytes: float, members: int, bw: float) -> float:
        return 2 * (members - 1) / members * nbytes / bw if members > 1 else 0.0

    def stage_times(
        self, group: TPGroup, layers: int, last: bool, rows: int, recompute: bool
    ) -> tuple[float, float, float, float]:
        """(forward, backward, weight part of backward, TP seconds) of one microbatch of ``rows`` sequences;
        memoised: they depend on the group's kind (named uniquely inside a cluster) and TP size only."""
        key = (group.kind.name, len(group.devices), layers, last, rows, recompute, group.cp)
        t = self._stage_times.get(key)
        if t is None:
            t = self._stage_times[key] = self._stage_times_raw(group, layers, last, rows, recompute)
        return t

    def _stage_times_raw(
        self, group: TPGroup, layers: int, last: bool, rows: int, recompute: bool
    ) -> tuple[float, float, float, float]:
        measured = self.profile.get(group.kind.name) if self.profile else None
        cp = group.cp
        if measured is not None:  # measured seconds per sequence at TP 1, scaled by rows / (TP x CP)
            scale = rows / group.tp / cp
            lf, lb = measured.layer_forward_s * scale, measured.layer_backward_s * scale
            hf, hb = (measured.head_forward_s * scale, measured.head_backward_s * scale) if last else (0.0, 0.0)
            fwd = layers * lf + hf
            # the weight-gradient share of a backward, from the FLOP model (matmuls' weight gradients)
            wgt = layers * lb * self.layer_matmul_flops() / (2 * self.layer_forward_flops()) + hb / 2
            bwd = layers * lb + hb + (layers * lf if recompute else 0.0)
        elif group.kind.pricing == ROOFLINE:
            lf, lb, lw = self.roofline.layer(group.kind, rows, group.tp, cp)
            head_tp = group.tp if self.vocab_parallel else 1  # the runtime computes the whole head on each rank
            hf, hb, hw = self.roofline.head(group.kind, rows, head_tp, cp) if last else (0.0, 0.0, 0.0)
            fwd, wgt = layers * lf + hf, layers * lw + hw
            bwd = layers * lb + hb + (layers * lf if recompute else 0.0)
            if cp > 1:  # the slowest CP rank's attention sets each layer's pace (context.py)
                af, ab = self.roofline.attention(group.kind, rows, group.tp, cp)
                extra = self.cp_imbalance(cp, rows) - 1.0
                fwd, bwd = fwd + layers * extra * af, bwd + layers * extra * (ab + (af if recompute else 0.0))
        else:
            speed = group.flops
            fwd = rows * layers * self.layer_forward_flops() / speed
            wgt = rows * layers * self.layer_matmul_flops() / speed
            if last:
                head = rows * self.head_forward_flops() / speed
                fwd += head
                wgt += head
            bwd = 2 * fwd + (rows * layers * self.layer_forward_flops() / speed if recompute else 0.0)
            if cp > 1:  # the slowest CP rank's attention sets each layer's pace (context.py)
                extra = (self.cp_imbalance(cp, rows) - 1.0) * rows * layers * 2 * self.square * self.H / speed
                fwd, bwd = fwd + extra, bwd + (3 if recompute else 2) * extra
        link = self.intra_bw(group)
        one = self.allreduce(rows * self.S // cp * self.H * self.act_bytes, group.tp, link)
        tp_f, tp_b = 2 * layers * one, (4 if recompute else 2) * layers * one
        ring_f, ring_b = context.ring_exposed(self, group, rows)  # CP: the ring steps the attention does not hide
        tp_f, tp_b = tp_f + layers * ring_f, tp_b + layers * (ring_b + (ring_f if recompute else 0.0))
        return fwd + tp_f, bwd + tp_b, wgt, tp_f + tp_b

    def cp_imbalance(self, cp: int, rows: int) -> float:
        """The slowest CP rank's attention over a balanced rank's (``Documents.cp_imbalance``; 1 without documents)."""
        return self.cluster.documents.cp_imbalance(self.S, cp, rows, self.cluster.train.global_batch)

    @staticmethod
    def intra_bw(group: TPGroup) -> float:
        """Bytes/s of a device's intra-node link, as NCCL achieves it (link_fraction)."""
        return group.kind.link_gbps * group.kind.link_fraction * 1e9 / 8

    def link(self, a: TPGroup, b: TPGroup) -> tuple[float, float]:
        """(bytes/s, latency s) of the path between two groups."""
        if a.node == b.node:
            return min(self.intra_bw(a), self.intra_bw(b)), self.p2p_latency
        if a.domain == b.domain:
            return self.domain_bw[a.domain], self.domain_lat[a.domain] + self.p2p_latency
        return self.cross_bw, self.cluster.network.cross_latency + self.p2p_latency

    def rendezvous(self, a: TPGroup, b: TPGroup) -> bool:
        """Whether a message a -> b moves only once its receive is posted: gloo over a network (the sender
        waits for the receiver's notice, a latency, before it sends); not a node's shared-memory ring."""
        return self.gloo and not (a.node == b.node and a.node in self.shm_nodes)

    def boundary(self, a: TPGroup, b: TPGroup, rows: int) -> tuple[float, float]:
        """(effective bytes/s, latency) of one activation crossing a -> b (with the receivers' all-gather)."""
        nbytes = rows * self.S * self.H * self.act_bytes
        bw, lat = self.link(a, b)
        seconds = nbytes / bw
        if a.node != b.node and b.tp > 1:
            seconds += (b.tp - 1) / b.tp * nbytes / self.intra_bw(b)
        return nbytes / seconds, lat

    def _simulate(
        self,
        schedule: str,
        chunks: int,
        microbatches: int,
        fwd: tuple,
        bwd: tuple,
        wgt: tuple,
        lat: tuple,
        bw: tuple,
        nbytes: float,
        meet: tuple,
    ) -> tuple[float, float]:
        """(step seconds, idle fraction) of one pipeline, simulated (per link: ``lat``, ``bw`` and ``meet``, whether
        it is a rendezvous link; an interleaved schedule's last link is its wrap)."""
        n = len(fwd)
        if n == 1 and schedule == "interleaved":
            schedule, chunks = "1f1b", 1
        acts = pipesim.actions(schedule, n, microbatches, chunks)
        step, busy = pipesim.simulate(acts, fwd, bwd, wgt if schedule == "zbh1" else None, lat, bw, nbytes, meet)
        return step, 1.0 - sum(busy) / (n * step) if step else 0.0

    def links(self, pipe: PipelineChoice, schedule: str) -> tuple[tuple, tuple, tuple]:
        """Per link of ``pipe`` (its stage boundaries, then an interleaved schedule's wrap from the last stage back
        to the first): latencies, effective bandwidths (``boundary``) and whether it is a ``rendezvous`` link."""
        st = pipe.stages
        pairs = list(zip(st, st[1:])) + ([(st[-1], st[0])] if schedule == "interleaved" and len(st) > 1 else [])
        links = [self.boundary(a.group, b.group, pipe.rows) for a, b in pairs]
        return (
            tuple(x[1] for x in links),
            tuple(x[0] for x in links),
            tuple(self.rendezvous(a.group, b.group) for a, b in pairs),
        )

    # ---------------------------------------------------------------- whole candidates
    def pipeline_time(self, pipe: PipelineChoice, schedule: str, chunks: int) -> tuple[float, float, float]:
        """(simulated seconds, bubble, TP seconds of the busiest stage) of one pipeline's step; memoised by its
        stages' tuple (the search shares one between the candidates whose pipeline is the same) and the rest."""
        extra = (pipe.rows, pipe.microbatches, schedule, chunks)
        known = self._pipeline_times.get((pipe.stages,), extra)
        if known is not None:
            return known
        return self._pipeline_times.put((pipe.stages,), self._pipeline_time(pipe, schedule, chunks), extra)

    def _pipeline_time(self, pipe: PipelineChoice, schedule: str, chunks: int) -> tuple[float, float, float]:
        rows, st = pipe.rows, pipe.stages
        times = [self.stage_times(s.group, s.layers, i == len(st) - 1, rows, s.recompute) for i, s in enumerate(st)]
        lat, bw, meet = self.links(pipe, schedule)
        nbytes = rows * self.S * self.H * self.act_bytes
        # the runtime's time per compute action: a microbatch's forward is `c` actions (chunks), its backward
        # `c` B (or `c` I and `c` W under ZB-H1)
        c = chunks if schedule == "interleaved" and len(st) > 1 else 1
        fo = wo = c * self.action_overhead
        bo = fo * (2 if schedule == "zbh1" else 1)
        step, bubble = self._sim(
            schedule,
            chunks,
            pipe.microbatches,
            tuple(t[0] + fo for t in times),
            tuple(t[1] + bo for t in times),
            tuple(t[2] + wo for t in times),
            lat,
            bw,
            nbytes,
            meet,
        )
        busiest = max(range(len(st)), key=lambda i: times[i][0] + times[i][1])
        return step, bubble, times[busiest][3] * pipe.microbatches

    def grad_sync_time(self, cand: Candidate, spans: Spans | None = None) -> float:
        """Seconds of the gradient all-reduces the step waits for: the busiest node's NICs (or intra-node link);
        with ``plan.grad_overlap`` only what the last microbatch's backward does not hide. Each span of layers
        between two stage boundaries of any pipeline (``spans``) has one holding group per pipeline; a rank sends
        ``2 (P-1)/P`` of its shard of the span over the narrowest network the span's holders cross."""
        P = len(cand.pipelines)
        if P == 1:
            return 0.0
        sp = self.spans(cand) if spans is None else spans
        own = sp.owner  # [span, pipeline] -> stage
        node_c, tp_c, dom_c = sp.per_stage(NODE).astype(np.int64), sp.per_stage(TP), sp.per_stage(DOMAIN)
        one_node = (node_c == node_c[:, :1]).all(axis=1)
        one_dom = (dom_c == dom_c[:, :1]).all(axis=1)
        # the embedding (first layer's holders) and the head (last layer's) sync alongside
        extra = np.where(sp.lo[:, None] == 0, sp.per_stage(EMBED_PARAMS), 0.0)
        extra = extra + np.where(sp.hi[:, None] == self.L, sp.per_stage(HEAD_PARAMS), 0.0)
        shard = (sp.per_stage(LAYER_PARAMS) * (sp.hi - sp.lo)[:, None] + extra) * self.grad_bytes
        nbytes = 2 * (P - 1) / P * shard
        n = len(self.node_index)
        # inside one node: over its intra-node link; else a node's bytes x (1 / bandwidth) over its NICs
        intra = ordered_sums(node_c[one_node], (nbytes / sp.per_stage(INTRA_BW))[one_node], n)
        net = ~one_node
        bw = np.where(one_dom[:, None], sp.per_stage(DOMAIN_BW), self.cross_bw)
        if np.isnan(bw[net]).any():
            raise KeyError(f"no network declared for the domain of a group in {cand}")
        share = nbytes * tp_c / bw
        if not self.gloo:
            # NCCL chains a node's members of a ring through the node and links the chains node to node
            # (src/graph/connect.cc, connectRings): a ring leaves and enters each node once, however many of
            # its members the node holds. gloo's ZeRO-1 exchange pairs every two members and its ring follows
            # rank order, so there each member's traffic is counted
            cell = np.arange(len(sp.lo))[:, None] * n + node_c  # (span, node)
            share = share / np.bincount(cell.ravel(), minlength=len(sp.lo) * n)[cell]  # the span's holders there
        nic = ordered_sums(node_c[net], share[net], n)
        # a node's traffic spreads over its NICs, at most one NIC per device that sends (its groups' devices)
        sending = np.zeros(len(sp.stages), dtype=bool)
        sending[own[net]] = True
        rows = sp.facts[sending]
        uids = rows[:, UID].tolist()
        if len(set(uids)) < len(uids):  # a group in two stages: its devices once
            rows = rows[np.unique(uids, return_index=True)[1]]
        users = ordered_sums(rows[:, NODE].astype(np.int64), rows[:, TP], n)
        nics = np.asarray([self.nics.get(name, 1) for name in self.node_index])
        busiest = nic[users > 0] / np.minimum(nics[users > 0], users[users > 0])
        cross = not one_dom.all()
        lat = (self.cluster.network.cross_latency if cross else max(self.domain_lat.values())) + self.p2p_latency
        buckets = len({row.tobytes() for row in sp.per_stage(UID)})  # spans with other holders
        sync = float(max(busiest.max(initial=0.0), intra.max(initial=0.0))) + buckets * 2 * (P - 1) * lat
        if not self.grad_overlap:
            return sync
        # torch DDP: buckets all-reduce as the last microbatch's backward produces them, the last one after it;
        # the first stage finishes its backward last
        firsts = [(p.stages[0], len(p.stages) == 1, p.rows) for p in cand.pipelines]
        window = min(self.stage_times(s.group, s.layers, last, rows, s.recompute)[1] for s, last, rows in firsts)
        held = ordered_sums(sp.per_stage(UID).astype(np.int64), shard, len(self._facts))  # per group (its devices)
        tail = sync * min(1.0, DDP_BUCKET_BYTES / float(held.max()))
        return max(sync - window, tail)

    def sync_and_optimizer(self, cand: Candidate) -> tuple[float, float]:
        """(``grad_sync_time``, ``optimizer_time``), memoised: both depend on the stages' groups (named by their
        devices inside one cluster) and layers only, and with ``plan.grad_overlap`` on the first stages' rows
        and recompute too."""
        if self.grad_overlap:
            key: tuple = tuple(
                (p.batch, p.microbatches, tuple((s.group.name, s.layers, s.recompute) for s in p.stages))
                for p in cand.pipelines
            )
        else:
            # first by the stages' tuples themselves (the search shares them between candidates), then by what
            # they hold
            stages = tuple(p.stages for p in cand.pipelines)
            known = self._sync_by_stages.get(stages)
            if known is not None:
                return known
            key = tuple(map(self._sync_part, stages))
        t = self._sync_opt.get(key)
        if t is None:
            spans = self.spans(cand)
            sync = self.grad_sync_time(cand, spans) + context.cp_sync_time(self, cand)
            t = self._sync_opt[key] = (sync, self.optimizer_time(cand, spans))
        if not self.grad_overlap:
            self._sync_by_stages.put(stages, t)
        return t

    def _sync_part(self, stages: tuple) -> tuple:
        """A pipeline's part of ``sync_and_optimizer``'s key (its groups' devices and layers), memoised by its
        stages' tuple."""
        part = self._sync_parts.get((stages,))
        if part is None:
            part = self._sync_parts.put((stages,), tuple((s.group.name, s.layers) for s in stages))
        return part

    def optimizer_time(self, cand: Candidate, spans: Spans | None = None) -> float:
        """The slowest device's AdamW step: 28 bytes per moment element it updates (its slices under ZeRO-1)."""
        sp = self.spans(cand) if spans is None else spans
        return float(max(0.0, (self.stage_moments(cand, sp) * OPTIMIZER_BYTES / sp.facts[:, MEM_BW]).max()))

    def lower_bound(self) -> float:
        """Seconds of the step's model FLOPs spread over every device at its peak."""
        total = sum(n.devices * n.kind.tflops * 1e12 for n in self.cluster.nodes)
        return self.model_flops_per_step() / total

    def score(self, cand: Candidate) -> Score:
        mems, caps = self.memory(cand)
        fits = all(m <= c for ms, cs in zip(mems, caps) for m, c in zip(ms, cs))
        chunks = cand.chunks
        results = [self.pipeline_time(p, cand.schedule, chunks) for p in cand.pipelines]
        slowest = max(range(len(results)), key=lambda i: results[i][0])
        sync, opt = self.sync_and_optimizer(cand)
        step = results[slowest][0] + sync + opt
        total_peak = sum(n.devices * n.kind.tflops * 1e12 for n in self.cluster.nodes)
        tokens = self.cluster.train.global_batch * self.S
        return Score(
            step if fits else math.inf,
            tuple(r[0] for r in results),
            results[slowest][1],
            results[slowest][2],
            sync,
            opt,
            mems,
            caps,
            tokens / step,
            self.model_flops_per_step() / (step * total_peak),
            self.lower_bound(),
        )
