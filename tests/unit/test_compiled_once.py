"""One plan, compiled once (docs/architecture.md): the facts the launcher, the shared-memory rings, the memory
check and hot switching run from are compiled with the plan and read from it, not re-derived from the layout
where they are used. Torch-free."""

from __future__ import annotations

import ast
from pathlib import Path

from hetero_llm import layout as layout_mod
from hetero_llm.layout import bucket_layout, elastic_layout
from hetero_llm.plan import compile_plan

ROOT = Path(__file__).resolve().parents[2]
HOT = ROOT / "layouts" / "examples" / "hot_switch.toml"
ELASTIC = ROOT / "tests" / "data" / "buckets_tp23.toml"  # every bucket elastic

# Where plan facts are used: each reads the compiled plan and compiles none itself
USERS = (
    "hetero_llm/switching/switcher.py",
    "hetero_llm/switching/predict.py",
    "hetero_llm/switching/worth.py",
    "hetero_llm/switching/transfers.py",
    "hetero_llm/comm/shm.py",
    "hetero_llm/launch/memory.py",
)


def test_bucket_plans_are_compiled_with_the_plan():
    for path in (HOT, ELASTIC):
        lay = layout_mod.load(path)
        plan = compile_plan(lay)
        assert len(plan.buckets) == len(lay.buckets) > 0
        # each for rows of its max_len (its CP chunks and re-chunking boundaries cut those)
        assert list(plan.buckets) == [compile_plan(bucket_layout(lay, i), b.max_len) for i, b in enumerate(lay.buckets)]
        assert [b.row_width for b in plan.buckets] == [b.max_len for b in lay.buckets]
        assert all(b.buckets == () for b in plan.buckets)  # a bucket layout has no buckets of its own


def test_an_elastic_buckets_plan_per_microbatch_count_is_compiled_once_and_kept():
    lay = layout_mod.load(ELASTIC)
    bucket = compile_plan(lay).buckets[0]
    assert bucket.for_rounds(1) is bucket
    three = bucket.for_rounds(3)
    assert three == compile_plan(elastic_layout(bucket_layout(lay, 0), 3), lay.buckets[0].max_len)
    assert bucket.for_rounds(3) is three  # kept: the second step with 3 rounds compiles nothing
    assert [p.microbatches for p in three.layout.pipelines] == [3 * p.microbatches for p in bucket.layout.pipelines]


def _calls_and_imports(path: Path) -> tuple[set[str], set[str]]:
    tree = ast.parse(path.read_text())
    calls = {
        n.func.id if isinstance(n.func, ast.Name) else n.func.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name | ast.Attribute)
    }
    imported = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    return calls, imported


def test_users_of_plan_facts_compile_no_bucket_or_elastic_plan():
    for rel in USERS:
        calls, imported = _calls_and_imports(ROOT / rel)
        assert not {"bucket_layout", "elastic_layout"} & (calls | imported), rel
    # the switching step and the memory check compile nothing at all
    for rel in ("hetero_llm/switching/switcher.py", "hetero_llm/launch/memory.py", "hetero_llm/comm/shm.py"):
        calls, imported = _calls_and_imports(ROOT / rel)
        assert "compile_plan" not in calls | imported, rel


def test_the_memory_check_reads_rank_plans_not_the_layout():
    tree = ast.parse((ROOT / "hetero_llm/launch/memory.py").read_text())
    reads = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert "layout" not in reads and "pipelines" not in reads
