"""Every command-line argument and environment variable is checked: one line, exit code 2, never a traceback.

Each command has ``--version`` and help text for every option; hetero-generate's flags are checked before
anything loads; every environment variable ``hetero-launch`` reads is refused in one line naming it, its
value and what it expects; absurd sizes (steps, memory) are refused before any rank starts.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest
from helpers_cli_args import invoke

from harness import LAYOUTS, assert_one_error_line, invoke_cli
from hetero_llm import layout as layout_mod
from hetero_llm.cli import export, generate, place, timeline, tokenize
from hetero_llm.cli import launch as cli_launch
from hetero_llm.cli import plan as cli_plan
from hetero_llm.data import batches, sources
from hetero_llm.errors import LayoutError
from hetero_llm.launch import memory
from hetero_llm.model.params import count_params
from hetero_llm.plan import compile_plan

REPO = Path(__file__).resolve().parents[2]

QUICKSTART = LAYOUTS / "quickstart.toml"

COMMANDS = [
    (cli_launch.main, "hetero-launch"),
    (place.main, "hetero-place"),
    (cli_plan.main, "hetero-plan"),
    (export.main, "hetero-export"),
    (tokenize.main, "hetero-tokenize"),
    (generate.main, "hetero-generate"),
    (timeline.main, "python -m hetero_llm.timeline"),
]

NAMES = [name for _, name in COMMANDS]


@pytest.mark.parametrize("command, name", COMMANDS, ids=NAMES)
def test_every_command_prints_its_name_and_the_package_version(command, name):
    result = invoke(command, "--version")
    assert (result.exit_code, result.stderr) == (0, "")
    assert result.stdout == f"{name} {importlib.metadata.version('hetero_llm')}\n"


@pytest.mark.parametrize("command, name", COMMANDS, ids=NAMES)
def test_every_option_has_help(command, name):
    with click.Context(command, info_name=name) as ctx:
        options = [p for p in command.get_params(ctx) if isinstance(p, click.Option)]
    assert {"--help", "--version"} <= {o for p in options for o in p.opts}
    for option in options:
        assert option.help and option.help.strip(), f"{name} {'/'.join(option.opts)} has no help text"


GENERATE_HELP = "(see hetero-generate --help)"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--temperature", "nan"], f"Invalid value for '--temperature': 'nan' is not a finite number {GENERATE_HELP}"),
        (["--temperature", "inf"], f"Invalid value for '--temperature': 'inf' is not a finite number {GENERATE_HELP}"),
        (
            ["--temperature", "-0.5"],
            f"Invalid value for '--temperature': -0.5 is not in the range x>=0 {GENERATE_HELP}",
        ),
        (
            ["--seed", str(2**70)],
            f"Invalid value for '--seed': {2**70} is not in the range 0<=x<={2**64 - 1} {GENERATE_HELP}",
        ),
        (["--seed", "-1"], f"Invalid value for '--seed': -1 is not in the range 0<=x<={2**64 - 1} {GENERATE_HELP}"),
        (
            ["--device", "tpu"],
            "Invalid value for '--device': 'tpu' is not a device this command runs on (give 'cpu' or "
            f"'cuda:N') {GENERATE_HELP}",
        ),
        (
            ["--device", "cuda:x"],
            "Invalid value for '--device': 'cuda:x' is not a device this command runs on (give "
            f"'cpu' or 'cuda:N') {GENERATE_HELP}",
        ),
        (["--top-k", "-1"], f"Invalid value for '--top-k': -1 is not in the range x>=0 {GENERATE_HELP}"),
        (
            ["--max-new-tokens", "0"],
            f"Invalid value for '--max-new-tokens': 0 is not in the range x>=1 {GENERATE_HELP}",
        ),
    ],
    ids=[
        "temperature-nan",
        "temperature-inf",
        "temperature-negative",
        "seed-2**70",
        "seed-negative",
        "device-tpu",
        "device-malformed",
        "top-k-negative",
        "max-new-tokens-zero",
    ],
)
def test_generate_flags_are_checked_before_anything_loads(tmp_path, args, message):
    """The checkpoint does not exist: a flag's error comes first, without loading anything."""
    assert_one_error_line(invoke(generate.main, tmp_path / "none", "--prompt", "1 2", *args), message)


