"""The tree keeps its architecture (docs/architecture.md): packages by layer, imports one way, no circle.

Every import counts, wherever it stands: at the top of a module, inside a function (a lazy import is still
a dependency) and under ``if TYPE_CHECKING:`` (a type-only import still ties two modules together). Torch-free.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "hetero_llm"

# Lowest first: a module may import its own layer and the layers before it, never a later one.
LAYERS = [
    # no hetero_llm imports
    ("hetero_llm", "hetero_llm.errors", "hetero_llm._fs", "hetero_llm.progress", "hetero_llm._properties"),
    ("hetero_llm.data",),  # text, tokens, documents, the global batch: numpy only
    ("hetero_llm.layout",),  # the user's TOML as frozen records, every rule checked
    ("hetero_llm.schedule",),  # actions, generators, the validator
    ("hetero_llm.model",),  # parameter names and shapes; the math
    ("hetero_llm.plan",),  # a layout compiled: every rank's plan
    ("hetero_llm.predict",),  # simulator, modelled devices, traces, timelines
    ("hetero_llm.planner",),  # hetero-plan, hetero-place
    ("hetero_llm.comm",),  # rendezvous, groups, p2p, shared memory, collectives
    ("hetero_llm.runtime",),  # one rank's interpreter, state, optimizers, emulation
    ("hetero_llm.checkpoint",),  # save folders and shard files
    ("hetero_llm.interop",),  # Hugging Face in and out, generation
    ("hetero_llm.switching",),  # hot switching
    ("hetero_llm.train",),  # the step loop and what it reports
    ("hetero_llm.launch",),  # checks before a run, starting and watching ranks
    ("hetero_llm.api",),  # the public API: load, predict, plan, run, read checkpoints
    ("hetero_llm.sweep",),  # hetero-sweep: scripted sweeps of predicted and measured points
    ("hetero_llm.cli", "hetero_llm.timeline"),  # command lines: nothing imports them
]


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The hetero_llm modules ``name`` imports anywhere in its file (a name imported from a package that is a
    module of it counts as that module)."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


@functools.cache
def _edges() -> dict[str, set[str]]:
    """Every module's imports of the package's modules (made at the first test that asks: parsing every module costs
    ~2 s, which each xdist worker would pay at collection)."""
    return {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(module: str) -> int:
    for index, names in enumerate(LAYERS):
        if any(module == n or module.startswith(n + ".") and n != "hetero_llm" for n in names):
            return index
    raise AssertionError(
        f"{module} is in no layer of tests/unit/test_architecture.py: place it (and in docs/architecture.md)"
    )


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in _edges()[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(_edges()):
        if v not in index:
            visit(v)
    return out


def test_the_scan_sees_every_kind_of_import():
    """Top-level, function-local and TYPE_CHECKING imports are all edges (the scan must see what it checks)."""
    assert "hetero_llm.comm.streams" in _edges()["hetero_llm.train.loop"]  # top level
    assert "hetero_llm.interop.hf" in _edges()["hetero_llm.launch.preflight"]  # inside a function
    assert "hetero_llm.plan.rank" in _edges()["hetero_llm.checkpoint.folders"]  # under TYPE_CHECKING


def test_no_import_cycle():
    assert _cycles() == []


# The top package re-exports the public API (hetero_llm.api) from its module __getattr__, on first use only: the
# one upward import, which never runs while a lower module imports the package.
LAZY_REEXPORT = ("hetero_llm", "hetero_llm.api")


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_run_down_the_layers(module):
    mine = _layer(module)
    upward = sorted(t for t in _edges()[module] if _layer(t) > mine and (module, t) != LAZY_REEXPORT)
    assert upward == [], f"{module} (layer {mine}) imports later layers: {upward}"


def test_the_public_api_is_imported_lazily():
    """The top package's import of hetero_llm.api sits inside its module ``__getattr__``, nowhere else."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    top = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom) and "api" in ast.dump(n)]
    getattr_ = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "__getattr__")
    assert top == [] and "api" in ast.dump(getattr_)


def test_nothing_below_the_command_line_imports_it():
    cli_layer = _layer("hetero_llm.cli")
    users = sorted(
        m
        for m, targets in _edges().items()
        if _layer(m) < cli_layer and any(t == "hetero_llm.cli" or t.startswith("hetero_llm.cli.") for t in targets)
    )
    assert users == []


def _over_500_lines(paths) -> dict[str, int]:
    """The files among ``paths`` (relative to the repository root) longer than 500 lines, with their length."""
    lines = {str(p.relative_to(PACKAGE.parent)): len(p.read_text().splitlines()) for p in paths}
    return {name: n for name, n in lines.items() if n > 500}


def test_no_module_is_over_500_lines():
    assert _over_500_lines(MODULES.values()) == {}


BENCH = PACKAGE.parent / "bench"


def test_no_bench_module_is_over_500_lines():
    """bench/ too: the benchmark scripts, the modules they share and the testbed package."""
    modules = sorted(BENCH.rglob("*.py"))
    assert {
        BENCH / "common" / "benchlib.py",
        BENCH / "hot_switch" / "hot_switch.py",
        BENCH / "testbed" / "__init__.py",
    } <= set(modules)
    assert _over_500_lines(modules) == {}


TESTS = PACKAGE.parent / "tests"


def test_no_test_file_is_over_500_lines():
    """tests/ too, by tier (tests/unit, tests/integration) and the shared helpers: a file that grows past 500 lines is
    split by what its tests check."""
    files = sorted(TESTS.rglob("*.py"))
    assert {TESTS / "harness.py", TESTS / "unit" / "test_architecture.py"} <= set(files)
    assert _over_500_lines(files) == {}
