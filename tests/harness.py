"""Run layouts as a user would (``hetero-launch``, forked from a warm interpreter: tests/helpers_launch.py) and
compare against a reference.

Torch is imported only by the functions that read checkpoints, so the torch-free test files that use
``invoke_cli`` and ``assert_one_error_line`` run without torch installed (tests/unit/test_torch_free.py).
"""

from __future__ import annotations

import inspect
import json
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
from click.testing import CliRunner
from helpers_launch import run_cli

from hetero_llm import layout
from hetero_llm.checkpoint import folders
from hetero_llm.cli.launch import main
from hetero_llm.layout import reader

if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = ROOT / "layouts"
# Every layout the repository ships (cluster files, which hold no [[pipelines]], are not layouts); the
# planned layouts of the papers' clusters are layouts too, but too big to run here. The published runs'
# layouts (bench/planner/published.py writes them: CUDA, up to 2520 GPUs) are only checked as files.
PUBLISHED_LAYOUTS = sorted((LAYOUTS / "papers" / "published").glob("*.toml"))
SWEEP_FILES = sorted((LAYOUTS / "sweeps").glob("*.toml"))  # hetero-sweep's files, not layouts (unit/test_sweep.py)
LAYOUT_FILES = sorted(
    p
    for p in LAYOUTS.rglob("*.toml")
    if "clusters" not in p.relative_to(LAYOUTS).parts[:-1] and p not in PUBLISHED_LAYOUTS and p not in SWEEP_FILES
)
PAPER_SIZED = {"planned/hexiscale_40gpu.toml", "planned/holmes_64gpu.toml", "planned/mixed_1024gpu.toml"}
RUNNABLE_LAYOUTS = [p for p in LAYOUT_FILES if p.relative_to(LAYOUTS).as_posix() not in PAPER_SIZED]
RTOL = 1e-5  # float32 layout-invariance tolerance (relative; see docs/invariance.md)
TENSOR_RTOL = 1e-4  # per parameter tensor (see assert_same_model)


GPU_SKIP = "needs CUDA; runs on a GPU machine (see README 'GPU tests')"  # the reason every GPU test skips with


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@attrs.frozen
class RunResult:
    losses: list[float]
    grad_norms: list[float]
    params: dict[str, torch.Tensor]
    stdout: str
    stderr: str
    workdir: Path | None = None  # where metrics.jsonl and the checkpoint root ckpt/ are


def invoke_cli(*args):
    """``hetero-launch ARGS`` in this process (click's CliRunner), stdout and stderr apart."""
    # click < 8.2 mixes stderr into output unless told not to; 8.2 removed the flag and always separates
    if "mix_stderr" in inspect.signature(CliRunner.__init__).parameters:
        runner = CliRunner(mix_stderr=False)
    else:
        runner = CliRunner()
    return runner.invoke(main, [str(a) for a in args])


def assert_one_error_line(result, expected: str) -> None:
    """``result`` (of invoke_cli) is exactly the line ``error: expected`` on stderr, and exit code 2."""
    # CliRunner catches exceptions rather than printing them: an unexpected one shows here, not as a traceback
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.stderr
    assert result.stdout == ""
    assert result.stderr == f"error: {expected}\n"
    assert result.exit_code == 2


