"""Nothing a user gives is overwritten: no command writes over one of its inputs, no write follows a symbolic
link the program did not make, every output path is checked up front (one line, exit code 2, before any rank
starts or anything is written), and hetero-export / hetero-generate refuse a damaged save as --resume does."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers_input_safety_paths import _elsewhere, _snapshot

from harness import LAYOUTS, assert_one_error_line, hf_folder
from harness import invoke_cli as invoke
from hetero_llm import layout as layout_mod
from hetero_llm._fs import write_atomically
from hetero_llm.checkpoint import folders
from hetero_llm.errors import CheckpointError
from hetero_llm.launch import outputs

REFERENCE = LAYOUTS / "reference" / "reference.toml"

QUICKSTART = LAYOUTS / "quickstart.toml"

NO_LINKS = "(writes never follow one: remove the link, or give another folder)"


def _refused_before_start(layout: Path, args: list, message: str) -> None:
    """``hetero-launch layout args`` and its --dry-run: exactly ``error: message``, exit code 2."""
    for dry in (["--dry-run"], ["--quiet"]):
        assert_one_error_line(invoke(layout, *dry, *args), message)


def _layout_reading_everything(tmp_path: Path) -> Path:
    """A layout that reads a text corpus, a held-out file, a tokenizer.json, an init_from folder and a schedule
    file, all in ``tmp_path``."""
    pytest.importorskip("tokenizers", reason="the 'test' extra installs tokenizers")
    from helpers_text import make_tokenizer

    make_tokenizer(tmp_path / "tok.json")
    (tmp_path / "corpus.txt").write_text("the cat sat on the mat. " * 40)
    (tmp_path / "valid.txt").write_text("a dog ran after the cat. " * 40)
    (tmp_path / "order.txt").write_text("F0 F1 F2 B0 B1 B2\n")
    text = REFERENCE.read_text().replace("vocab = 64", "vocab = 320")
    text = text.replace(
        'kind = "grammar"', 'kind = "text"\npath = "corpus.txt"\nvalid_path = "valid.txt"\ntokenizer = "tok.json"'
    )
    text = text.replace("microbatches = 3\n", 'microbatches = 3\nschedule_file = "order.txt"\n')
    hf_folder(tmp_path / "hf", layout_mod.loads(text, base_dir=tmp_path).model)
    path = tmp_path / "run.toml"
    path.write_text(text.replace("[model]\n", '[model]\ninit_from = "hf"\n', 1))
    layout_mod.load(path)  # a valid layout: every refusal below is about the output
    return path


def test_layout_inputs_lists_every_path_the_layout_reads(tmp_path):
    layout = layout_mod.load(_layout_reading_everything(tmp_path))
    assert outputs.layout_inputs(layout) == [
        ("the layout file", str(tmp_path / "run.toml")),
        ("data.path", str(tmp_path / "corpus.txt")),
        ("data.valid_path", str(tmp_path / "valid.txt")),
        ("data.tokenizer", str(tmp_path / "tok.json")),
        ("model.init_from", str(tmp_path / "hf")),
        ("pipelines[0].schedule_file", str(tmp_path / "order.txt")),
    ]


@pytest.mark.parametrize(
    "name,key",
    [
        ("valid.txt", "data.valid_path"),
        ("tok.json", "data.tokenizer"),
        ("corpus.txt", "data.path"),
        ("order.txt", "pipelines[0].schedule_file"),
    ],
)
def test_metrics_never_overwrite_a_file_the_layout_reads(name, key, tmp_path):
    layout = _layout_reading_everything(tmp_path)
    before = _snapshot(tmp_path)
    target = tmp_path / name
    _refused_before_start(
        layout,
        ["--metrics-jsonl", target],
        f"{target}: --metrics-jsonl: would overwrite {key} '{target}', an input of this run (give another path)",
    )
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize(
    "flag,where",
    [
        ("--metrics-jsonl", "hf/metrics.jsonl"),
        ("--checkpoint", "hf"),
        ("--checkpoint", "hf/ckpt"),
        ("--trace", "hf"),
        ("--tensorboard", "hf/tb"),
    ],
)
def test_no_output_writes_into_the_init_from_folder(flag, where, tmp_path):
    layout = _layout_reading_everything(tmp_path)
    before = _snapshot(tmp_path)
    _refused_before_start(
        layout,
        [flag, tmp_path / where],
        f"{tmp_path / where}: {flag}: would write into "
        f"model.init_from '{tmp_path / 'hf'}', an input of this run (give another path)",
    )
    assert _snapshot(tmp_path) == before


def test_a_bucket_schedule_file_is_an_input(tmp_path):
    (tmp_path / "bucket_order.txt").write_text("F0 F1 B0 B1\n")
    text = (LAYOUTS / "examples" / "hot_switch.toml").read_text()
    text = text.replace(
        'schedule = "gpipe"\n[[buckets.pipelines]]\nbatch = 2\nmicrobatches = 2\n',
        'schedule = "gpipe"\n[[buckets.pipelines]]\nbatch = 2\nmicrobatches = 2\nschedule_file = "bucket_order.txt"\n',
        1,
    )
    layout = tmp_path / "hot.toml"
    layout.write_text(text)
    assert ("buckets[1].pipelines[0].schedule_file", str(tmp_path / "bucket_order.txt")) in outputs.layout_inputs(
        layout_mod.load(layout)
    )
    target = tmp_path / "bucket_order.txt"
    assert_one_error_line(
        invoke(layout, "--dry-run", "--metrics-jsonl", target),
        f"{target}: --metrics-jsonl: would overwrite buckets[1].pipelines[0].schedule_file "
        f"'{target}', an input of this run (give another path)",
    )
    assert target.read_text() == "F0 F1 B0 B1\n"


def test_tensorboard_folder_is_checked_like_the_other_outputs(tmp_path):
    (tmp_path / "a_file").write_text("x")
    tb = tmp_path / "a_file" / "tb"
    _refused_before_start(
        QUICKSTART,
        ["--tensorboard", tb],
        f"{tb}: --tensorboard: '{tmp_path / 'a_file'}' is a "
        "file, so no folder can be made under it (give another path)",
    )
    assert (tmp_path / "a_file").read_text() == "x"


def test_a_planted_trace_file_link_is_refused(tmp_path):
    target = _elsewhere(tmp_path)
    trace = tmp_path / "trace"
    trace.mkdir()
    (trace / "rank0.jsonl").symlink_to(target)
    _refused_before_start(
        QUICKSTART,
        ["--trace", trace],
        f"{trace / 'rank0.jsonl'}: --trace: is a symbolic link to "
        f"'{target}' in the folder --trace writes into {NO_LINKS}",
    )
    assert target.read_text() == "not yours"


@pytest.mark.parametrize("planted", ["step-000005", "latest", "step-000002/rank0.pt", "step-000002/meta.json.tmp"])
def test_a_planted_link_in_the_checkpoint_folder_is_refused(planted, tmp_path):
    target = _elsewhere(tmp_path)
    ckpt = tmp_path / "ckpt"
    (ckpt / "step-000002").mkdir(parents=True)
    link = ckpt / planted
    link.symlink_to(target.parent if planted.startswith("step-000005") else target)
    before = _snapshot(tmp_path)
    _refused_before_start(
        QUICKSTART,
        ["--checkpoint", ckpt],
        f"{link}: --checkpoint: is a symbolic link to "
        f"'{os.readlink(link)}' in the folder --checkpoint writes into {NO_LINKS}",
    )
    assert _snapshot(tmp_path) == before


def test_outputs_that_are_links_are_refused(tmp_path):
    target = _elsewhere(tmp_path)
    metrics = tmp_path / "metrics.jsonl"
    metrics.symlink_to(target)
    dangling = tmp_path / "dangling.jsonl"
    dangling.symlink_to(tmp_path / "nowhere" / "m.jsonl")
    folder = tmp_path / "ckpt"
    folder.symlink_to(target.parent)
    for flag, link in (
        ("--metrics-jsonl", metrics),
        ("--metrics-jsonl", dangling),
        ("--checkpoint", folder),
        ("--trace", folder),
        ("--tensorboard", folder),
    ):
        _refused_before_start(
            QUICKSTART,
            [flag, link],
            f"{link}: {flag}: is a symbolic link to '{os.readlink(link)}' "
            "(writes never follow one: give the path it points to, or remove the link)",
        )
    assert _snapshot(target.parent) == {"precious.txt": b"not yours"}
    assert not (tmp_path / "nowhere").exists()


def test_a_link_to_an_input_is_named_as_that_input(tmp_path):
    layout = tmp_path / "run.toml"
    shutil.copy(QUICKSTART, layout)
    link = tmp_path / "metrics.jsonl"
    link.symlink_to(layout)
    _refused_before_start(
        layout,
        ["--metrics-jsonl", link],
        f"{link}: --metrics-jsonl: would overwrite the layout "
        f"file '{layout}', an input of this run (give another path)",
    )


def test_files_made_during_a_run_never_follow_a_link(tmp_path):
    """What the up-front check cannot see (a link made after it): the run's own opens refuse to follow it."""
    from hetero_llm.train import metrics

    target = _elsewhere(tmp_path)
    link = tmp_path / "metrics.jsonl"
    link.symlink_to(target)
    with pytest.raises(OSError):
        metrics.open_metrics(str(link), 0)
    saved = tmp_path / "meta.json"
    (tmp_path / "meta.json.tmp").symlink_to(target)
    with pytest.raises(OSError):
        write_atomically(saved, lambda f: f.write(b"{}"))
    step = tmp_path / "ckpt" / "step-000005"
    step.parent.mkdir()
    step.symlink_to(target.parent)
    with pytest.raises(CheckpointError) as e:
        folders.begin_save(step)
    assert str(e.value) == (
        f"{step}: --checkpoint: is a symbolic link to '{target.parent}' in the folder "
        f"--checkpoint writes into {NO_LINKS}"
    )
    assert _snapshot(target.parent) == {"precious.txt": b"not yours"} and not saved.exists()


