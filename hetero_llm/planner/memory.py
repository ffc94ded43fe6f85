"""The planner's memory model: parameters and bytes on each device of a candidate layout. Torch-free.

Memory per device: 12 bytes per parameter it holds (float32 weight, two AdamW moments; ZeRO-1: its slice of the
moments), 4 more for its gradient where one exists, plus activations: per token and layer ``4 H + nf F / t``
elements outside the attention (the two norms' inputs and outputs; the MLP's intermediate tensors, ``nf`` = 2 for
GELU, 4 for SwiGLU) and the attention's (``attention_activation_bytes``: Q, K, V and the attention output split by
TP; with ``plan.attention = "flash"``, the runtime's SDPA, no S x S matrix, only its log-sum-exp; with ``"unfused"``
the scores' softmax output, dropout mask and dropout output, ``heads / t x S`` of each per token), plus what RMS
norm, RoPE and packed documents save besides (``layer_activation_bytes``, checked against the runtime's saved
tensors), per microbatch whole on the stage; with full recompute only each layer's input (H per token) plus one
layer's working set. The last stage adds per microbatch the final norm's and the loss's saved tensors, and one
microbatch's logits' gradients. A microbatch a split backward (ZB-H1) has put off holds its linear layers' inputs
and output gradients (``put_off_bytes``), and the gradients (4 bytes per parameter) exist only once a backward has
made them (the runtime frees them after each step). What a stage holds at once is the largest of the schedule's
points ``(whole, put off, gradients)`` after each of its actions (``pipesim.held_in_flight``; interleaved:
(microbatch, chunk) pairs over the chunks, a chunk holding 1/chunks of the stage's layers); tests/unit/test_planner.py
and bench/memory/plan_meter.py (the tensor meter on the planner's picks) check it. With ``plan.vocab_parallel`` (Megatron-
LM's vocabulary-parallel embedding and head) each TP rank holds V/t of the embedding's and the head's rows and of
the logits; else the whole of them (the runtime).

The planner's cost model (``cost.PlannerCostModel``) is a ``MemoryModel``: a stage that does not fit in its
device's memory, after the margin, makes a candidate infeasible.
"""

from __future__ import annotations

import functools

import numpy as np

from hetero_llm.layout import Mlp, Norm, Optimizer, Packing, Position, Precision
from hetero_llm.planner import pipesim
from hetero_llm.planner.candidates import ByIdentity, Candidate, StageChoice, TPGroup
from hetero_llm.planner.cluster import Cluster
from hetero_llm.planner.spans import EMBED_PARAMS, HEAD_PARAMS, LAYER_PARAMS, NODE_MEMORY, TP, Spans, ordered_sums

PARAM_BYTES = GRAD_BYTES = 4  # float32 weight and gradient (every holder keeps both, also under ZeRO-1)
MOMENT_BYTES = 8  # AdamW exp_avg + exp_avg_sq, float32 (ZeRO-1 splits these over a block's holders)
STEP_TEMP_BYTES = 4  # the optimizer step's float32 denominator per moment element (bench/memory/plan_memory.py)
# Document attention (model/document_mask.py) gathers each document's q, k, v into a batch padded to a ladder
# length and SDPA saves those copies and its output, at most 1.5x a document's length for documents of 8
# positions or more (the ladder 8, 12, 16, 24, ...; shorter ones pad to 8); the projection after it saves the
# scattered output: (4 x DOC_PAD + 1) H / t per token where the plain path saves 4 H / t
DOC_PAD = 1.5
# Unfused attention (plan.attention = "unfused", Megatron-LM's CoreAttention) saves, per score, the softmax's
# output (its backward reads it), the dropout's mask (one byte: torch's bool mask) and the dropout's output (the
# probabilities x V matmul reads it): 2 a + 1 bytes, the ``5 a s / h`` of Korthikanti et al. 2022 (arXiv
# 2205.05198, section 4.1) in fp16; the roofline prices the same two kernels (roofline.Roofline.attention)
SCORE_MASK_BYTES = 1
# A microbatch that holds everything and the gradients made: what one microbatch in flight is, at most
ONE_IN_FLIGHT: pipesim.Held = ((1.0, 0.0, 1.0),)


