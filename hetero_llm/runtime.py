"""One interpreter loop that executes any schedule's action list on one rank.

Semantics (the validator in ``schedule`` simulates exactly these): sends are non-blocking and are
completed at the end of the step; a receive is posted at its RECV action and waited for by the
compute action that needs it; compute actions run in list order.
"""

from __future__ import annotations

import time

import attrs
import torch

from hetero_llm import comm
from hetero_llm.model import TP, StageShape, stage_forward, token_loss_sum
from hetero_llm.layout import ModelSpec
from hetero_llm.plan import Plan, Route
from hetero_llm.schedule import Action, Kind

FWD, BWD = 0, 1


@attrs.frozen
class StageRoutes:
    recv_f: Route | None
    send_f: tuple[Route, ...]
    recv_b: Route | None
    send_b: tuple[Route, ...]

    @classmethod
    def of(cls, plan: Plan, rank: int) -> "StageRoutes":
        def one(routes):
            mine = [r for r in routes if r.dst == rank]
            return mine[0] if mine else None

        return cls(one(plan.routes_f), tuple(r for r in plan.routes_f if r.src == rank),
                   one(plan.routes_b), tuple(r for r in plan.routes_b if r.src == rank))


@attrs.define
class Microbatch:
    inputs: torch.Tensor  # (b, T) token ids
    targets: torch.Tensor  # (b, T)


@attrs.define
class StageRunner:
    """Executes one rank's actions for one step; accumulates gradients into ``params``."""

    comms: comm.Comms
    params: dict[str, torch.Tensor]
    shape: StageShape
    model: ModelSpec
    tp: TP
    routes: StageRoutes
    trace: list | None = None  # (action string, start s, end s) per action, when tracing

    def run(self, actions: tuple[Action, ...], microbatches: list[Microbatch], global_tokens: int) -> torch.Tensor:
        """Run the step; returns this stage's summed loss share (0 on non-last stages)."""
        dtype = next(iter(self.params.values())).dtype
        device = self.comms.device
        inputs: dict[int, torch.Tensor] = {}
        outputs: dict[int, torch.Tensor] = {}
        recvs: dict[tuple[int, int], comm.PendingRecv] = {}
        grads_out: dict[int, torch.Tensor] = {}
        loss_total = torch.zeros((), dtype=torch.float64, device=device)

        def act_shape(m: int) -> tuple[int, ...]:
            b, t = microbatches[m].inputs.shape
            return (b, t, self.model.hidden)

        for a in actions:
            t0 = time.perf_counter()
            m = a.mb
            if a.kind is Kind.RECV_F:
                recvs[(FWD, m)] = comm.recv_boundary(self.comms, self.routes.recv_f, act_shape(m), dtype, FWD, m, a.chunk)
            elif a.kind is Kind.RECV_B:
                recvs[(BWD, m)] = comm.recv_boundary(self.comms, self.routes.recv_b, act_shape(m), dtype, BWD, m, a.chunk)
            elif a.kind is Kind.F:
                if self.shape.first:
                    x = microbatches[m].inputs.to(device)
                else:
                    x = recvs.pop((FWD, m)).wait(self.comms).requires_grad_()
                inputs[m] = x
                out = stage_forward(self.params, x, self.shape, self.model, self.tp)
                if self.shape.last:
                    loss = token_loss_sum(out, microbatches[m].targets.to(device))
                    loss_total += loss.detach().double()
                    out = loss / global_tokens  # mean over the GLOBAL batch: pipelines' grads then sum
                outputs[m] = out
            elif a.kind is Kind.SEND_F:
                comm.send_boundary(self.comms, outputs[m], list(self.routes.send_f), FWD, m, a.chunk)
            elif a.kind is Kind.B:
                out = outputs.pop(m)
                if self.shape.last:
                    out.backward()
                else:
                    grad = recvs.pop((BWD, m)).wait(self.comms)
                    torch.autograd.backward(out, grad)
                x = inputs.pop(m)
                if not self.shape.first:
                    grads_out[m] = x.grad
            elif a.kind is Kind.SEND_B:
                comm.send_boundary(self.comms, grads_out.pop(m), list(self.routes.send_b), BWD, m, a.chunk)
            else:
                raise NotImplementedError(f"action kind {a.kind} is not supported by this runtime yet")
            if self.trace is not None:
                self.trace.append((str(a), t0, time.perf_counter()))
        comm.wait_sends(self.comms)
        if recvs or outputs or inputs:
            raise RuntimeError(f"schedule left work undone: recvs {sorted(recvs)}, outputs {sorted(outputs)}")
        return loss_total
