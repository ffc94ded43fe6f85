"""The TOML writer (hetero_llm/layout/writer.py) is the loader's inverse: every layout and cluster file in the
repository, and hand-made layouts using every kind of key, load back to the objects they were written from.
The reference is the loader itself (and tomllib for single values): nothing here compares against the writer's
own text."""

from __future__ import annotations

import math
import random
import tomllib
from pathlib import Path

import attrs
import pytest

from harness import LAYOUT_FILES, LAYOUTS, PUBLISHED_LAYOUTS, ROOT, SWEEP_FILES
from hetero_llm import layout
from hetero_llm.layout import (
    BucketSpec,
    ClusterSpec,
    CrossDomainSpec,
    DataSpec,
    DomainSpec,
    Layout,
    ModelSpec,
    NodeSpec,
    PipelineSpec,
    StageSpec,
    TrainSpec,
    reader,
)
from hetero_llm.layout.writer import toml_key, toml_value
from hetero_llm.planner.cluster import load_cluster

DATA_FILES = sorted((ROOT / "tests" / "data").glob("*.toml"))
CLUSTER_FILES = sorted((LAYOUTS / "clusters").rglob("*.toml"))
ALL_LAYOUTS = LAYOUT_FILES + PUBLISHED_LAYOUTS + DATA_FILES


def _id(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_every_repository_file_is_covered():
    on_disk = {p for p in ROOT.joinpath("layouts").rglob("*.toml")} | set(DATA_FILES)
    assert on_disk == set(ALL_LAYOUTS) | set(CLUSTER_FILES) | set(SWEEP_FILES)


@pytest.mark.parametrize("path", ALL_LAYOUTS, ids=_id)
def test_layout_files_round_trip(path, tmp_path):
    loaded = layout.load(path)
    # paths as they are (the loader's base_dir '.': they already include the file's folder)
    assert layout.loads(layout.dumps(loaded), file=str(path)) == loaded
    # paths relative to the file's folder, loaded from there, as a file next to the original would be
    text = layout.dumps(loaded, relative_to=path.parent)
    assert layout.loads(text, file=str(path), base_dir=path.parent) == loaded
    # written elsewhere: the same layout, its paths naming the same files
    out = tmp_path / "sub" / "copy.toml"
    out.parent.mkdir()
    layout.dump(loaded, out, relative_to=out.parent)
    again = layout.load(out)
    same_files = reader.map_paths(again, lambda p: str(Path(p).resolve()))
    assert same_files == attrs.evolve(reader.map_paths(loaded, lambda p: str(Path(p).resolve())), file=str(out))
    assert {p.name for p in tmp_path.rglob("*")} == {"sub", "copy.toml"}  # no temporary file left


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=_id)
def test_cluster_files_round_trip(path, tmp_path):
    _, raw, sections = layout.read_cluster_file(path, "the planner", extra=("plan",))
    extra = {"plan": raw["plan"]} if "plan" in raw else {}
    out = tmp_path / path.name  # the planner's [plan] profile path (if any) is relative to the file
    out.write_text(layout.dumps_cluster(sections, extra, header="written by the test\nsecond line"))
    _, raw2, sections2 = layout.read_cluster_file(out, "the planner", extra=("plan",))
    assert sections2 == sections
    assert raw2.get("plan") == raw.get("plan")
    if "plan" in raw and "profile" not in raw["plan"]:
        want, got = load_cluster(path), load_cluster(out)
        assert attrs.evolve(got, file=want.file) == want


def test_header_and_comments_are_comments():
    lay = layout.load(LAYOUTS / "examples" / "two_pipelines.toml")
    comments = {
        "pipelines[0]": 'home # of\\ "it"',
        "pipelines[1].stages[0].devices": "stage 'one'",
        "cluster.nodes[0].name": "first",
        "train.steps": "steps",
    }
    text = layout.dumps(lay, header="line one\n# already a comment\n\nafter a blank", comments=comments)
    assert layout.loads(text, file=lay.file) == lay
    lines = text.splitlines()
    assert lines[:4] == ["# line one", "# already a comment", "#", "# after a blank"]
    for path, comment in comments.items():  # each on the line of its key or table header
        (line,) = [ln for ln in lines if ln.endswith("  # " + comment)]
        assert line.startswith("[[pipelines]]" if path == "pipelines[0]" else path.rsplit(".", 1)[1] + " = ")


