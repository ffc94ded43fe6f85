"""One rank of the ``torch.distributed.pipelining`` baseline that ``vs_torch_pipelining.py`` starts.

It trains the model of a hetero_llm layout file (one pipeline, TP size 1 per stage) with PyTorch's
own pipelining: ``PipelineStage`` around an ``nn.Module`` whose forward is ``hetero_llm.model.forward``'s
``stage_forward`` over the same parameters (same names, same initialization), ``ScheduleGPipe`` or
``Schedule1F1B``, gloo. The step around the schedule is the one ``hetero_llm.train.loop`` runs: the same
global batch (``batches.global_batch``), loss divided by the global token count, global-norm clipping
with one all-reduce, AdamW with the same groups and learning-rate schedule. So the two sides differ
only in the pipeline runtime.

    python -m bench.pipeline.torch_pp_rank LAYOUT.toml --rank R --port P [--metrics-jsonl F] [--profile OUT.prof]
"""

from __future__ import annotations

import cProfile
import json
import math
import time
from datetime import timedelta

import click
import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from hetero_llm import layout as layout_mod
from hetero_llm.data import batches, sources
from hetero_llm.model.forward import StageShape, stage_forward, token_loss_sum
from hetero_llm.plan import compile_plan
from hetero_llm.runtime.state import init_state
from hetero_llm.train.loop import lr_at

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class StageModule(torch.nn.Module):
    """``stage_forward`` over a stage's parameters, registered so PipelineStage sees them."""

    def __init__(self, params: dict[str, torch.Tensor], shape: StageShape, model):
        super().__init__()
        self.names = list(params)
        self.weights = torch.nn.ParameterList([torch.nn.Parameter(p.detach().clone()) for p in params.values()])
        self.shape, self.model = shape, model

    def params(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.weights))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return stage_forward(self.params(), x, self.shape, self.model)


class TorchPipeline:
    """One rank's stage under ``torch.distributed.pipelining`` and the training step around it."""

    def __init__(self, plan, rank: int, group: dist.ProcessGroup | None = None):
        lay = plan.layout
        if len(lay.pipelines) != 1 or any(s.tp != 1 or s.cp != 1 for s in plan.stages):
            raise click.UsageError("the baseline runs one pipeline with one rank per stage")
        self.train, self.model = lay.train, lay.model
        kind = "1f1b" if self.train.schedule.value == "dynamic" else self.train.schedule.value
        if kind not in SCHEDULES:
            raise click.UsageError(
                f"train.schedule '{kind}' has no torch baseline (choose from {', '.join(SCHEDULES)})"
            )
        self.group = group
        device = torch.device("cpu")
        st = self.st = plan.stage_of(rank)
        self.initial = init_state(
            plan.rank_plan(rank), device
        )  # same names and values as hetero_llm's ranks start from
        self.module = StageModule(
            self.initial.params, StageShape(st.layer_lo, st.layer_hi, st.first, st.last), self.model
        )
        stage = PipelineStage(self.module, st.stage, st.num_stages, device, group=group)
        self.global_tokens = global_tokens = self.train.global_batch * self.model.seq_len

        def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return token_loss_sum(logits, targets) / global_tokens  # mean over the global batch, as ours

        self.schedule = SCHEDULES[kind](stage, lay.pipelines[0].microbatches, loss_fn=loss_fn, scale_grads=False)
        self.params = self.module.params()
        self.source = sources.make_source(lay.data, lay.file)
        self.compute = 0.0  # seconds of this step in the stage's forwards and backwards (for the breakdown)
        stage.forward_one_chunk = self._timed(stage.forward_one_chunk)
        stage.backward_one_chunk = self._timed(stage.backward_one_chunk)
        self.reset()

    def _timed(self, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.compute += time.perf_counter() - t0

        return wrapper

    def reset(self) -> None:
        """Back to the initial parameters and a fresh AdamW (as a new run starts)."""
        tr, state = self.train, self.initial
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(state.params[name])
                p.grad = None
        names = sorted(self.params)
        groups = [
            {"params": [self.params[n] for n in names if state.decay[n]], "weight_decay": tr.weight_decay},
            {"params": [self.params[n] for n in names if not state.decay[n]], "weight_decay": 0.0},
        ]
        self.optimizer = torch.optim.AdamW(
            [g for g in groups if g["params"]], lr=tr.lr, betas=(tr.beta1, tr.beta2), eps=tr.eps
        )

    def step(self, step: int) -> dict:
        """One training step, as ``hetero_llm.train.loop`` runs it; returns its metrics row."""
        tr, st = self.train, self.st
        t0 = time.perf_counter()
        batch = torch.from_numpy(batches.global_batch(self.source, tr.seed, step, tr.global_batch, self.model.seq_len))
        losses: list[torch.Tensor] = []
        self.compute = 0.0
        t_schedule = time.perf_counter()
        if st.first:
            self.schedule.step(batch[:, :-1], return_outputs=False)
        elif st.last:
            self.schedule.step(target=batch[:, 1:], losses=losses, return_outputs=False)
        else:
            self.schedule.step(return_outputs=False)
        schedule_seconds = time.perf_counter() - t_schedule
        grads = [p.grad for p in self.params.values()]
        sq = sum(float(n) ** 2 for n in torch._foreach_norm(grads, dtype=torch.float64))
        loss_sum = float(sum(loss.detach().double() for loss in losses)) * self.global_tokens if losses else 0.0
        totals = torch.tensor([loss_sum, sq], dtype=torch.float64)
        dist.all_reduce(totals, group=self.group)
        loss, grad_norm = float(totals[0]) / self.global_tokens, math.sqrt(float(totals[1]))
        if tr.grad_clip > 0 and grad_norm + 1e-6 > tr.grad_clip:
            torch._foreach_mul_(grads, tr.grad_clip / (grad_norm + 1e-6))
        lr = lr_at(tr, step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {
            "step": step,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens": self.global_tokens,
            "seconds": time.perf_counter() - t0,
            "schedule_seconds": schedule_seconds,
            "compute_seconds": self.compute,
        }


@click.command()
@click.argument("layout_file", type=click.Path(exists=True, dir_okay=False))
@click.option("--rank", type=int, required=True)
@click.option("--port", type=int, required=True)
@click.option("--metrics-jsonl", type=click.Path(dir_okay=False), default=None)
@click.option(
    "--profile",
    type=click.Path(dir_okay=False),
    default=None,
    help="cProfile this rank from step --profile-after on; write the stats here.",
)
@click.option("--profile-after", default=2, show_default=True)
def main(
    layout_file: str, rank: int, port: int, metrics_jsonl: str | None, profile: str | None, profile_after: int
) -> None:
    plan = compile_plan(layout_mod.load(layout_file))
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=plan.world_size,
        timeout=timedelta(seconds=120),
    )
    pipeline = TorchPipeline(plan, rank)
    rows = []
    profiler = cProfile.Profile() if profile else None
    for step in range(plan.layout.train.steps):
        if profiler is not None and step == profile_after:
            profiler.enable()
        rows.append(pipeline.step(step))
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(profile)
    if rank == 0 and metrics_jsonl:
        with open(metrics_jsonl, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
