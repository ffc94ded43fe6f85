"""Every bad layout gets one located line on stderr and exit code 2; every good layout dry-runs.

The bad inputs are files in ``tests/bad_layouts/``, one case each, whose first line is
``# expect: <the line after 'error: '>`` with the layout's path written ``{file}`` (and its folder
``{dir}``). Messages are compared exactly: they are the interface a user reads.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers_layout_errors import expected_line

from harness import RUNNABLE_LAYOUTS, assert_one_error_line
from harness import invoke_cli as invoke
from hetero_llm import layout
from hetero_llm.errors import LayoutError
from hetero_llm.launch import preflight

TESTS = Path(__file__).resolve().parents[1]  # tests/: the shared data and bad layouts

REPO = TESTS.parent

BAD = sorted((TESTS / "bad_layouts").glob("*.toml"))

GOOD = RUNNABLE_LAYOUTS

QUICKSTART = REPO / "layouts" / "quickstart.toml"

RANK_TABLE_HEADER = "rank  device      node      pipeline  stage  tp     layers   batch share"


def test_corpus_is_there():
    assert len(BAD) >= 40
    assert all(p.read_bytes().startswith(b"# expect: ") for p in BAD)


@pytest.mark.parametrize("path", BAD, ids=[p.stem for p in BAD])
def test_bad_layout_file(path: Path):
    assert_one_error_line(invoke(path, "--dry-run"), expected_line(path))


@pytest.mark.parametrize("path", BAD, ids=[p.stem for p in BAD])
def test_bad_layout_raises_located_error(path: Path):
    """The library raises a LayoutError whose parts are what the CLI prints."""
    with pytest.raises(LayoutError) as info:
        preflight.load_layout(path)
    assert str(info.value) == expected_line(path)
    assert info.value.file == str(path)


@pytest.mark.parametrize("content", ["", "\n\n", "   \n\t\n"], ids=["empty", "newlines", "whitespace"])
def test_empty_file(tmp_path: Path, content: str):
    path = tmp_path / "empty.toml"
    path.write_text(content)
    assert_one_error_line(invoke(path, "--dry-run"), f"{path}: file is empty (start from layouts/quickstart.toml)")


def test_missing_layout_file(tmp_path: Path):
    path = tmp_path / "no_such_layout.toml"
    expected = f"{path}: no such layout file (pass the path of a .toml layout, e.g. layouts/quickstart.toml)"
    assert_one_error_line(invoke(path, "--dry-run"), expected)


def test_layout_path_is_a_folder(tmp_path: Path):
    expected = (
        f"{tmp_path}: is a folder, not a layout file (pass the path of a .toml layout, e.g. layouts/quickstart.toml)"
    )
    assert_one_error_line(invoke(tmp_path, "--dry-run"), expected)


def test_byte_order_mark(tmp_path: Path):
    """A BOM (Windows editors write one) is named, not reported as a TOML syntax error at line 1, column 1."""
    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbf" + QUICKSTART.read_bytes())
    expected = (
        f"{path}: starts with a UTF-8 byte order mark (BOM), which TOML does not allow (save the file as "
        "UTF-8 without BOM)"
    )
    assert_one_error_line(invoke(path, "--dry-run"), expected)


def test_loads_names_its_file():
    with pytest.raises(LayoutError) as info:
        layout.loads("[modle]\nlayers = 2\n", file="inline.toml")
    assert str(info.value) == "inline.toml: modle: unknown section 'modle' (did you mean 'model'?)"
    assert (info.value.file, info.value.path) == ("inline.toml", "modle")


SET_ERRORS = {
    "train.stpes=5": "--set train.stpes: unknown key 'stpes' (did you mean 'steps'?)",
    "trian.steps=5": "--set trian.steps: unknown section 'trian' (did you mean 'train'?)",
    "optimizer.lr=1": "--set optimizer.lr: unknown section 'optimizer'",
    "pipelines[0].stages[0].layer=3": "--set pipelines[0].stages[0].layer: unknown key 'layer' (did you mean 'layers'?)",
    "pipelines.0.microbatch=2": "--set pipelines.0.microbatch: unknown key 'microbatch' (did you mean 'microbatches'?)",
    "train.steps": "--set train.steps: expected KEY=VALUE (e.g. --set train.steps=5)",
    "=5": "--set =5: no key before '=' (e.g. --set train.steps=5)",
    "train.st eps=1": "--set train.st eps: cannot parse key segment 'st eps' (use e.g. pipelines[0].batch)",
    "pipelines[5].batch=2": "--set pipelines[5].batch: index 5 is out of range: pipelines has 1 entry (use an index below 1)",
    "pipelines.5.batch=2": "--set pipelines.5.batch: index 5 is out of range: pipelines has 1 entry (use an index below 1)",
    "pipelines[0].stages[7].layers=1": "--set pipelines[0].stages[7].layers: index 7 is out of range: pipelines[0].stages has 2 entries (use an index below 2)",
    "pipelines.batch=3": "--set pipelines.batch: 'pipelines' is an array of tables (pick one, e.g. pipelines[0].batch)",
    "train[0].steps=1": "--set train[0].steps: 'train' is not an array (drop the index [0])",
    "train.steps.x=1": "--set train.steps.x: 'train.steps' is a value, not a table (set 'train.steps' itself)",
    "pipelines[0]=1": "--set pipelines[0]: cannot replace a whole table (set one of its keys)",
    # a --set that parses but makes the layout invalid gets the normal validation message
    "train.steps=0": "train.steps: must be >= 1, got 0",
    "train.steps=five": "train.steps: expected an integer, got a string ('five')",
    "train.schedule=1F1B": "train.schedule: unknown value '1F1B' (did you mean '1f1b'? choose one of: gpipe, 1f1b, interleaved, dynamic, zbh1)",
    "pipelines[0].batch=12": "pipelines: pipeline batches sum to 12 (12) but train.global_batch is 16 (make them add up to 16)",
    "data.kind=text": "data.path: data.kind 'text' needs a file (set data.path to a .txt file, relative to the layout file)",
    "pipelines.0.stages.1.devices.0=node0:0": "pipelines[0].stages[1].devices[0]: device 'node0:0' is already used by pipelines[0].stages[0] (each device runs one rank)",
}


@pytest.mark.parametrize("item", list(SET_ERRORS))
def test_set_error(item: str):
    result = invoke(QUICKSTART, "--dry-run", "--set", item)
    assert_one_error_line(result, f"{QUICKSTART}: {SET_ERRORS[item]}")


@pytest.mark.parametrize(
    "items, check",
    [
        (["train.steps=5"], lambda lay: lay.train.steps == 5),
        (["pipelines[0].microbatches=2"], lambda lay: lay.pipelines[0].microbatches == 2),
        (
            ["pipelines.0.batch=8", "train.global_batch=8"],
            lambda lay: (lay.pipelines[0].batch, lay.train.global_batch) == (8, 8),
        ),
        (["train.schedule=gpipe"], lambda lay: lay.train.schedule is layout.Schedule.GPIPE),  # bare word: a string
        (
            ["pipelines[0].stages[0].layers=2", "pipelines[0].stages[1].layers=2"],
            lambda lay: [s.layers for s in lay.pipelines[0].stages] == [2, 2],
        ),
        (
            ['pipelines.0.stages.0.devices=["node0:1"]', 'pipelines.0.stages.1.devices=["node0:0"]'],
            lambda lay: [s.devices for s in lay.pipelines[0].stages] == [("node0:1",), ("node0:0",)],
        ),
        (["cluster.nodes[0].host=localhost"], lambda lay: lay.cluster.nodes[0].host == "localhost"),
    ],
    ids=["steps", "microbatches", "dotted-index", "bare-word", "two-sets", "array-value", "nested-table"],
)
def test_set_good(items: list[str], check):
    assert check(layout.load(QUICKSTART, items))
    args = [a for item in items for a in ("--set", item)]
    result = invoke(QUICKSTART, "--dry-run", "--full", *args)
    assert result.exit_code == 0, result.stderr
    assert result.stderr == ""
    assert RANK_TABLE_HEADER in result.stdout


def test_set_shows_in_dry_run():
    result = invoke(QUICKSTART, "--dry-run", "--full", "--set", "pipelines[0].microbatches=2")
    assert result.exit_code == 0, result.stderr
    assert "rows 0-15 in 2 mb" in result.stdout


FIRST_OF_TWO = [  # (two --set items each making one problem, the one reported): validation order, not schema order
    (["model.init_std=-1.0", "train.lr=-0.1"], "train.lr: must be >= 0, got -0.1"),
    (["model.norm_eps=0", "model.hidden=30"], "model.heads: 4 heads do not divide hidden 30 (pick a divisor of 30)"),
    (["cluster.port=0", "data.valid_fraction=2"], "data.valid_fraction: must be in [0, 1), got 2 (e.g. 0.05)"),
    (["cluster.nodes.0.speed=0", "cluster.port=0"], "cluster.port: must be a TCP port 1..65535, got 0"),
    (
        ["cluster.nodes.0.host=h:80", 'cluster.nodes.0.devices=["gpu"]'],
        "cluster.nodes[0].devices[0]: unknown device 'gpu' (use 'cpu' or 'cuda:N')",
    ),
    (
        ["pipelines.0.stages.0.devices=[]", "pipelines.0.batch=3"],
        "pipelines[0].microbatches: 4 microbatches do not divide the pipeline's batch 3 (use a divisor of 3)",
    ),
]


@pytest.mark.parametrize("items, first", FIRST_OF_TWO, ids=[i[0] for i, _ in FIRST_OF_TWO])
def test_first_of_two_problems(items: list[str], first: str):
    with pytest.raises(LayoutError) as info:
        layout.load(QUICKSTART, items)
    assert str(info.value) == f"{QUICKSTART}: {first}"


def test_every_field_rule_runs(monkeypatch):
    """Every single-field rule the schema declares is run by validation, and only those: a rule on a field
    that validation never asks about would be dead without a word."""
    import attrs

    from hetero_llm.layout import cluster_schema, fields, schema

    asked = set()
    first_problem = fields.first_problem

    def spy(obj, name):
        asked.add((type(obj).__name__, name))
        return first_problem(obj, name)

    monkeypatch.setattr(fields, "first_problem", spy)  # what check_own asks, for every rules module
    for path in GOOD:  # between them: grammar and file data, packed documents, buckets, network domains
        layout.load(path)
    declared = {
        (cls.__name__, f.name)
        for module in (schema, cluster_schema)
        for cls in vars(module).values()
        if isinstance(cls, type) and attrs.has(cls)
        for f in attrs.fields(cls)
        if f.metadata.get("checks")
    }
    assert len(declared) >= 40
    assert asked == declared


@pytest.mark.parametrize("path", GOOD, ids=[p.stem for p in GOOD])
def test_good_layout_dry_run(path: Path):
    lay = layout.load(path)
    result = invoke(path, "--dry-run", "--full")
    assert result.exit_code == 0, result.stderr
    assert result.stderr == ""
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"layout {path}: ")
    header = lines.index(RANK_TABLE_HEADER)
    world = sum(len(s.devices) for p in lay.pipelines for s in p.stages)
    rows = lines[header + 1 : header + 1 + world]
    assert [int(r.split()[0]) for r in rows] == list(range(world))
    assert lines[header + 1 + world] == ""
    assert "pipeline 0 schedule:" in result.stdout


def test_good_layouts_exist():
    assert {p.name for p in GOOD} >= {"quickstart.toml", "reference.toml"}