def sigint_as_in_a_terminal() -> None:
    """``preexec_fn`` for a process a test sends Ctrl-C (SIGINT): give it SIGINT's default disposition.
    A suite started in the background by a non-interactive shell (``pytest &``) inherits SIGINT ignored, and
    so would every process it starts; Python then never raises KeyboardInterrupt, as with any program."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def launch(
    layout: Path, workdir: Path, *extra: str, timeout: float = 600, env: dict[str, str] | None = None
) -> RunResult:
    """Run ``hetero-launch layout`` to completion; return its metrics and final parameters. ``env``: variables
    set for this run only, over this process's environment (for launches run side by side in threads)."""
    from hetero_llm.checkpoint.shards import load_full_params

    metrics, ckpt = workdir / "metrics.jsonl", workdir / "ckpt"
    args = [
        str(layout),
        "--quiet",
        "--metrics-jsonl",
        str(metrics),
        "--checkpoint",
        str(ckpt),
        "--set",
        f"cluster.port={free_port()}",
        *extra,
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")} | (env or {})
    proc = run_cli(args, env, timeout)  # python -m hetero_llm.cli ARGS, forked from a warm interpreter
    cmd = proc.args
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    assert_copies_agree(ckpt)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return RunResult(
        [r["loss"] for r in rows],
        [r["grad_norm"] for r in rows],
        load_full_params(str(ckpt)),
        proc.stdout,
        proc.stderr,
        workdir,
    )


def assert_copies_agree(ckpt: Path) -> None:
    """Every copy of every parameter element (TP replicas, other pipelines' shards) is bitwise equal.

    Holders of a block get the same summed gradient and run the same elementwise AdamW, so any
    difference means a block was not synced (or replicas drifted). ``ckpt``: the newest save of a root.
    """
    import torch

    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # name -> (values, written mask) in full shape
    saved = folders.find(ckpt)
    for path in (saved.rank_file(r) for r in range(saved.world_size)):
        for name, shard in torch.load(path)["shards"].items():
            dim, lo, hi, shape = shard["coords"]
            if name not in seen:
                seen[name] = (torch.zeros(tuple(shape)), torch.zeros(tuple(shape), dtype=torch.bool))
            values, written = seen[name]
            region = (slice(None),) * (dim or 0) + (slice(lo, hi),) if dim is not None else (slice(None),)
            old, mask = values[region], written[region]
            new = shard["tensor"]
            assert torch.equal(old[mask], new[mask]), f"{name}: copies on different ranks differ ({path.name})"
            values[region] = new
            written[region] = True


def assert_same_model(run: RunResult, ref: RunResult, rtol: float = RTOL) -> None:
    """Per-step losses within ``rtol``; all final parameters within ``rtol`` (relative L2 over the model).

    Each tensor must also be within ``TENSOR_RTOL``: a layout bug (a block never synced, a shard from
    the wrong rows) shows up as errors of 1e-2 or more in its tensor. Tighter per-tensor bounds would
    measure float32 summation order instead: Adam's first update is ~lr*sign(g), so elements whose
    gradient is ~0 flip with rounding noise; one process with 3 vs 2 microbatches already differs by
    4e-6 in single tensors (docs/invariance.md).
    """
    import torch

    assert len(run.losses) == len(ref.losses)
    for step, (a, b) in enumerate(zip(run.losses, ref.losses)):
        assert abs(a - b) <= rtol * abs(b), f"step {step}: loss {a!r} vs reference {b!r}"
    for step, (a, b) in enumerate(zip(run.grad_norms, ref.grad_norms)):
        assert abs(a - b) <= rtol * abs(b), f"step {step}: grad norm {a!r} vs reference {b!r}"
    assert set(run.params) == set(ref.params)
    diff = ref_sq = 0.0
    for name, want in ref.params.items():
        got = run.params[name]
        assert not torch.isnan(got).any(), f"{name}: some shard was never written"
        err = float((got - want).norm() / want.norm())
        assert err <= TENSOR_RTOL, f"{name}: relative error {err:.2e} > {TENSOR_RTOL:.0e}"
        diff += float((got - want).double().pow(2).sum())
        ref_sq += float(want.double().pow(2).sum())
    total = (diff / ref_sq) ** 0.5
    assert total <= rtol, f"parameters: relative error {total:.2e} > {rtol:.0e}"


def write_layout(
    path: Path, common: str, pipelines: list[tuple[int, int, list[tuple[int, int]]]], schedule: str | None = None
) -> Path:
    """A layout from ``common`` ([model]/[train]/[data]) and pipelines [(batch, microbatches, [(layers, tp)])].

    Every pipeline gets its own node, its stages' devices in order. ``schedule`` replaces train.schedule.
    """
    model, train, data = sections(common, path)
    if schedule:
        train = attrs.evolve(train, schedule=layout.Schedule(schedule))
    cluster, pipes = own_nodes(pipelines)
    layout.dump(
        layout.Layout(file=str(path), model=model, train=train, data=data, cluster=cluster, pipelines=pipes), path
    )
    return path


def own_nodes(
    pipelines: list[tuple[int, int, list[tuple[int, int]]]], device: str = "cpu", name: str = "n"
) -> tuple[layout.ClusterSpec, tuple[layout.PipelineSpec, ...]]:
    """The [cluster] and [[pipelines]] of pipelines [(batch, microbatches, [(layers, tp)])], each pipeline on a
    node of its own (``n0``, ``n1``, ...) of ``device`` devices, its stages' devices in order."""
    nodes, pipes = [], []
    for pi, (batch, mbs, stages) in enumerate(pipelines):
        nodes.append(layout.NodeSpec(name=f"{name}{pi}", devices=(device,) * sum(tp for _, tp in stages)))
        specs, d = [], 0
        for layers, tp in stages:
            specs.append(layout.StageSpec(layers=layers, devices=tuple(f"{name}{pi}:{d + i}" for i in range(tp))))
            d += tp
        pipes.append(layout.PipelineSpec(batch=batch, microbatches=mbs, stages=tuple(specs)))
    return layout.ClusterSpec(nodes=tuple(nodes)), tuple(pipes)


def sections(common: str, path: Path | str = "<common>") -> tuple[layout.ModelSpec, layout.TrainSpec, layout.DataSpec]:
    """The [model], [train] and [data] tables of TOML text, typed as the loader types them (paths as written)."""
    raw = reader.parse(common, str(path))
    assert set(raw) <= {"model", "train", "data"}, f"common sections hold more than [model]/[train]/[data]: {set(raw)}"
    return tuple(
        layout.build(cls, raw.get(name, {}), name, str(path))  # type: ignore[return-value]
        for name, cls in (("model", layout.ModelSpec), ("train", layout.TrainSpec), ("data", layout.DataSpec))
    )


def common_sections(layout: Path) -> str:
    """The [model]/[train]/[data] part of a layout file (everything before [cluster])."""
    return layout.read_text().split("[cluster]")[0]


def rank0_off_master_layout(
    path: Path, hosts: tuple[str, str] = ("127.0.0.1", "127.0.0.1"), timeout_s: float = 60
) -> Path:
    """The reference model on two nodes, node0 the master: stage 0 (rank 0) on node1, stage 1 (rank 1) on node0,
    so the rendezvous is served by rank 1, not rank 0."""
    model, train, data = sections(common_sections(LAYOUTS / "reference" / "reference.toml"), path)
    cluster = layout.ClusterSpec(
        nodes=(layout.NodeSpec(name="node0", host=hosts[0]), layout.NodeSpec(name="node1", host=hosts[1])),
        timeout_s=float(timeout_s),
    )
    stages = (layout.StageSpec(layers=3, devices=("node1:0",)), layout.StageSpec(layers=3, devices=("node0:0",)))
    layout.dump(
        layout.Layout(
            file=str(path),
            model=model,
            train=train,
            data=data,
            cluster=cluster,
            pipelines=(layout.PipelineSpec(batch=12, microbatches=3, stages=stages),),
        ),
        path,
    )
    return path


# ------------------------------------------------------------------------------------------
# Hugging Face models and tokenizers built here (never downloaded); torch and transformers load on use.

TINY_HF = {  # the transformers config of a tiny model of each kind, and the [model] lines that describe it
    "llama": (
        dict(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=16,
            rms_norm_eps=1e-6,
        ),
        'layers = 2\nhidden = 32\nheads = 4\nvocab = 64\nseq_len = 16\nnorm = "rmsnorm"\nposition = "rope"\n'
        'mlp = "swiglu"\nffn = 48\nnorm_eps = 1e-6\n',
    ),
    "gpt2": (
        dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=16),
        "layers = 2\nhidden = 32\nheads = 4\nvocab = 64\nseq_len = 16\nbias = true\ntie_embeddings = true\n",
    ),
}