def test_generate_on_cuda_without_cuda(tmp_path):
    import torch

    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        assert_one_error_line(
            invoke(generate.main, tmp_path, "--prompt", "1", "--device", f"cuda:{count}"),
            f"Invalid value for '--device': 'cuda:{count}' is not one of this machine's {count} "
            f"GPU(s) (use cuda:0 to cuda:{count - 1}) {GENERATE_HELP}",
        )
        return
    for device in ("cuda", "cuda:0"):
        assert_one_error_line(
            invoke(generate.main, tmp_path, "--prompt", "1", "--device", device),
            f"Invalid value for '--device': '{device}' needs CUDA, which this machine does not "
            f"have (use --device cpu) {GENERATE_HELP}",
        )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--simulate", "--stages", "0"], "Invalid value for '--stages': 0 is not in the range x>=1"),
        (["--simulate", "--forward-ms", "nan"], "Invalid value for '--forward-ms': 'nan' is not a finite number"),
        (["--simulate", "--latency-ms", "inf"], "Invalid value for '--latency-ms': 'inf' is not a finite number"),
        (["--simulate", "--chunks", "0"], "Invalid value for '--chunks': 0 is not in the range x>=1"),
    ],
    ids=["stages-0", "forward-nan", "latency-inf", "chunks-0"],
)
def test_timeline_flags(tmp_path, args, message):
    result = invoke(timeline.main, *args, "--chrome", tmp_path / "t.json")
    assert_one_error_line(result, f"{message} (see python -m hetero_llm.timeline --help)")
    assert not (tmp_path / "t.json").exists()


def test_plan_usage_error_is_one_line(tmp_path):
    assert_one_error_line(
        invoke(cli_plan.main, tmp_path / "c.toml", "--top", "many"),
        "Invalid value for '--top': 'many' is not a valid integer (see hetero-plan --help)",
    )


EMULATION = "(write RANK:VALUE entries separated by commas, RANK a rank or '*', e.g. "


