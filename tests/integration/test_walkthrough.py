"""README "Your own text, then Hugging Face": every command of both blocks runs as written (a few steps
instead of 300) and does what the README says it does."""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

transformers = pytest.importorskip("transformers", reason="the 'test' extra installs transformers")

from helpers_text import make_tokenizer, write_jsonl

from harness import ROOT, free_port

pytestmark = pytest.mark.multiprocess

# console script -> module (checked against pyproject.toml below), so the test needs no reinstall
SCRIPTS = {
    "hetero-launch": "hetero_llm.cli.launch",
    "hetero-generate": "hetero_llm.cli.generate",
    "hetero-export": "hetero_llm.cli.export",
    "hetero-tokenize": "hetero_llm.cli.tokenize",
}
FEW_STEPS = ["--set", "train.steps=4", "--set", "train.eval_every=2", "--set", "train.log_every=1"]


def readme_blocks() -> list[list[str]]:
    section = (ROOT / "README.md").read_text().split("## Your own text, then Hugging Face\n", 1)[1].split("\n## ")[0]
    return [
        [line for line in block.splitlines() if line.strip()]
        for block in re.findall(r"```bash\n(.*?)```", section, re.S)
    ]


def test_scripts_are_declared():
    text = (ROOT / "pyproject.toml").read_text()
    for script, module in SCRIPTS.items():
        assert f'{script} = "{module}:' in text


def run(line: str, cwd: Path, monkeypatch) -> str:
    """One README command, in ``cwd``: a launch as a subprocess (a few steps), the other scripts through
    their click commands and the ``python -c`` line through exec, in this process (no interpreter start)."""
    line = line.split("  # ")[0].replace("$PWD", str(cwd))
    argv = shlex.split(line)
    monkeypatch.chdir(cwd)
    if argv[0] == "hetero-launch":
        argv = [sys.executable, "-m", SCRIPTS[argv[0]], *argv[1:], *FEW_STEPS, "--set", f"cluster.port={free_port()}"]
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=240, env=env)
        assert proc.returncode == 0, f"{line}\n{proc.stdout}\n{proc.stderr}"
        return proc.stdout
    if argv[0] == "python":
        assert argv[1] == "-c"
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(argv[2], {})
        return out.getvalue()
    module = importlib.import_module(SCRIPTS[argv[0]])
    result = CliRunner().invoke(module.main, argv[1:])
    assert result.exit_code == 0, f"{line}\n{result.output}"
    return result.output


@pytest.fixture
def workdir(tmp_path):
    """A copy of the layout and its text, so caches and runs land here, not in the repository."""
    (tmp_path / "layouts").mkdir()
    (tmp_path / "layouts" / "examples").mkdir()
    (tmp_path / "docs" / "samples").mkdir(parents=True)
    shutil.copy(ROOT / "layouts" / "examples" / "own_text.toml", tmp_path / "layouts" / "examples")
    shutil.copy(ROOT / "docs" / "samples" / "own_text_data.txt", tmp_path / "docs" / "samples")
    return tmp_path


def test_own_text_to_transformers(workdir, monkeypatch):
    train, sample, export, load = readme_blocks()[0]
    out = run(train, workdir, monkeypatch)
    assert re.search(r"step +2/4 \| loss \d\.\d{4} \| valid \d\.\d{4} \|", out), out
    prompt = re.search(r'--prompt "([^"]+)"', sample).group(1)
    assert run(sample, workdir, monkeypatch).startswith(prompt)
    run(export, workdir, monkeypatch)
    name, count = run(load, workdir, monkeypatch).split()
    said = re.search(r"Step 4 prints\s+`(\w+) (\d+)`", (ROOT / "README.md").read_text())
    assert (name, count) == said.groups()


def test_with_a_tokenizer_and_a_token_file(workdir, monkeypatch):
    tokenize, train = readme_blocks()[1]
    make_tokenizer(workdir / "tokenizer.json")
    (workdir / "corpus.jsonl").write_text(write_jsonl(workdir / "docs.jsonl").read_text() * 100)
    assert "tokens (uint16) to corpus.bin" in run(tokenize, workdir, monkeypatch)
    assert "--set model.vocab=50304" in train  # GPT-2's vocabulary, padded; the tiny tokenizer here has 300
    run(train.replace("model.vocab=50304", "model.vocab=320"), workdir, monkeypatch)
    ckpt = re.search(r"--checkpoint (\S+)", train).group(1)
    assert run(f"hetero-generate {ckpt} --prompt 'the cat' --max-new-tokens 5", workdir, monkeypatch).startswith(
        "the cat"
    )
    run(f"hetero-export {ckpt} --hf hf-out", workdir, monkeypatch)
    tok = transformers.AutoTokenizer.from_pretrained(workdir / "hf-out")
    from hetero_llm.data import tokenizers

    ours = tokenizers.load(str(workdir / "tokenizer.json"))
    assert tok("the dog sat")["input_ids"] == ours.encode("the dog sat")
    assert tok.eos_token_id == ours.eos_id