def tiny_hf_model(kind: str, folder: Path | None, seed: int = 0, **overrides):
    """A tiny transformers ``kind`` ('llama' or 'gpt2') model, ``TINY_HF``'s config updated with ``overrides``,
    with every parameter (norms and biases too) moved away from its init; saved in ``folder`` when given."""
    import torch
    import transformers

    kwargs = {**TINY_HF[kind][0], **overrides}
    torch.manual_seed(seed)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs))
    else:
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**kwargs))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.eval()
    if folder is not None:
        model.save_pretrained(folder)
    return model


def hf_layout_text(model_lines: str, init_from: Path | str) -> str:
    """A one-process layout whose [model] is ``model_lines`` (with ``layers = 2``) started from ``init_from``."""
    return (
        f'[model]\n{model_lines}init_from = "{init_from}"\n[train]\nsteps = 1\nglobal_batch = 1\n[cluster]\n'
        '[[cluster.nodes]]\nname = "n"\n[[pipelines]]\nbatch = 1\nmicrobatches = 1\n[[pipelines.stages]]\n'
        'layers = 2\ndevices = ["n:0"]\n'
    )


def full_model_logits(params: dict, model, ids):
    """Our one-process logits of ``ids`` under ``params`` (full tensors by global name)."""
    from hetero_llm.model.forward import StageShape, stage_forward

    return stage_forward(params, ids, StageShape(0, model.layers, True, True), model)


def full_shards(model) -> list:
    """Every parameter whole, as ``Plan.params_of`` lists a one-process rank's shards."""
    from hetero_llm.model.params import all_params, shard_range

    return [(info, *shard_range(info, 1, 0)) for info in all_params(model)]


def relative_error(a, b) -> float:
    return float((a - b).norm() / b.norm())


def make_bpe_tokenizer(path: Path, texts: list[str], special: tuple[str, ...] = ("<|endoftext|>",)) -> Path:
    """A tiny byte-level BPE tokenizer.json trained here on ``texts``, with the ``special`` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=list(special), initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts * 5, trainer)
    tok.save(str(path))
    return path


def hf_folder(folder: Path, model) -> Path:
    """A model.init_from folder the checks before a run accept: config.json of ``model``, and a weights file whose
    header gives every tensor its shape (zeros: finite)."""
    import torch
    from safetensors.torch import save_file

    from hetero_llm.interop import hf_config, hf_names

    folder.mkdir()
    cfg = hf_config.hf_config(model)
    (folder / hf_names.CONFIG).write_text(json.dumps(cfg))
    save_file(
        {key: torch.zeros(shape) for key, shape in hf_names.hf_shapes(model, cfg).items()},
        str(folder / hf_names.WEIGHTS),
    )
    return folder
