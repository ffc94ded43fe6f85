"""README "Your own text, then Hugging Face": every command of both blocks runs as written (a few steps
instead of 300) and does what the README says it does."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers", reason="the 'test' extra installs transformers")

from harness import ROOT, free_port  # noqa: E402
from test_tokenfiles import make_tokenizer, write_jsonl  # noqa: E402

pytestmark = pytest.mark.multiprocess

# console script -> module (checked against pyproject.toml below), so the test needs no reinstall
SCRIPTS = {"hetero-launch": "hetero_llm.cli", "hetero-generate": "hetero_llm.generate",
           "hetero-export": "hetero_llm.export", "hetero-tokenize": "hetero_llm.tokenfiles"}
FEW_STEPS = ["--set", "train.steps=4", "--set", "train.eval_every=2", "--set", "train.log_every=1"]


def readme_blocks() -> list[list[str]]:
    section = (ROOT / "README.md").read_text().split("## Your own text, then Hugging Face\n", 1)[1].split("\n## ")[0]
    return [[line for line in block.splitlines() if line.strip()] for block in re.findall(r"```bash\n(.*?)```", section, re.S)]


def test_scripts_are_declared():
    text = (ROOT / "pyproject.toml").read_text()
    for script, module in SCRIPTS.items():
        assert f'{script} = "{module}:' in text


def run(line: str, cwd: Path) -> str:
    """One README command, in ``cwd``: the script through its module (the few-step settings for a launch)."""
    line = line.split("  # ")[0].replace("$PWD", str(cwd))
    argv = shlex.split(line)
    if argv[0] in SCRIPTS:
        argv = [sys.executable, "-m", SCRIPTS[argv[0]], *argv[1:]]
        if SCRIPTS[line.split()[0]] == "hetero_llm.cli":
            argv += FEW_STEPS + ["--set", f"cluster.port={free_port()}"]
    else:
        assert argv[0] == "python"
        argv[0] = sys.executable
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, f"{line}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture
def workdir(tmp_path):
    """A copy of the README and the layout, so caches and runs land here, not in the repository."""
    (tmp_path / "layouts").mkdir()
    shutil.copy(ROOT / "layouts" / "own_text.toml", tmp_path / "layouts")
    shutil.copy(ROOT / "README.md", tmp_path)
    return tmp_path


def test_own_text_to_transformers(workdir):
    train, sample, export, load = readme_blocks()[0]
    out = run(train, workdir)
    assert re.search(r"step +2/4 \| loss \d\.\d{4} \| valid \d\.\d{4} \|", out), out
    prompt = re.search(r'--prompt "([^"]+)"', sample).group(1)
    assert run(sample, workdir).startswith(prompt)
    run(export, workdir)
    name, count = run(load, workdir).split()
    said = re.search(r"Step 4 prints\s+`(\w+) (\d+)`", (ROOT / "README.md").read_text())
    assert (name, count) == said.groups()


def test_with_a_tokenizer_and_a_token_file(workdir):
    tokenize, train = readme_blocks()[1]
    make_tokenizer(workdir / "tokenizer.json")
    (workdir / "corpus.jsonl").write_text(write_jsonl(workdir / "docs.jsonl").read_text() * 100)
    assert "tokens (uint16) to corpus.bin" in run(tokenize, workdir)
    run(train, workdir)
    ckpt = re.search(r"--checkpoint (\S+)", train).group(1)
    assert run(f"hetero-generate {ckpt} --prompt 'the cat' --max-new-tokens 5", workdir).startswith("the cat")
    run(f"hetero-export {ckpt} --hf hf-out", workdir)
    tok = transformers.AutoTokenizer.from_pretrained(workdir / "hf-out")
    from hetero_llm import tokens

    ours = tokens.load(str(workdir / "tokenizer.json"))
    assert tok("the dog sat")["input_ids"] == ours.encode("the dog sat")
    assert tok.eos_token_id == ours.eos_id