# ------------------------------------------------------------------------------------ every key kind

AWKWARD = [
    "plain",
    'with "double" quotes',
    "it's",
    "back\\slash",
    "C:\\path\\x",
    "tab\there",
    "new\nline",
    "\x01\x1f\x7f controls",
    "unicode é ü 字 🙂",
    "'''",
    '"""',
    "# not a comment",
    "a = b",
    "[x]",
    "",
    " ",
]
FLOATS = [1e-5, 0.1, 0.2 + 0.1, 1 / 3, 1e-300, 5e-324, 1e16, 123456.789, 2.0**-30, 3.0, 1e300, 6.02214076e23]


def _float(rng: random.Random, low: float = 0.0) -> float:
    return rng.choice([f for f in FLOATS if f > low])


def _layout(rng: random.Random, folder: Path) -> Layout:
    """A valid layout whose every kind of key holds a value far from its default: awkward strings, floats
    that print long, enums, booleans, arrays, NCCL tables, nested tables, per-stage recompute, buckets."""
    sched = folder / rng.choice(["order.txt", 'or"der\\1.txt', "ordre é.txt"])
    sched.write_text("F0 B0\nF0 B0\n")
    nccl = (("NCCL_IB_HCA", rng.choice([s for s in AWKWARD if s.strip()])), ("NCCL_NET", "IB"))
    model = ModelSpec(
        layers=4,
        hidden=32,
        heads=4,
        vocab=64,
        seq_len=16,
        ffn=48,
        norm=layout.Norm.RMSNORM,
        position=layout.Position.ROPE,
        mlp=layout.Mlp.SWIGLU,
        init_std=_float(rng),
        norm_eps=_float(rng),
        rope_theta=_float(rng),
        kv_heads=2,
        tie_embeddings=True,
        bias=True,
        init_from=str(folder / rng.choice([s for s in AWKWARD if s.strip()])),
    )
    train = TrainSpec(
        steps=3,
        global_batch=6,
        seed=rng.randrange(1 << 40),
        schedule=layout.Schedule.GPIPE,
        lr=_float(rng),
        min_lr=_float(rng),
        warmup_steps=1,
        weight_decay=_float(rng),
        beta1=rng.choice([0.0, 0.1, 1 / 3, 0.85]),
        beta2=rng.choice([0.5, 0.999, 0.2 + 0.1]),
        eps=_float(rng),
        grad_clip=_float(rng),
        log_every=2,
        eval_every=1,
        eval_batches=2,
        recompute=layout.Recompute.FULL,
    )
    data = DataSpec(
        field=rng.choice(AWKWARD),
        separator=rng.choice(AWKWARD),
        packing=layout.Packing.DOCUMENTS,
        doc_len_median=_float(rng, 2.0),
        doc_len_sigma=_float(rng),
        grammar_seed=7,
        grammar_vocab=9,
        branching=3,
    )
    nodes = (
        NodeSpec(
            name="n-0",
            host="10.0.0.1",
            devices=("cpu", "cpu"),
            domain="ib_a",
            speed=_float(rng),
            memory_gb=_float(rng),
            p2p=layout.P2P.NETWORK,
        ),
        NodeSpec(name="n_1", devices=("cpu",), domain="eth", p2p=layout.P2P.SHM),
    )
    domains = (
        DomainSpec(
            name="ib_a",
            kind=layout.DomainKind.IB,
            bandwidth_gbps=_float(rng),
            latency_us=_float(rng),
            gloo_ifname="ib0",
            nccl=nccl,
        ),
        DomainSpec(name="eth", kind=layout.DomainKind.ETHERNET, bandwidth_gbps=0.1, latency_us=0.0),
    )
    cluster = ClusterSpec(
        nodes=nodes,
        master="n_1",
        port=rng.randrange(1, 65536),
        timeout_s=_float(rng, 1.0),
        domains=domains,
        cross_domain=CrossDomainSpec(
            bandwidth_gbps=_float(rng), latency_us=1e-5, gloo_ifname="x.0", nccl=(("NCCL_NET", "Socket"),)
        ),
    )
    stages = (
        StageSpec(layers=3, devices=("n-0:0", "n-0:1"), recompute=layout.Recompute.NONE),
        StageSpec(layers=1, devices=("n_1:0",)),
    )
    home = (PipelineSpec(batch=6, microbatches=2, stages=stages, schedule_file=str(sched)),)
    buckets = (
        BucketSpec(
            max_len=5,
            schedule=layout.Schedule.ONE_F_ONE_B,
            chunks=0,
            elastic=True,
            pipelines=(
                PipelineSpec(batch=1, microbatches=1, stages=(StageSpec(4, ("n-0:0",)),)),
                PipelineSpec(batch=1, microbatches=1, stages=(StageSpec(4, ("n-0:1",)),)),
            ),
        ),
        BucketSpec(max_len=16, top_up=True),
    )
    return Layout(
        file=str(folder / "made.toml"),
        model=model,
        train=train,
        data=data,
        cluster=cluster,
        pipelines=home,
        buckets=buckets,
    )


