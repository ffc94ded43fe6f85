"""Bad flags, bad output paths and bad data: one line, exit code 2, before any rank starts.

Layout-file errors are in test_layout_errors.py and its corpus. Here: what only the command line or a run
(not a dry run) can get wrong. None of these runs forks a rank: each error is raised before.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from harness import assert_one_error_line
from harness import invoke_cli as invoke
from hetero_llm import layout as layout_mod
from hetero_llm.checkpoint.folders import FIX
from hetero_llm.data import text_cache
from hetero_llm.errors import LayoutError
from hetero_llm.launch import outputs

REPO = Path(__file__).resolve().parents[2]

QUICKSTART = REPO / "layouts" / "quickstart.toml"

HELP = "(see hetero-launch --help)"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--rank", "one"], f"Invalid value for '--rank': 'one' is not a valid integer {HELP}"),
        (["--dry-runn"], f"No such option '--dry-runn'. Did you mean '--dry-run'? {HELP}"),
        (["--checkpoint-every", "-1"], f"Invalid value for '--checkpoint-every': -1 is not in the range x>=0 {HELP}"),
        (["--set"], f"Option '--set' requires an argument {HELP}"),
    ],
    ids=["rank-not-a-number", "unknown-flag", "checkpoint-every-negative", "set-without-value"],
)
def test_usage_error_is_one_line(args, message):
    assert_one_error_line(invoke(QUICKSTART, "--dry-run", *args), message)


def test_missing_layout_argument():
    assert_one_error_line(invoke(), f"Missing argument 'LAYOUT.toml' {HELP}")


def test_help_still_prints_usage():
    result = invoke("--help")
    assert result.exit_code == 0
    assert result.stdout.startswith("Usage: hetero-launch [OPTIONS] LAYOUT.toml")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--rank", "2"], "--rank: rank 2 is not in this layout (ranks 0..1)"),
        (["--node", "node9"], "--node: 'node9' is not a node of [cluster] (nodes: node0)"),
    ],
    ids=["rank", "node"],
)
def test_dry_run_checks_node_and_rank_like_the_run(args, message):
    for extra in (["--dry-run"], []):
        assert_one_error_line(invoke(QUICKSTART, *extra, *args), f"{QUICKSTART}: {message}")


def test_dry_run_on_a_machine_of_another_cluster_is_fine(tmp_path):
    """Without --node or --rank, a dry run shows the plan wherever it runs: no node need be this machine."""
    result = invoke(QUICKSTART, "--dry-run", "--set", "cluster.nodes[0].host=10.255.0.1")
    assert result.exit_code == 0, result.stderr


def test_output_flags_given_the_wrong_kind_of_path(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    cases = [
        (["--resume", a_file], f"{a_file}: --resume: is a file, not a folder ({FIX})"),
        (["--checkpoint", a_file], f"{a_file}: --checkpoint: is a file, not a folder (give a folder to write into)"),
        (["--trace", a_file], f"{a_file}: --trace: is a file, not a folder (give a folder to write into)"),
        (
            ["--metrics-jsonl", tmp_path],
            f"{tmp_path}: --metrics-jsonl: is a folder, not a file (give a file path, e.g. {tmp_path / 'metrics.jsonl'})",
        ),
        (
            ["--checkpoint", a_file / "ckpt"],
            f"{a_file / 'ckpt'}: --checkpoint: '{a_file}' is a file, so no folder can be made under it (give another path)",
        ),
        (
            ["--metrics-jsonl", a_file / "runs" / "m.jsonl"],
            f"{a_file / 'runs' / 'm.jsonl'}: --metrics-jsonl: '{a_file}' is a file, so no folder can be made under it "
            "(give another path)",
        ),
    ]
    for args, message in cases:
        for dry in (["--dry-run"], []):
            assert_one_error_line(invoke(QUICKSTART, *dry, *args), message)
    assert sorted(os.listdir(tmp_path)) == ["a_file"]  # nothing made, no probe left


def _layout_with_inputs(tmp_path: Path) -> Path:
    """A text-data layout with a schedule file, all three in ``tmp_path``."""
    (tmp_path / "corpus.txt").write_text("hello world, " * 20)
    (tmp_path / "order.txt").write_text("F0 F1 F2 F3 B0 B1 B2 B3\nF0 B0 F1 B1 F2 B2 F3 B3\n")
    text = QUICKSTART.read_text().replace('kind = "grammar"', 'kind = "text"\npath = "corpus.txt"')
    text = text.replace("vocab = 64", "vocab = 256").replace("seq_len = 64", "seq_len = 16")
    text = text.replace("microbatches = 4\n", 'microbatches = 4\nschedule_file = "order.txt"\n')
    text = "\n".join(
        line for line in text.splitlines() if not line.startswith(("grammar_vocab", "branching", "eval_every"))
    )
    path = tmp_path / "run.toml"
    path.write_text(text + "\n")
    return path


def test_an_output_never_overwrites_an_input(tmp_path):
    layout = _layout_with_inputs(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    corpus, order = tmp_path / "corpus.txt", tmp_path / "order.txt"
    cases = [
        (
            ["--metrics-jsonl", layout],
            f"{layout}: --metrics-jsonl: would overwrite the layout file '{layout}', an "
            "input of this run (give another path)",
        ),
        (
            ["--metrics-jsonl", corpus],
            f"{corpus}: --metrics-jsonl: would overwrite data.path '{corpus}', an input of "
            "this run (give another path)",
        ),
        (
            ["--metrics-jsonl", f"{tmp_path}/sub/../order.txt"],
            f"{tmp_path}/sub/../order.txt: --metrics-jsonl: would overwrite pipelines[0].schedule_file '{order}', an input "
            "of this run (give another path)",
        ),
    ]
    for args, message in cases:
        for dry in (["--dry-run"], []):
            assert_one_error_line(invoke(layout, *dry, *args), message)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_metrics_inside_a_checkpoint_is_refused_where_a_save_writes(tmp_path):
    ckpt = tmp_path / "ckpt"
    latest, meta = ckpt / "latest", ckpt / "step-000010" / "meta.json"
    assert_one_error_line(
        invoke(QUICKSTART, "--dry-run", "--checkpoint", ckpt, "--metrics-jsonl", latest),
        f"{latest}: --metrics-jsonl: is a file that --checkpoint {ckpt} writes (give another path)",
    )
    assert_one_error_line(
        invoke(QUICKSTART, "--dry-run", "--checkpoint", ckpt, "--metrics-jsonl", meta),
        f"{meta}: --metrics-jsonl: is a file that --checkpoint {ckpt} writes (give another path)",
    )
    result = invoke(QUICKSTART, "--dry-run", "--checkpoint", ckpt, "--metrics-jsonl", ckpt / "metrics.jsonl")
    assert result.exit_code == 0, result.stderr  # beside the saves is fine


def test_metrics_in_a_file_of_the_resumed_save_is_refused(tmp_path):
    root = tmp_path / "ckpt"
    step = root / "step-000002"
    step.mkdir(parents=True)
    for resume, metrics in ((step, step / "rank0.pt"), (root, step / "meta.json"), (root, root / "latest")):
        assert_one_error_line(
            invoke(QUICKSTART, "--dry-run", "--resume", resume, "--metrics-jsonl", metrics),
            f"{metrics}: --metrics-jsonl: is a file of the --resume checkpoint '{resume}' (an "
            "input of this run; give another path)",
        )
    # beside the saves of the root it resumes from and saves into: fine (checked before --resume itself)
    lay = layout_mod.load(QUICKSTART)
    outputs.check_run_paths(lay, str(root / "metrics.jsonl"), str(root), str(root / "trace"), str(root))


def test_trace_folder_holding_an_input_named_like_a_trace_file(tmp_path):
    layout = tmp_path / "rank0.jsonl"
    shutil.copy(QUICKSTART, layout)
    assert_one_error_line(
        invoke(layout, "--dry-run", "--trace", tmp_path),
        f"{tmp_path}: --trace: would overwrite the layout file '{layout}', an input of this run (give another path)",
    )


def _text_layout(tmp_path: Path, kind: str, contents: str) -> Path:
    name = "corpus.jsonl" if kind == "jsonl" else "corpus.txt"
    (tmp_path / name).write_text(contents)
    text = QUICKSTART.read_text().replace('kind = "grammar"', f'kind = "{kind}"\npath = "{name}"')
    text = text.replace("vocab = 64", "vocab = 256").replace("seq_len = 64", "seq_len = 16")
    text = "\n".join(
        line for line in text.splitlines() if not line.startswith(("grammar_vocab", "branching", "eval_every"))
    )
    path = tmp_path / "run.toml"
    path.write_text(text + "\n")
    return path


def test_jsonl_of_empty_documents_is_refused_before_forking(tmp_path):
    layout = _text_layout(tmp_path, "jsonl", '{"text": ""}\n' * 40)
    corpus = tmp_path / "corpus.jsonl"
    assert_one_error_line(
        invoke(layout, "--quiet"),
        f"{layout}: data.path: file '{corpus}' holds no text: its 40 "
        "tokens all end empty documents (give documents with text)",
    )


def test_jsonl_shorter_than_a_window_is_refused_before_forking(tmp_path):
    layout = _text_layout(tmp_path, "jsonl", '{"text": "hi"}\n{"text": "there"}\n')
    corpus = tmp_path / "corpus.jsonl"
    assert_one_error_line(
        invoke(layout, "--quiet"),
        f"{layout}: data.path: file '{corpus}' has 9 tokens, fewer than "
        "one window of 17 tokens (seq_len + 1); give a longer file or a smaller seq_len",
    )


def test_binary_schedule_file(tmp_path):
    layout = _layout_with_inputs(tmp_path)
    order = tmp_path / "order.txt"
    order.write_bytes(b"F0 F1\n\xff\xfe\x00binary")
    assert_one_error_line(
        invoke(layout, "--dry-run"),
        f"{layout}: pipelines[0].schedule_file: {order}: line 2 is not "
        "UTF-8 text (a schedule file is text: action strings such as F0 B0, one line or CSV column "
        "per stage)",
    )


def test_token_cache_goes_where_HETERO_LLM_CACHE_says(tmp_path, monkeypatch):
    source = tmp_path / "corpus.txt"
    source.write_text("abc" * 10)
    monkeypatch.setenv(text_cache.CACHE_ENV, str(tmp_path / "cache"))
    tokens = text_cache.TokenFileSource.from_file(str(source), "text")
    assert tokens.num_tokens == 30
    assert os.listdir(tmp_path / "cache") == [os.path.basename(text_cache.cache_path(str(source)))]
    assert sorted(os.listdir(tmp_path)) == ["cache", "corpus.txt"]
    monkeypatch.setenv(text_cache.CACHE_ENV, str(source / "cache"))  # a folder under a file: cannot be made
    with pytest.raises(LayoutError) as info:
        text_cache.TokenFileSource.from_file(str(source), "text", file_for_errors="run.toml")
    assert str(info.value) == (
        f"run.toml: data.path: cannot write the token cache of '{source}' in '{source / 'cache'}'"
        f": Not a directory (set {text_cache.CACHE_ENV} to a writable folder)"
    )


def test_a_rank_started_on_its_own_checks_the_data_first(tmp_path):
    layout = _text_layout(tmp_path, "jsonl", '{"text": ""}\n' * 40)
    corpus = tmp_path / "corpus.jsonl"
    assert_one_error_line(
        invoke(layout, "--rank", "1", "--quiet"),
        f"{layout}: data.path: file '{corpus}' holds no "
        "text: its 40 tokens all end empty documents (give documents with text)",
    )


def test_place_never_writes_over_its_cluster_file(tmp_path):
    from click.testing import CliRunner

    from hetero_llm.cli.place import main as place_main

    cluster = tmp_path / "cluster.toml"
    shutil.copy(REPO / "layouts" / "clusters" / "two_domains.toml", cluster)
    before = cluster.read_bytes()
    result = CliRunner().invoke(place_main, [str(cluster), "-o", str(cluster)])
    assert (result.exit_code, result.output) == (
        2,
        f"error: {cluster}: --out: would overwrite the cluster file "
        f"'{cluster}', an input of this run (give another path)\n",
    )
    assert cluster.read_bytes() == before
    result = CliRunner().invoke(place_main, [str(cluster), "-o", str(cluster / "placed.toml")])
    assert (result.exit_code, result.output) == (
        2,
        f"error: {cluster / 'placed.toml'}: --out: '{cluster}' is a file, "
        "so no folder can be made under it (give another path)\n",
    )
    result = CliRunner().invoke(place_main, [str(cluster), "--out"])
    assert (result.exit_code, result.output) == (
        2,
        "error: Option '--out' requires an argument (see hetero-place --help)\n",
    )