class MemoryModel:
    """Parameter counts and bytes per device of stages and whole candidates on one cluster (memoised)."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        m = cluster.model
        self.model = m
        self.H, self.F, self.S, self.V, self.L = m.hidden, m.ffn_width, m.seq_len, m.vocab, m.layers
        self.nm = 3 if m.mlp is Mlp.SWIGLU else 2
        self.act_bytes = 2 if cluster.train.precision is Precision.BF16 else 4
        self.margin = cluster.limits.memory_margin
        self.documents = cluster.data.packing is Packing.DOCUMENTS
        self.unfused = cluster.limits.attention == "unfused"
        self.zero1 = cluster.train.optimizer is Optimizer.ADAMW_ZERO1
        # ZeRO-1 slices a block's moments in proportion to TP size x node memory_gb, when every holder's node
        # declares memory_gb (zero1_slices._weights); else by TP size alone
        self.node_memory = {n.name: n.memory_gb for n in cluster.spec.nodes}
        self._stage_params: dict[tuple, float] = {}
        self._peaks = functools.lru_cache(maxsize=10_000)(self._peak_in_flight)
        self.node_index = {n.name: i for i, n in enumerate(cluster.nodes)}
        self._facts: dict[tuple[str, ...], tuple] = {}
        self._activation_bytes: dict[int, float] = {}
        self._pipeline_rows = ByIdentity()  # by the stages' tuple: (layers, facts)

    # ---------------------------------------------------------------- groups
    def group_facts(self, group: TPGroup) -> tuple:
        """The group's row of ``spans.Spans.facts`` (memoised: the search prices the same groups again and again)."""
        row = self._facts.get(group.name)  # a group is named by its devices (and CP size) inside one cluster
        if row is None:
            row = self._facts[group.name] = self._group_facts(group, len(self._facts))
        return row

    def _group_facts(self, g: TPGroup, uid: int) -> tuple:
        """NODE, UID, TP, NODE_MEMORY, MEM_BW, LAYER_PARAMS, EMBED_PARAMS, HEAD_PARAMS (spans.py's columns); ``uid``:
        a number of its own."""
        t = g.tp
        own = (self.node_index[g.node], uid, t, self.node_memory.get(g.node, 0.0), self.mem_bw(g))
        return own + (sum(self.layer_params(t)), self.embed_params(t), self.head_params(t))

    @staticmethod
    def mem_bw(g: TPGroup) -> float:
        """Bytes/s of a device's memory, as achieved (mem_fraction)."""
        return g.kind.mem_bw_gbs * g.kind.mem_fraction * 1e9

    def pipeline_rows(self, stages: tuple[StageChoice, ...]) -> tuple[np.ndarray, np.ndarray]:
        """The stages' layers and their groups' ``group_facts`` rows, memoised by the stages' tuple (the search
        shares one between the candidates whose pipeline is the same)."""
        known = self._pipeline_rows.get((stages,))
        if known is None:
            layers = np.asarray([s.layers for s in stages], dtype=np.int64)
            facts = np.asarray([self.group_facts(s.group) for s in stages], dtype=float)
            known = self._pipeline_rows.put((stages,), (layers, facts))
        return known

    def spans(self, cand: Candidate) -> Spans:
        return Spans.of(cand, self.L, self.pipeline_rows)

    # ---------------------------------------------------------------- parameters
    def layer_params(self, tp: int) -> tuple[float, float]:
        """(sharded, replicated) parameters of one layer on one device of a TP group."""
        H, F = self.H, self.F
        norms = 2 * H * (2 if self.model.norm is Norm.LAYERNORM else 1)
        return (4 * H * H + self.nm * H * F) / tp, norms

    def vocab_split(self, tp: int) -> int:
        """How many ways a device's TP group splits the vocabulary (``plan.vocab_parallel``: Megatron-LM's
        vocabulary-parallel embedding and head split it over TP; the runtime keeps it whole on every rank)."""
        return tp if self.cluster.limits.vocab_parallel else 1

    def embed_params(self, tp: int = 1) -> float:
        """The embedding's parameters on one device of a TP group of ``tp`` (the learned positions whole)."""
        return self.V * self.H / self.vocab_split(tp) + (
            self.S * self.H if self.model.position is Position.LEARNED else 0
        )

    def head_params(self, tp: int = 1) -> float:
        return self.V * self.H / self.vocab_split(tp) + self.H * (2 if self.model.norm is Norm.LAYERNORM else 1)

    def stage_params(self, tp: int, layers: int, first: bool, last: bool) -> float:
        key = (tp, layers, first, last)
        n = self._stage_params.get(key)
        if n is None:  # the search asks hundreds of thousands of times
            sharded, repl = self.layer_params(tp)
            n = (
                layers * (sharded + repl)
                + (self.embed_params(tp) if first else 0)
                + (self.head_params(tp) if last else 0)
            )
            self._stage_params[key] = n
        return n

    def stage_full_params(self, layers: int, first: bool, last: bool) -> float:
        """Parameters of the stage's layers (and embedding, head) before TP sharding."""
        sharded, repl = self.layer_params(1)
        return layers * (sharded + repl) + (self.embed_params() if first else 0) + (self.head_params() if last else 0)

    # ---------------------------------------------------------------- memory
    def zero1_weights(self, group: TPGroup) -> tuple[float, float]:
        """(memory-weighted, unweighted) ZeRO-1 weight of one TP group: ``tp x memory_gb`` and ``tp``."""
        return group.tp * self.node_memory.get(group.node, 0.0), float(group.tp)

    def zero1_share(self, group: TPGroup, others: tuple[float, float]) -> float:
        """Upper bound of the fraction of a block's full moments one device of ``group`` keeps under ZeRO-1
        when the other pipelines' holders weigh at least ``others`` (see ``zero1_weights``)."""
        mem = self.node_memory.get(group.node, 0.0)
        unit = 1.0 / (group.tp + others[1])
        if mem <= 0:
            return unit
        return max(mem / (group.tp * mem + others[0]), unit)

    def moment_elements(
        self, group: TPGroup, layers: int, first: bool, last: bool, others: tuple[float, float] = (0.0, 0.0)
    ) -> float:
        """AdamW moment elements (each of two) on one device of the stage: all it holds with 'adamw'; with
        'adamw_zero1' its share of every block, ``full x share`` (a bound when ``others`` is a bound)."""
        if not self.zero1:
            return self.stage_params(group.tp, layers, first, last)
        return self.stage_full_params(layers, first, last) * self.zero1_share(group, others)

    def stage_memory(
        self,
        group: TPGroup,
        layers: int,
        first: bool,
        last: bool,
        rows: int,
        recompute: bool,
        in_flight: pipesim.Held,
        others: tuple[float, float] = (0.0, 0.0),
        moments: float | None = None,
    ) -> float:
        """Bytes on one device of the stage at its peak. ``in_flight``: the schedule's ``(full, put off, gradients)``
        points for the stage (``_peak_in_flight``), the most it holds at once being one of them. ZeRO-1:
        ``others`` bounds the other pipelines' holders' weight (or ``moments`` gives the exact moment elements)."""
        if moments is None:
            moments = self.moment_elements(group, layers, first, last, others)
        params = self.stage_params(group.tp, layers, first, last)
        H, t = self.H, group.tp
        full = self._activation_bytes.get(t)
        if full is None:  # asked for every stage of every candidate scored
            full = self._activation_bytes[t] = self.layer_activation_bytes(t)
        tokens = rows * self.S // group.cp  # context parallelism: a device holds 1 / cp of every row
        # one microbatch in flight (recompute: each layer's input), and the layer being recomputed
        one, working = layers * tokens * (H * self.act_bytes if recompute else full), 0.0
        if recompute and layers:
            working = tokens * full
        if first:  # the token ids the embedding saves (int64)
            one += tokens * 8
        if last:  # the final norm's and the loss's (its float32 log-probabilities) saved tensors, and while a
            # microbatch's backward runs, its logits' gradients (float32 and compute dtype)
            one += tokens * self.head_activation_bytes(t)
            working += tokens * self.V / self.vocab_split(t) * (4 + self.act_bytes)
        put_off = layers * tokens * self.put_off_bytes(t) + (tokens * self.head_put_off_bytes(t) if last else 0.0)
        grads = params * GRAD_BYTES
        act = max(f * one + p * put_off + g * grads for f, p, g in in_flight) + working
        # the activations are freed before the optimizer step, which allocates sqrt(exp_avg_sq) (AdamW's denominator,
        # float32, one per moment element: optim.AdamW, zero1.ShardedAdamW) beside the gradients: the peak is the
        # larger of the two
        return params * PARAM_BYTES + moments * MOMENT_BYTES + max(act, grads + moments * STEP_TEMP_BYTES)

    def put_off_bytes(self, tp: int) -> float:
        """Bytes per token one layer holds from a split backward's I to its W (ZB-H1; runtime/wgrad.py): each linear
        layer's input (Q K V's one, the output projection's, the MLP's one, its output projection's) and output
        gradient, on one device of a TP group of ``tp``."""
        m, H, F = self.model, self.H, self.F
        nm = 2 if m.mlp is Mlp.SWIGLU else 1
        inputs = H + H / tp + H + F / tp
        grads = (H + 2 * m.kv_heads_n * m.head_dim) / tp + H + nm * F / tp + H
        return (inputs + grads) * self.act_bytes

    def head_activation_bytes(self, tp: int) -> float:
        """Bytes the head saves per token: the final norm's input, output and statistics (RMS norm's two more
        H-wide tensors, as in a layer) and the loss's float32 log-probabilities (``model.token_loss_sum``)."""
        m, H = self.model, self.H
        norm = 2 * H + (2 if m.norm is Norm.LAYERNORM else 1) + (2 * H if m.norm is Norm.RMSNORM else 0)
        return norm * self.act_bytes + self.V / self.vocab_split(tp) * 4

    def head_put_off_bytes(self, tp: int) -> float:
        """The head's, per token: its input and the logits' gradient (its vocabulary split with ``vocab_parallel``)."""
        return (self.H + self.V / self.vocab_split(tp)) * self.act_bytes

    def layer_activation_bytes(self, tp: int) -> float:
        """Bytes one layer saves for its backward per token, on one device of a TP group of ``tp``: what the
        runtime's block (model/forward.py) saves, counted with autograd's saved-tensor hooks for every norm,
        position and MLP kind (tests/unit/test_memory_model.py checks it is an upper bound within 15%), its attention's
        as ``attention_activation_bytes`` counts them."""
        m, H, F = self.model, self.H, self.F
        nf = 4 if m.mlp is Mlp.SWIGLU else 2
        full = 4 * H + nf * F / tp
        # the norms' statistics (layer norm: mean and rstd; RMS norm: rstd)
        full += 2 * (2 if m.norm is Norm.LAYERNORM else 1)
        if m.norm is Norm.RMSNORM:  # F.rms_norm runs as several ops (on CPU): two more H-wide tensors per norm
            full += 2 * H
        return full * self.act_bytes + self.attention_activation_bytes(tp)

    def attention_activation_bytes(self, tp: int, keys: float | None = None) -> float:
        """Bytes one layer's attention saves for its backward per token (query position), on one device of a TP
        group of ``tp``: Q, K, V and the attention's output (``H / t`` each; the output is the projection's
        input), RoPE's, and by ``plan.attention``: ``flash`` (the runtime's SDPA) its log-sum-exp per head, and
        with packed documents their padded copies (see ``DOC_PAD``); ``unfused`` the ``heads / t x keys`` scores'
        softmax output, dropout mask and dropout output (``SCORE_MASK_BYTES``). ``keys``: the keys each query's
        scores span, ``seq_len`` when not given (the whole window, as Megatron-LM's masked scores do)."""
        m, H, a = self.model, self.H, self.act_bytes
        full = 4 * H / tp
        if m.position is Position.ROPE:  # the rotation saves q's and k's halves and the cos and sin rows
            full += H / tp + m.head_dim
        if self.unfused:
            keys = self.S if keys is None else keys
            return full * a + m.heads / tp * keys * (2 * a + SCORE_MASK_BYTES)
        full += m.heads / tp  # SDPA's log-sum-exp
        if self.documents:  # the padded copies (see DOC_PAD); with RoPE the rotated q and k are not saved again
            full += (4 * (DOC_PAD - 1) + 1) * H / tp - (H / tp if m.position is Position.ROPE else 0)
        return full * a

    def capacity(self, group: TPGroup) -> float:
        return group.kind.memory_gb * 1e9 * (1 - self.margin)

    def _peak_in_flight(self, schedule: str, stages: int, microbatches: int, chunks: int) -> tuple[pipesim.Held, ...]:
        """Per stage, the most it holds at once (``pipesim.held_in_flight``) in whole-stage units: an interleaved
        (microbatch, chunk) pair holds 1/chunks of the stage's layers (as predict.simulate counts them)."""
        if schedule != "gpipe" and microbatches > 3 * stages:
            # past 3 x stages, more microbatches only lengthen the steady state: the peaks are those of the
            # same count modulo the stages (tests/unit/test_planner.py checks it over a grid); saves generating
            # schedules of hundreds of microbatches
            microbatches = 3 * stages + (microbatches - 3 * stages) % stages
        held = pipesim.held_in_flight(pipesim.actions(schedule, stages, microbatches, chunks))
        div = chunks if schedule == "interleaved" else 1
        return tuple(tuple((f / div, p / div, float(g)) for f, p, g in stage) for stage in held)

    def moments(self, cand: Candidate) -> tuple[tuple[float, ...], ...]:
        """AdamW moment elements per device, [pipeline][stage]. With ZeRO-1, exactly as ``plan.zero1_slices``
        slices them (up to whole rows): every span of layers between two stage boundaries of any pipeline
        is held by one group per pipeline, and a device of group g keeps ``full x w_g / sum of w x tp``
        of it, ``w`` = its node's memory_gb when every holder declares one (else 1); the embedding's
        holders are the first stages, the head's the last."""
        flat = self.stage_moments(cand).tolist()
        out, at = [], 0
        for p in cand.pipelines:
            out.append(tuple(flat[at : at + len(p.stages)]))
            at += len(p.stages)
        return tuple(out)

    def stage_moments(self, cand: Candidate, spans: Spans | None = None) -> np.ndarray:
        """``moments``, one per stage of every pipeline in turn (``spans``: the candidate's, when known)."""
        sp = self.spans(cand) if spans is None else spans
        if not self.zero1:  # stage_params of every stage
            first, last = np.zeros(len(sp.stages), dtype=bool), np.zeros(len(sp.stages), dtype=bool)
            first[sp.first], last[sp.last] = True, True
            params = sp.layers * sp.facts[:, LAYER_PARAMS] + np.where(first, sp.facts[:, EMBED_PARAMS], 0.0)
            return params + np.where(last, sp.facts[:, HEAD_PARAMS], 0.0)
        tp, mem = sp.facts[:, TP], sp.facts[:, NODE_MEMORY]

        def shares(holders: np.ndarray, elements) -> np.ndarray:
            """Per holder (a row per span, a column per pipeline): ``elements x w / sum of w x tp`` (summed in
            pipeline order); w = 1 in a row where a holder's node declares no memory_gb."""
            w = mem[holders]
            w = np.where((w > 0).all(axis=-1, keepdims=True), w, 1.0)
            total = np.cumsum(tp[holders] * w, axis=-1)[..., -1:]
            return elements * w / total

        layer = sum(self.layer_params(1))
        out = ordered_sums(sp.owner, shares(sp.owner, (layer * (sp.hi - sp.lo))[:, None]), len(sp.stages))
        out[sp.first] += shares(sp.first, self.embed_params())
        out[sp.last] += shares(sp.last, self.head_params())
        return out

    def memory(self, cand: Candidate) -> tuple[tuple[tuple[float, ...], ...], tuple[tuple[float, ...], ...]]:
        mems, caps = [], []
        for pipe, moments in zip(cand.pipelines, self.moments(cand)):
            n = len(pipe.stages)
            chunks = cand.chunks if cand.schedule == "interleaved" and n > 1 else 1
            kind = "1f1b" if n == 1 and cand.schedule == "interleaved" else cand.schedule
            peaks = self._peaks(kind, n, pipe.microbatches, chunks)
            mems.append(
                tuple(
                    self.stage_memory(
                        s.group, s.layers, i == 0, i == n - 1, pipe.rows, s.recompute, peaks[i], moments=moments[i]
                    )
                    for i, s in enumerate(pipe.stages)
                )
            )
            caps.append(tuple(self.capacity(s.group) for s in pipe.stages))
        return tuple(mems), tuple(caps)