@pytest.mark.parametrize("seed", range(6))
def test_hand_made_layouts_round_trip(seed, tmp_path):
    made = _layout(random.Random(seed), tmp_path)
    layout.validate(made)  # a layout the loader would accept
    path = tmp_path / "made.toml"
    layout.dump(made, path, relative_to=tmp_path)
    assert layout.load(path) == made
    assert layout.loads(layout.dumps(made), file=made.file) == made


def test_defaults_are_left_out_and_reload():
    """A layout of required keys only: its text has no key at its default, and reloads to the defaults."""
    lay = layout.loads(
        "[model]\nlayers = 1\nhidden = 4\nheads = 1\nvocab = 64\nseq_len = 4\n[train]\nsteps = 1\n"
        'global_batch = 1\n[cluster]\n[[cluster.nodes]]\nname = "a"\n[[pipelines]]\nbatch = 1\n'
        'microbatches = 1\n[[pipelines.stages]]\nlayers = 1\ndevices = ["a:0"]\n'
    )
    text = layout.dumps(lay)
    assert layout.loads(text) == lay
    raw = tomllib.loads(text)
    assert set(raw) == {"model", "train", "cluster", "pipelines"}  # [data] is all defaults
    assert raw["cluster"] == {"nodes": [{"name": "a"}]}
    assert raw["pipelines"] == [{"batch": 1, "microbatches": 1, "stages": [{"layers": 1, "devices": ["a:0"]}]}]


@pytest.mark.parametrize(
    "value",
    [
        0,
        -1,
        2**63 - 1,
        True,
        False,
        *FLOATS,
        -0.0,
        -2.5e-7,
        *AWKWARD,
        [],
        [1, 2],
        [[1, 2], ["a", ['b\\"', []]]],
        [0.1, 1e-5],
        {"a": 1, "b c": [1.5, {"d": "e\n"}], "é": {}},
    ],
)
def test_values_read_back_by_tomllib(value):
    got = tomllib.loads(f"v = {toml_value(value)}\n")["v"]
    assert got == value and type(got) is type(value)
    if isinstance(value, float):
        assert math.copysign(1, got) == math.copysign(1, value)  # -0.0 stays negative


def test_non_finite_floats_and_keys():
    assert math.isnan(tomllib.loads(f"v = {toml_value(float('nan'))}")["v"])
    assert tomllib.loads(f"v = [{toml_value(float('inf'))}, {toml_value(float('-inf'))}]")["v"] == [math.inf, -math.inf]
    for key in ["bare_key-1", "slow*", "a.b", "with space", 'q"uote', "é", ""]:
        assert tomllib.loads(f"{toml_key(key)} = 1") == {key: 1}
