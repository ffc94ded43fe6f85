"""Emulated slowdown (runtime/emulation.py) stretches a rank's own compute, never its waits for a TP peer.

A TP stage's compute actions contain all-reduces, so their wall time includes waiting for the TP peer.
Stretching that wait by the slowdown made the peer wait for the stretched sleep in turn, and so on: every
action multiplied the skew of the two TP ranks by (slowdown - 1), and a planned layout with 6 microbatches
on a TP-2 stage never finished its first step under ``HETERO_EMULATE_SLOWDOWN="*:6"`` (docs/elastic.md).
Here one rank runs against a scripted slow peer on a fake clock: deterministic, and fast.
"""

from __future__ import annotations

from types import SimpleNamespace

import attrs
import numpy as np
import pytest
import torch

from harness import LAYOUTS
from hetero_llm import layout as layout_mod
from hetero_llm.comm import collectives
from hetero_llm.comm.groups import Comms
from hetero_llm.model.forward import TP, init_full
from hetero_llm.model.params import all_params
from hetero_llm.plan import StagePlan, compile_plan
from hetero_llm.predict.device import EmulatedDevice
from hetero_llm.runtime import context_rows, interpreter
from hetero_llm.runtime.emulation import Emulation
from hetero_llm.runtime.interpreter import Microbatch, StageRoutes, StageRunner
from hetero_llm.schedule import COMPUTE_KINDS, Action, Kind, parse_actions

MODEL = layout_mod.load(LAYOUTS / "reference" / "reference.toml").model
SLOWDOWN = 6.0
PEER_WAIT_S = 10.0  # what each TP all-reduce waits for the peer (its emulated sleep): far longer than compute
COMPUTE_S = 1.0  # this rank's own compute, charged at each TP enter (before attention and before the MLP)