@pytest.mark.parametrize(
    "var, value, message",
    [
        (
            "OMP_NUM_THREADS",
            "lots",
            "'lots' is not a whole number of CPU threads >= 1 (e.g. 4; unset it to share this "
            "host's cores among its ranks)",
        ),
        (
            "OMP_NUM_THREADS",
            "0",
            "'0' is not a whole number of CPU threads >= 1 (e.g. 4; unset it to share this host's "
            "cores among its ranks)",
        ),
        ("HETERO_DEBUG", "yes", "'yes' is not 0 or 1 (1: a rank's unexpected error is raised with its traceback)"),
        (
            "HETERO_TENSOR_METER",
            "/nonexistent-hetero-meter",
            "'/nonexistent-hetero-meter' is not an existing folder (for each rank's tensor peak; create it, or unset it)",
        ),
        (
            "HETERO_SHM_DIR",
            "shm",
            "'shm' is not the absolute path of a folder (for shared memory, e.g. /dev/shm; give one, or unset it)",
        ),
        (
            "HETERO_SHM_DIR",
            "",
            "'' is not the absolute path of a folder (for shared memory, e.g. /dev/shm; give one, or unset it)",
        ),
        (
            "HETERO_LLM_CACHE",
            str(QUICKSTART),
            f"'{QUICKSTART}' is not the absolute path of a folder (for token caches; give one, or unset it)",
        ),
        (
            "XDG_CACHE_HOME",
            "cache",
            "'cache' is not the absolute path of a folder (for user caches, e.g. ~/.cache, as "
            "the XDG spec asks; give one, or unset it)",
        ),
        (
            "TORCHELASTIC_USE_AGENT_STORE",
            "yes",
            "'yes' is not True or False (torchrun sets it; unset it outside torchrun)",
        ),
        (
            "TORCHELASTIC_RESTART_COUNT",
            "-1",
            "'-1' is not a number of restarts (torchrun sets it; unset it outside torchrun)",
        ),
        (
            "MASTER_ADDR",
            "10.0.0.1:29500",
            "'10.0.0.1:29500' is not a host name or an IP address (e.g. 10.0.0.1, without "
            "a port: that is MASTER_PORT; or unset it to meet at the master node's host)",
        ),
        (
            "HETERO_EMULATE_SLOWDOWN",
            "*:fast",
            f"'*:fast': 'fast' is not a slowdown factor >= 1 {EMULATION}'*:1.5' or '1:2,*:1')",
        ),
        (
            "HETERO_EMULATE_SLOWDOWN",
            "*:0.5",
            f"'*:0.5': '0.5' is not a slowdown factor >= 1 {EMULATION}'*:1.5' or '1:2,*:1')",
        ),
        (
            "HETERO_EMULATE_JITTER",
            "5:0.1",
            f"'5:0.1': '5' is not '*' or one of the layout's ranks 0..1 {EMULATION}'*:0.6')",
        ),
        ("HETERO_EMULATE_JITTER", "0.1", f"'0.1': '0.1' has no ':' {EMULATION}'*:0.6')"),
        (
            "HETERO_EMULATE_ACTION_S",
            "*:F=1;X=2",
            f"'*:F=1;X=2': 'X' is not a compute action (F, B, I or W) {EMULATION}"
            "'*:F=0.02;B=0.04' or '0:F=0.01;B=0.02;I=0.012;W=0.008')",
        ),
        (
            "HETERO_EMULATE_ACTION_S",
            "0:F=nan",
            f"'0:F=nan': F = 'nan' is not a number of seconds >= 0 {EMULATION}"
            "'*:F=0.02;B=0.04' or '0:F=0.01;B=0.02;I=0.012;W=0.008')",
        ),
        (
            "HETERO_EMULATE_DEVICE",
            "*:gflops=-1",
            f"'*:gflops=-1': emulated device: gflops must be >= 0, got -1 "
            f"{EMULATION}'*:gflops=100;tp_gbps=200;tp_latency_us=5')",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) and len(v) < 30 else None,
)
def test_bad_environment_variable_is_one_line(monkeypatch, var, value, message):
    monkeypatch.setenv(var, value)
    assert_one_error_line(invoke_cli(QUICKSTART, "--dry-run"), f"environment: {var}: {message}")


def test_good_environment_variables_pass(monkeypatch, tmp_path):
    for var, value in [
        ("OMP_NUM_THREADS", "2"),
        ("HETERO_DEBUG", "0"),
        ("HETERO_SHM_DIR", str(tmp_path)),
        ("HETERO_LLM_CACHE", str(tmp_path / "cache")),
        ("MASTER_ADDR", "127.0.0.1"),
        ("XDG_CACHE_HOME", ""),
        ("HETERO_EMULATE_SLOWDOWN", "*:1.5,1:2"),
        ("HETERO_EMULATE_JITTER", "0:0.3"),
        ("HETERO_EMULATE_ACTION_S", "*:F=0.02;B=0.04"),
    ]:
        monkeypatch.setenv(var, value)
    result = invoke_cli(QUICKSTART, "--dry-run")
    assert result.exit_code == 0, result.stderr


def test_steps_written_as_a_huge_float_names_the_bound():
    assert_one_error_line(
        invoke_cli(QUICKSTART, "--dry-run", "--set", "train.steps=1e23"),
        f"{QUICKSTART}: train.steps: expected an integer, got a float (1e+23), and must be <= "
        "1000000000, got 1e+23 (a run of more steps cannot finish: 10^9 steps take 11.6 days even "
        "at 1 ms a step)",
    )


def _plan(*overrides: str):
    return compile_plan(layout_mod.load(QUICKSTART, list(overrides)))


def test_token_estimate_is_the_batch_every_rank_draws():
    """The 'tokens' part is the size of the array batches.global_batch allocates in every rank."""
    plan = _plan("train.global_batch=32", "pipelines[0].batch=32")
    lay = plan.layout
    source = sources.make_source(lay.data, lay.file)
    drawn = batches.global_batch(source, lay.train.seed, 0, lay.train.global_batch, lay.model.seq_len)
    for rank in range(plan.world_size):
        assert memory.memory_parts(plan, rank)["tokens"] == drawn.nbytes


def test_parameter_estimate_counts_every_parameter_once_per_holder():
    """16 bytes (weight, gradient, two AdamW moments) per parameter: over the ranks, the model's count."""
    plan = _plan()
    total = sum(
        memory.memory_parts(plan, r)["blocks"] + memory.memory_parts(plan, r)["embeddings"]
        for r in range(plan.world_size)
    )
    assert total == 16 * count_params(plan.layout.model)


def test_a_context_parallel_rank_holds_its_share_of_the_positions():
    """A stage of cp 2 x TP 2: each rank keeps a TP shard of the parameters (as TP 2 alone) and the activations
    of half of every row's positions at half the width (as TP 2 x 1 / cp)."""
    cp = compile_plan(layout_mod.load(QUICKSTART.parent / "examples" / "context_parallel.toml"))
    tp = compile_plan(
        layout_mod.load(
            QUICKSTART.parent / "examples" / "context_parallel.toml",
            ["pipelines[0].stages[0].cp=1", "pipelines[0].stages[0].devices=['node0:0','node0:1']"],
        )
    )
    with_cp, without = memory.memory_parts(cp, 0), memory.memory_parts(tp, 0)
    assert with_cp["blocks"] == without["blocks"] and with_cp["embeddings"] == without["embeddings"]
    assert with_cp["activations"] * 2 == without["activations"] > 0


def test_the_named_bound_is_the_largest_value_that_fits():
    """A vocabulary too big for the memory given: the bound named fits, one more does not."""
    ram = 2**30
    with pytest.raises(LayoutError) as info:
        memory.check_memory(_plan("model.vocab=10000000"), [0, 1], ram=ram)
    assert (info.value.path, info.value.file) == ("model.vocab", str(QUICKSTART))
    bound = int(info.value.message.split("at most ")[1].split(" fits")[0])
    memory.check_memory(_plan(f"model.vocab={bound}"), [0, 1], ram=ram)
    with pytest.raises(LayoutError):
        memory.check_memory(_plan(f"model.vocab={bound + 1}"), [0, 1], ram=ram)


def test_a_gpu_is_checked_against_its_own_memory():
    """A GPU rank keeps only its token ids in RAM; the rest is held against the device's memory."""
    plan = _plan("cluster.nodes[0].devices=['cuda:0','cuda:1']")
    parts = [memory.memory_parts(plan, r) for r in range(2)]
    on_gpu0 = sum(parts[0].values()) - parts[0]["tokens"]
    memory.check_memory(
        plan, [0, 1], ram=2 * parts[0]["tokens"], device_memory=lambda d: on_gpu0 if d == "cuda:0" else 2**40
    )
    with pytest.raises(LayoutError) as info:
        memory.check_memory(plan, [0, 1], ram=2 * parts[0]["tokens"], device_memory=lambda d: on_gpu0 - 1)
    assert "of memory on cuda:0 for rank(s) 0," in info.value.message


def test_a_global_batch_that_cannot_be_allocated_is_one_line_before_start():
    """Was 'MemoryError: Unable to allocate 507 GiB' in every rank, after /dev/shm warnings."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hetero_llm.cli",
            str(QUICKSTART),
            "--set",
            "train.global_batch=1000000000",
            "--set",
            "pipelines[0].batch=1000000000",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"error: {QUICKSTART}: train.global_batch: 1000000000 needs an estimated ")
    assert (
        f"of RAM on this host for rank(s) 0, 1, more than its {memory.host_memory_bytes() / 2**30:.1f} GiB"
        in proc.stderr
    )
    assert memory.MEMORY_RULE in proc.stderr


def test_gpu_memory_comes_from_nvidia_smi_without_torch(tmp_path, monkeypatch):
    """Asked of nvidia-smi (torch would initialize CUDA in the launcher, which forked ranks cannot inherit), by the
    physical index CUDA_VISIBLE_DEVICES maps cuda:N to; unknown (not checked) without nvidia-smi."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text('#!/bin/sh\ncase "$1" in --id=3) echo 81559 ;; --id=0) echo 40960 ;; *) exit 6 ;; esac\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert memory._gpu_memory("cuda:0") == 40960 * 2**20
    assert memory._gpu_memory("cuda:1") is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,0")
    assert memory._gpu_memory("cuda:0") == 81559 * 2**20
    assert memory._gpu_memory("cuda") == 81559 * 2**20
    assert memory._gpu_memory("cuda:2") is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-5f1e")
    assert memory._gpu_memory("cuda:0") is None
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert memory._gpu_memory("cuda:0") is None