def _os_refusal(folder: str) -> str:
    """The OS's own words for creating a file in ``folder`` (the reference for an unwritable place)."""
    import tempfile

    try:
        os.close(tempfile.mkstemp(dir=folder)[0])
    except OSError as e:
        return e.strerror
    raise AssertionError(f"{folder} is writable here")


def _planner_cluster(tmp_path: Path) -> Path:
    """layouts/clusters/small_cpu.toml reading a text corpus (so a vocabulary of the byte tokenizer's 256) and a
    plan.profile, beside it in ``tmp_path``."""
    from hetero_llm.planner import load_cluster
    from hetero_llm.planner import profile as prof

    (tmp_path / "corpus.txt").write_text("hello world " * 20)
    text = (
        (LAYOUTS / "clusters" / "small_cpu.toml")
        .read_text()
        .replace('kind = "grammar"', 'kind = "text"\npath = "corpus.txt"')
        .replace("vocab = 64\n", "vocab = 256\n")
    )
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    cluster = load_cluster(path)
    for name in ("prof.json", "other.json"):
        shape = prof.model_shape(cluster.model, cluster.train.precision)
        (tmp_path / name).write_text(
            json.dumps(
                {
                    "format": prof.FORMAT,
                    "model": shape,
                    "kinds": {"cpu2x": dict(zip(prof.TIMES, (1e-3, 2e-3, 1e-4, 2e-4)))},
                }
            )
        )
    path.write_text(text.replace("[plan]\n", '[plan]\nprofile = "prof.json"\n'))
    return path


