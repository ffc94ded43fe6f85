"""Emulated slowdown (runtime/emulation.py) stretches a rank's own compute, never its waits for a TP peer.

A TP stage's compute actions contain all-reduces, so their wall time includes waiting for the TP peer.
Stretching that wait by the slowdown made the peer wait for the stretched sleep in turn, and so on: every
action multiplied the skew of the two TP ranks by (slowdown - 1), and a planned layout with 6 microbatches
on a TP-2 stage never finished its first step under ``HETERO_EMULATE_SLOWDOWN="*:6"`` (docs/elastic.md).
Here one rank runs against a scripted slow peer on a fake clock: deterministic, and fast.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from harness import LAYOUTS
from hetero_llm import layout as layout_mod
from hetero_llm.comm import collectives
from hetero_llm.comm.groups import Comms
from hetero_llm.model.forward import TP, init_full
from hetero_llm.model.params import all_params
from hetero_llm.plan import StagePlan
from hetero_llm.runtime import interpreter
from hetero_llm.runtime.emulation import Emulation
from hetero_llm.runtime.interpreter import Microbatch, StageRoutes, StageRunner
from hetero_llm.schedule import COMPUTE_KINDS, parse_actions

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
