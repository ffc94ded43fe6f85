"""docs/architecture.md's package table is the tree: each row names every module of its package and only modules that
exist. Torch-free."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "hetero_llm"
DOC = ROOT / "docs" / "architecture.md"


def _rows() -> dict[str, set[str]]:
    """Each row of the package table: its first cell (`data/`, `hetero_llm/` for the top, `api.py`) and the modules
    its last cell names (every backticked ``*.py``, parenthesized remarks included)."""
    table = DOC.read_text().split("## The packages, lowest layer first", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        rows[cells[0].split("`")[1]] = set(re.findall(r"`([\w/]+\.py)`", cells[-1]))
    return rows


def _has_code(path: Path) -> bool:
    """Whether a package's ``__init__.py`` holds more than a docstring (then it is a module of its own to name)."""
    body = ast.parse(path.read_text()).body
    return any(not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)) for n in body)


def _tree() -> dict[str, set[str]]:
    """What each row should name: a package's modules (its ``__init__.py`` when it has code), the top package's own
    modules but api.py, and api.py."""
    out = {}
    for folder in sorted(p for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()):
        out[f"{folder.name}/"] = {p.name for p in folder.glob("*.py") if p.name != "__init__.py" or _has_code(p)}
    top = {p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py" or _has_code(p)}
    out["hetero_llm/"] = top - {"api.py"}
    out["api.py"] = {"api.py"}
    return out


def test_every_package_has_a_row():
    assert sorted(_rows()) == sorted(_tree())


def test_each_row_names_its_modules_and_only_those():
    rows, tree = _rows(), _tree()
    problems = []
    for name in sorted(tree):
        named = rows.get(name, set())
        if named - tree[name]:
            problems.append(f"the {name} row names {sorted(named - tree[name])}, not in the tree")
        if tree[name] - named:
            problems.append(f"the {name} row misses {sorted(tree[name] - named)}")
    assert problems == [], "docs/architecture.md: fix its package table"


def test_the_table_is_read():
    """The scan sees the rows (a table the parser misread would pass the tests above vacuously)."""
    rows = _rows()
    assert len(rows) >= 15 and "reader.py" in rows["layout/"] and "cp_chunks.py" in rows["model/"]