def _plan(*args):
    from hetero_llm.cli.plan import main

    return CliRunner().invoke(main, [str(a) for a in args])


def test_plan_never_writes_over_what_it_reads(tmp_path):
    cluster = _planner_cluster(tmp_path)
    before = _snapshot(tmp_path)
    other = tmp_path / "other.json"
    cases = [
        ("-o", cluster, "--out", "the cluster file", []),
        ("-o", tmp_path / "corpus.txt", "--out", "data.path", []),
        ("-o", tmp_path / "prof.json", "--out", "plan.profile", []),
        ("-o", other, "--out", "--profile-file", ["--profile-file", other]),
        ("--profile", cluster, "--profile", "the cluster file", []),
        ("--profile", tmp_path / "corpus.txt", "--profile", "data.path", []),
    ]
    for option, path, flag, what, extra in cases:
        result = _plan(cluster, option, path, *extra)
        assert (result.exit_code, result.output) == (
            2,
            f"error: {path}: {flag}: would overwrite {what} '{path}', an input of this run (give another path)\n",
        )
    assert _snapshot(tmp_path) == before


def test_plan_and_tokenize_refuse_an_unwritable_output_in_one_line(tmp_path):
    why = _os_refusal("/proc")
    result = _plan(_planner_cluster(tmp_path), "-o", "/proc/x.toml")
    assert (result.exit_code, result.output) == (
        2,
        f"error: /proc/x.toml: --out: cannot write in '/proc': {why} (give a writable path)\n",
    )
    from hetero_llm.cli.tokenize import main as tokenize_main

    (tmp_path / "doc.txt").write_text("some text")
    result = CliRunner().invoke(tokenize_main, [str(tmp_path / "doc.txt"), "-o", "/proc/x.bin"])
    assert (result.exit_code, result.output) == (
        2,
        f"error: /proc/x.bin: --out: cannot write in '/proc': {why} (give a writable path)\n",
    )


