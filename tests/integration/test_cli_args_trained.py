"""The tests of tests/unit/test_cli_args.py that start processes or train for real (the integration tier).

Every command-line argument and environment variable is checked: one line, exit code 2, never a traceback.

Each command has ``--version`` and help text for every option; hetero-generate's flags are checked before
anything loads; every environment variable ``hetero-launch`` reads is refused in one line naming it, its
value and what it expects; absurd sizes (steps, memory) are refused before any rank starts.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers_cli_args import invoke

from harness import LAYOUTS, assert_one_error_line, common_sections, launch, write_layout
from hetero_llm.cli import generate
from hetero_llm.interop import export as interop_export

QUICKSTART = LAYOUTS / "quickstart.toml"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A one-step checkpoint of the reference model (seq_len 16: below the default 64 new tokens)."""
    d = tmp_path_factory.mktemp("generate")
    common = common_sections(LAYOUTS / "reference" / "reference.toml").replace("steps = 3", "steps = 1")
    launch(write_layout(d / "layout.toml", common, [(12, 3, [(6, 1)])]), d)
    return d / "ckpt"


def _generate(trained, *args):
    return invoke(generate.main, trained, "--temperature", "0", *args)


def test_default_max_new_tokens_is_what_fits(trained):
    """With seq_len < 67 the default 64 is clamped: the same text as asking for exactly what fits."""
    seq_len = interop_export.saved(str(trained)).model.seq_len
    assert seq_len < 64 + 3
    default = _generate(trained, "--prompt", "1 2 3")
    assert default.exit_code == 0, default.stderr
    explicit = _generate(trained, "--prompt", "1 2 3", "--max-new-tokens", seq_len - 3)
    assert explicit.exit_code == 0, explicit.stderr
    assert default.stdout == explicit.stdout
    assert len(default.stdout.split()) == seq_len  # greedy on the grammar: no EOS ends it early


def test_generate_refuses_what_does_not_fit_the_model(trained):
    s = interop_export.saved(str(trained))
    where, seq_len, vocab = s.ckpt.path, s.model.seq_len, s.model.vocab
    assert_one_error_line(
        _generate(trained, "--prompt", "1 2 3", "--max-new-tokens", seq_len),
        f"{where}: --max-new-tokens: {seq_len} tokens after a prompt of 3 exceed model.seq_len "
        f"{seq_len}, the positions the model was trained on (use at most {seq_len - 3}, or a "
        "shorter prompt)",
    )
    assert_one_error_line(
        _generate(trained, "--prompt", " ".join(["1"] * seq_len)),
        f"{where}: --prompt: {seq_len} tokens leave no room for new ones in model.seq_len {seq_len}, "
        f"the positions the model was trained on (give at most {seq_len - 1} tokens)",
    )
    assert_one_error_line(
        _generate(trained, "--prompt", "1 2", "--top-k", vocab + 1),
        f"{where}: --top-k: {vocab + 1} is more than the model's {vocab} tokens (model.vocab; use "
        f"at most {vocab}, or 0 for all)",
    )
    assert_one_error_line(
        _generate(trained, "--prompt", "1 2", "--top-k", 2**70),
        f"{where}: --top-k: {2**70} is more than the model's {vocab} tokens (model.vocab; use "
        f"at most {vocab}, or 0 for all)",
    )


def test_a_vanishing_temperature_is_greedy(trained):
    """1e-45 overflows the scaled logits; its limit, greedy decoding, is what it gives (not a sampling error)."""
    greedy = _generate(trained, "--prompt", "1 2 3", "--max-new-tokens", 5)
    tiny = invoke(generate.main, trained, "--prompt", "1 2 3", "--max-new-tokens", 5, "--temperature", "1e-45")
    assert (greedy.exit_code, tiny.exit_code) == (0, 0)
    assert tiny.stdout == greedy.stdout


def test_omp_num_threads_in_a_real_launch():
    """Was a ValueError traceback from the launcher; now one line before any rank starts."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run(
        [sys.executable, "-m", "hetero_llm.cli", str(QUICKSTART), "--set", "train.steps=1"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "OMP_NUM_THREADS": "lots"},
    )
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == (
        "error: environment: OMP_NUM_THREADS: 'lots' is not a whole number of CPU threads >= 1 "
        "(e.g. 4; unset it to share this host's cores among its ranks)\n"
    )