@attrs.define
class FakeClock:
    """``time`` for the interpreter and the collectives: moves only when told (compute, a wait, a sleep)."""

    now: float = 0.0
    slept: list = attrs.field(factory=list)

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_slowdown_stretches_own_compute_not_tp_waits(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(interpreter, "time", clock)
    monkeypatch.setattr(collectives, "time", clock)

    def all_reduce_behind_a_slow_peer(tensor, group=None):  # a group of one: the sum is the tensor itself
        clock.now += PEER_WAIT_S

    monkeypatch.setattr(collectives.dist, "all_reduce", all_reduce_behind_a_slow_peer)
    comms = Comms(0, torch.device("cpu"), {}, object(), (0,))  # a TP group (its all-reduce is faked above)
    waits = collectives.TpWaits()
    real = collectives.tp_ops(comms, waits)
    own = {"s": 0.0}

    def enter(x):
        clock.now += COMPUTE_S
        own["s"] += COMPUTE_S
        return real.enter(x)

    params = {info.name: init_full(info, MODEL, seed=3).requires_grad_() for info in all_params(MODEL)}
    runner = StageRunner(
        comms,
        params,
        StagePlan(0, 0, (0,), ((0, MODEL.layers),), 1),
        MODEL,
        TP(enter, real.exit),
        StageRoutes(None, (), None, ()),
        emulation=Emulation(slowdown=SLOWDOWN),
        tp_waits=waits,
    )
    tokens = torch.randint(0, MODEL.vocab, (2, MODEL.seq_len + 1), generator=torch.Generator().manual_seed(0))
    runner._begin([Microbatch(tokens[:, :-1], tokens[:, 1:])], global_tokens=2 * MODEL.seq_len)
    for action in parse_actions("F0 B0"):
        assert action.kind in COMPUTE_KINDS
        before_own, before_waits, before_slept = own["s"], waits.seconds, len(clock.slept)
        runner.execute(action)
        computed, waited = own["s"] - before_own, waits.seconds - before_waits
        assert waited >= 2 * PEER_WAIT_S  # the action did wait for its peer, in the forward's and the backward's
        # all-reduces; only its own compute is stretched: (slowdown - 1) x compute, the waits not at all
        assert clock.slept[before_slept:] == pytest.approx([(SLOWDOWN - 1) * computed]), str(action)
    assert own["s"] > 0  # the forward computed (the backward's own compute is free on this clock)
    runner._finish()


CP_LAYOUT = LAYOUTS / "examples" / "context_parallel.toml"  # stage 1: 3 layers and the head, cp 2, tp 1


@pytest.mark.parametrize(
    "packed,squares",
    [
        # zigzag of 16 positions in 4 chunks: rank 0 holds 0-3 and 12-15, rank 1 4-11; a query at p sees p + 1
        # keys and counts 2 (p + 1) - 1: rank 0 (1+3+5+7) + (25+27+29+31) = 128 = 16^2 / 2, rank 1 48 + 80 = 128
        (False, (128, 128)),
        # documents of 5 and 9 tokens, 2 of padding: rank 0 holds doc 0's positions 0-3 (16), doc 1's 7 and 8
        # (15 + 17), padding (0): 48; rank 1 doc 0's position 4 (9) and doc 1's 0-6 (49): 58; 48 + 58 = 5^2 + 9^2
        (True, (48, 58)),
    ],
    ids=["causal rows", "packed documents"],
)
def test_cp_rank_models_its_share_of_the_rows_attention(packed, squares):
    """An emulated CP rank's compute action lasts the modelled time of its T / cp columns (matmuls, head) and of
    its queries' share of the rows' attention (their keys come from the whole row), by hand here."""
    plan = compile_plan(layout_mod.load(CP_LAYOUT))
    model, stage = plan.layout.model, plan.stage_of(4)
    lo, hi, _, head = stage.chunk_shape(0)
    assert (stage.tp, hi - lo, head, model.seq_len) == (1, 3, True, 16)
    device = EmulatedDevice(flops=1e9)
    rows, T, H, F, V = 2, 16, model.hidden, model.ffn_width, model.vocab
    tokens = np.zeros((rows, T), dtype=np.int64)
    spans = positions = None
    if packed:
        spans = np.array([[r, s, n] for r in range(rows) for s, n in ((0, 5), (5, 9))], dtype=np.int64)
        positions = np.tile(np.r_[np.arange(5), np.arange(9), 0, 0], (rows, 1)).astype(np.int64)
    for index, square in enumerate(squares):
        ring = SimpleNamespace(size=2, index=index)
        inputs, targets, shard = context_rows.context_columns(ring, T, tokens, tokens, spans, positions)
        assert inputs.shape == (rows, T // 2)
        runner = SimpleNamespace(
            _step=SimpleNamespace(mbs=[Microbatch(inputs, targets, ctx=shard)]),  # the step running
            stage=stage,
            model=model,
            emulation=SimpleNamespace(device=device),
            compute=SimpleNamespace(recompute=False),
        )
        positions_local = rows * T // 2
        matmul = 3 * positions_local * (8 * H * H + 2 * 3 * H * F) + 2 * positions_local * H * V  # swiglu: 3
        forward = matmul + 3 * 2 * H * rows * square
        assert StageRunner._modelled_seconds(runner, Action(Kind.F, 0)) == pytest.approx(forward / 1e9, rel=1e-12)
        assert StageRunner._modelled_seconds(runner, Action(Kind.B, 0)) == pytest.approx(2 * forward / 1e9, rel=1e-12)


@pytest.mark.parametrize("cp", [2, 4])
def test_the_simulators_attention_shares_are_what_each_cp_ranks_shard_paces(cp):
    """``cp_chunks.attention_shares`` (switching/predict.py's price of a CP stage, torch-free) is, rank by rank,
    ``context_rows.attention_square`` of the shard the runtime cuts from the same packed rows."""
    from hetero_llm.data import documents
    from hetero_llm.model import cp_chunks

    rng = np.random.default_rng(3)
    docs = [rng.integers(0, 50, size=int(n)) for n in rng.integers(1, 40, size=14)]
    packed = documents.pack(docs, 64)
    rows = packed.num_rows
    shares = cp_chunks.attention_shares(packed.spans, rows, 64, cp)
    for index in range(cp):
        ring = SimpleNamespace(size=cp, index=index)
        _, _, shard = context_rows.context_columns(
            ring, 64, packed.inputs, packed.targets, packed.spans, packed.positions
        )
        assert context_rows.attention_square(shard) == shares[index]
    assert sum(shares) == int((packed.spans[:, 2] ** 2).sum())
