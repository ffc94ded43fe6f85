"""The README's sample outputs cannot go stale: the losses it quotes are the ones the runs print.

- The quickstart block (400 steps, about a minute) is checked against ``docs/samples/quickstart.txt``, the
  run's output as ``bench/launch/readme_samples.py`` recorded it (``python -m bench.launch.readme_samples --check`` reruns it);
  its loss floor is computed here.
- The own-text run (``layouts/examples/own_text.toml``, 300 steps on ``docs/samples/own_text_data.txt``, a frozen copy of
  the README) is run here, in the multiprocess tier (about a minute on 2 cores). It trained on the README
  itself once: then every edit of the README moved the losses the README quotes (by up to 0.2 nat for one new
  line, 0.07 for two digits replaced), so no quoted number could stay true.

Throughput and ETA depend on the machine and are never compared; a failure says the line to put in the README.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys

import pytest

from bench.launch import readme_samples as make
from harness import ROOT, free_port
from hetero_llm import layout as layout_mod
from hetero_llm.data import sources

README = ROOT / "README.md"


def quickstart_block() -> list[str]:
    """The console lines the README's quickstart section shows (without its '...' elisions)."""
    section = README.read_text().split("## Fresh machine", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"What you should see.*?\n```\n(.*?)\n```", section, flags=re.S).group(1)
    return [line for line in block.splitlines() if line.strip() != "..."]


def test_readme_quickstart_block_quotes_the_recorded_run():
    recorded = make.QUICKSTART.read_text().splitlines()
    shown = {make.deterministic(line) for line in recorded}
    position = -1
    for line in quickstart_block():
        if make.deterministic(line) not in shown:
            key = line.split("|", 1)[0] if line.startswith("step ") else line.split(":", 1)[0]
            actual = next((r for r in recorded if r.startswith(key)), "(no such line)")
            pytest.fail(
                f"README.md's quickstart block shows\n  {line}\nbut the quickstart prints "
                f"({make.QUICKSTART.relative_to(ROOT)})\n  {actual}\nput that line in the README (its tok/s and "
                f"ETA may stay as they are: they depend on the machine)"
            )
        index = [make.deterministic(r) for r in recorded].index(make.deterministic(line))
        assert index > position, f"README.md's quickstart block shows {line!r} out of order"
        position = index
    assert quickstart_block()[0] == recorded[0]  # the command's own first line, as the README runs it


def test_recorded_quickstart_has_the_grammars_loss_floor():
    """quickstart.txt's floor line is what the code computes for the layout now (a cheap staleness check of the
    record: the floor depends on the grammar and seq_len only)."""
    lay = layout_mod.load(ROOT / "layouts" / "quickstart.toml")
    source = sources.make_source(lay.data, lay.file)
    floor = source.loss_floor(lay.model.seq_len)
    line = next(r for r in make.QUICKSTART.read_text().splitlines() if r.startswith("data: "))
    assert f"loss floor {floor:.4f} nats/token" in line, (line, floor)
    assert f"uniform guess: {math.log(source.vocab_size):.4f}" in line, line
    # the prose: "within 0.1 nat of the floor 0.926"
    assert f"the floor {floor:.3f}" in README.read_text()
    last = [r for r in make.QUICKSTART.read_text().splitlines() if r.startswith("step ")][-1]
    assert float(re.search(r"\| loss (\d+\.\d+)", last).group(1)) - floor < 0.1, last


@pytest.mark.multiprocess
def test_readme_quotes_the_own_text_runs_final_losses(tmp_path):
    """``hetero-launch layouts/examples/own_text.toml`` run as the README says (on a copy of its text, so the token cache
    lands here), its last line's losses compared with the ones the README quotes, within 0.15 (CPUs round differently)."""
    (tmp_path / "layouts" / "examples").mkdir(parents=True)
    (tmp_path / "docs" / "samples").mkdir(parents=True)
    shutil.copy(ROOT / "layouts" / "examples" / "own_text.toml", tmp_path / "layouts" / "examples")
    shutil.copy(ROOT / "docs" / "samples" / "own_text_data.txt", tmp_path / "docs" / "samples")
    steps = layout_mod.load(ROOT / "layouts" / "examples" / "own_text.toml").train.steps
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    # torch's scalar kernels and MKL's processor-independent GEMM path, as the README says: the vector kernels (AVX2,
    # AVX-512) sum in another order per CPU, and 300 steps at lr 1e-2 carry that into the second decimal (2.80 on an
    # AVX2 VM; 2.65 there with the scalar torch kernels alone, 2.74 on an AVX-512 VM, whose MKL sgemm differs)
    env["ATEN_CPU_CAPABILITY"] = "default"
    env["MKL_CBWR"] = "COMPATIBLE"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hetero_llm.cli",
            "layouts/examples/own_text.toml",
            "--set",
            f"cluster.port={free_port()}",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    last = next(line for line in proc.stdout.splitlines() if line.startswith(f"step {steps:>5}/{steps} |"))
    loss, valid = re.match(r"step +\d+/\d+ \| loss (\d+\.\d+) \| valid (\d+\.\d+) \|", last).groups()
    quoted = re.search(r"`step (\d+)/\d+ \| loss ([\d.]+) \| valid ([\d.]+) \| \.\.\.`", README.read_text())
    assert quoted is not None, "README.md no longer quotes the own-text run's last line"
    assert int(quoted.group(1)) == steps, f"README.md quotes step {quoted.group(1)}; own_text.toml runs {steps} steps"
    # within 0.15, not to the digit: the flags pin the kernels' order on one CPU, not across CPUs (README: 2.62/2.66 on
    # an AVX2 EPYC, 2.67/2.78 on an AVX-512 VM); a broken model or data path lands far outside (the first step is ~5.5)
    for name, printed, said in (("loss", loss, quoted.group(2)), ("valid", valid, quoted.group(3))):
        assert abs(float(printed) - float(said)) <= 0.15, (
            f"README.md quotes {name} {said} for layouts/examples/own_text.toml, but it prints\n  {last}\nput "
            f"`step {steps}/{steps} | loss {float(loss):.2f} | valid {float(valid):.2f} | ...` in the README"
        )