def test_plan_and_tokenize_never_write_through_a_link(tmp_path):
    from hetero_llm.cli.tokenize import main as tokenize_main

    cluster = _planner_cluster(tmp_path)
    target = _elsewhere(tmp_path)
    layout, tokens_out = tmp_path / "planned.toml", tmp_path / "tokens.bin"
    layout.symlink_to(target)
    tokens_out.symlink_to(target)
    result = _plan(cluster, "-o", layout)
    assert (result.exit_code, result.output) == (
        2,
        f"error: {layout}: --out: is a symbolic link to '{target}' "
        "(writes never follow one: give the path it points to, or remove "
        "the link)\n",
    )
    result = CliRunner().invoke(tokenize_main, [str(tmp_path / "corpus.txt"), "-o", str(tokens_out)])
    assert (result.exit_code, result.output) == (
        2,
        f"error: {tokens_out}: --out: is a symbolic link to '{target}' "
        "(writes never follow one: give the path it points to, or remove "
        "the link)\n",
    )
    assert target.read_text() == "not yours"


def test_tokenize_never_writes_over_its_input(tmp_path):
    from hetero_llm.cli.tokenize import main as tokenize_main

    source = tmp_path / "shard.bin"  # text, named like the token file it would become
    source.write_text("some text to tokenize")
    result = CliRunner().invoke(tokenize_main, [str(source), "-o", str(source)])
    assert (result.exit_code, result.output) == (
        2,
        f"error: {source}: --out: would overwrite the input file "
        f"'{source}', an input of this run (give another path)\n",
    )
    assert source.read_text() == "some text to tokenize" and os.listdir(tmp_path) == ["shard.bin"]


def test_place_never_writes_over_the_files_its_cluster_names(tmp_path):
    from hetero_llm.cli.place import main as place_main

    (tmp_path / "corpus.txt").write_text("hello world " * 20)
    cluster = tmp_path / "cluster.toml"
    cluster.write_text(
        (LAYOUTS / "clusters" / "two_domains.toml")
        .read_text()
        .replace('kind = "grammar"', 'kind = "text"\npath = "corpus.txt"')
        .replace("vocab = 64\n", "vocab = 256\n")
    )
    assert 'path = "corpus.txt"' in cluster.read_text()
    before = _snapshot(tmp_path)
    corpus = tmp_path / "corpus.txt"
    result = CliRunner().invoke(place_main, [str(cluster), "-o", str(corpus)])
    assert (result.exit_code, result.output) == (
        2,
        f"error: {corpus}: --out: would overwrite data.path '{corpus}', an input of this run (give another path)\n",
    )
    assert _snapshot(tmp_path) == before


def test_export_folder_never_overwrites_the_tokenizer_it_copies(tmp_path):
    """A save trained with data.tokenizer = .../tokenizer.json, exported into that file's folder: hf.export would
    write its own tokenizer.json over it."""
    from hetero_llm.errors import LayoutError

    tok = tmp_path / "tokenizer.json"
    tok.write_text("{}")
    with pytest.raises(LayoutError) as e:
        outputs.check_output_folder("--hf", str(tmp_path), [("data.tokenizer", str(tok))])
    assert str(e.value) == (
        f"{tmp_path}: --hf: would overwrite data.tokenizer '{tok}', an input of this run (give another path)"
    )
    outputs.check_output_folder("--hf", str(tmp_path / "hf"), [("data.tokenizer", str(tok))])  # beside it: fine
    assert os.listdir(tmp_path) == ["tokenizer.json"]
