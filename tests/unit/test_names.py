"""Modules go by their names: no code (library, bench, tests) names a module by its name from before the tree
was reorganized by layer (commit b9da0bf: ``hetero_llm/layout_toml.py`` became ``layout/reader.py``, ...), neither
by importing a module that no longer exists nor by an alias (``import reader as layout_toml``). Torch-free."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import hetero_llm

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "hetero_llm"

# Every flat module of hetero_llm/ before the reorganization by layer (`git ls-tree --name-only b9da0bf^
# hetero_llm/`, with schedule.py and comm.py, split into packages before it; errors.py and timeline.py kept their
# names), and what each is now.
OLD_NAMES = {
    "bucket_sim": "switching/predict.py",
    "bucketing": "switching/bucketing.py",
    "checkpoint": "checkpoint/folders.py",
    "checkpoint_io": "checkpoint/shards.py",
    "cli": "cli/launch.py",
    "cluster_file": "layout/cluster_file.py",
    "collectives": "comm/collectives.py",
    "comm": "comm/",
    "data": "data/batches.py",
    "docmask": "model/document_mask.py",
    "documents": "data/documents.py",
    "dryrun": "plan/describe.py",
    "envlaunch": "launch/external.py",
    "evaluate": "data/held_out.py",
    "export": "interop/export.py",
    "generate": "interop/generate.py",
    "groups": "comm/groups.py",
    "heartbeat": "comm/heartbeat.py",
    "hf": "interop/hf.py",
    "hotswitch": "switching/switcher.py",
    "launch": "launch/node.py",
    "layout": "layout/",
    "layout_fields": "layout/fields.py",
    "layout_rules": "layout/rules.py",
    "layout_schema": "layout/schema.py",
    "layout_toml": "layout/reader.py",
    "model": "model/forward.py",
    "optim": "runtime/adamw.py",
    "optim_shards": "plan/zero1_slices.py",
    "outputs": "launch/preflight.py",
    "p2p": "comm/p2p.py",
    "params": "model/params.py",
    "place": "planner/place.py",
    "plan": "plan/",
    "plan_cli": "cli/plan.py",
    "rankplan": "plan/rank.py",
    "rendezvous": "comm/rendezvous.py",
    "runtime": "runtime/interpreter.py",
    "schedule": "schedule/",
    "shm": "comm/shm.py",
    "simulate": "predict/simulate.py",
    "streams": "comm/streams.py",
    "switch": "switching/transfers.py",
    "textcache": "data/text_cache.py",
    "tokenfiles": "data/token_files.py",
    "tokens": "data/tokenizers.py",
    "trace": "predict/trace.py",
    "train": "train/",
    "wgrad": "runtime/wgrad.py",
    "zero1": "runtime/zero1.py",
}


def _exists(dotted: str) -> bool:
    """Whether ``hetero_llm.a.b`` is a module or package of today's tree."""
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _files() -> list[Path]:
    """Every Python file of the library, bench and tests but this one (whose examples name old modules on purpose)."""
    here = Path(__file__).resolve()
    return sorted(p for top in ("hetero_llm", "bench", "tests") for p in (ROOT / top).rglob("*.py") if p != here)


# An import written in a string (a command for a subprocess) counts as one in code.
_IMPORT_AS = re.compile(r"\bimport\s+([\w.]+)\s+as\s+(\w+)|\bfrom\s+([\w.]+)\s+import\s+(\w+)\s+as\s+(\w+)")
_DOTTED = re.compile(r"\bhetero_llm((?:\.\w+)+)")


def _aliases(text: str) -> set[tuple[str, str]]:
    """(what is imported, the name it is bound to) for every ``... as NAME`` import of ``text``."""
    found = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            found |= {(a.name.rpartition(".")[2], a.asname) for a in node.names if a.asname}
    for m in _IMPORT_AS.finditer(text):
        found.add((m.group(1).rpartition(".")[2], m.group(2)) if m.group(1) else (m.group(4), m.group(5)))
    return found


def _imported_modules(text: str) -> set[str]:
    """The hetero_llm modules ``text`` names: dotted paths anywhere (code, commands in strings) and the names of
    ``from hetero_llm import a, b`` (the public API's names, ``hetero_llm.evaluate``, are no modules)."""
    found = {m.group(1)[1:] for m in _DOTTED.finditer(text)}
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and node.module == "hetero_llm" and not node.level:
            found |= {a.name for a in node.names}
    return found


def _old_names_in(path: Path) -> list[str]:
    text = path.read_text()
    problems = []
    for what, alias in sorted(_aliases(text)):
        if alias in OLD_NAMES and alias != what:
            problems.append(f"`{what}` imported as `{alias}`, the old name of {OLD_NAMES[alias]}: call it `{what}`")
    for dotted in sorted(_imported_modules(text)):
        first = dotted.split(".")[0]
        if first in OLD_NAMES and not _exists(f"hetero_llm.{first}") and first not in hetero_llm.__all__:
            problems.append(f"hetero_llm.{dotted}: `{first}` is now {OLD_NAMES[first]}")
    return problems


@pytest.mark.parametrize("path", _files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_goes_by_an_old_name(path):
    assert _old_names_in(path) == []


def test_the_check_finds_old_names(tmp_path):
    """The scan sees an old module imported, an alias in code (one name or several), and one in a command string."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from hetero_llm import layout_toml\n"
        "import hetero_llm.optim_shards\n"
        "from hetero_llm.data import (held_out as evaluate, batches)\n"
        "from hetero_llm.launch import node as launcher\n"
        "CMD = 'from hetero_llm.launch import node as launch; launch.main()'\n"
    )
    assert _old_names_in(bad) == [
        "`held_out` imported as `evaluate`, the old name of data/held_out.py: call it `held_out`",
        "`node` imported as `launch`, the old name of launch/node.py: call it `node`",
        "hetero_llm.layout_toml: `layout_toml` is now layout/reader.py",
        "hetero_llm.optim_shards: `optim_shards` is now plan/zero1_slices.py",
    ]


def test_every_old_name_is_gone_from_the_tree():
    """The list is of names no module of today's tree has at its old place (a package of the same name is the
    layer it became: layout/, plan/, ...), and each points where its module went."""
    for old, now in OLD_NAMES.items():
        assert (PACKAGE / now).exists(), f"{old}: {now} does not exist"
        assert not (PACKAGE / f"{old}.py").exists(), old
