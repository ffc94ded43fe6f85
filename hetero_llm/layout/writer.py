"""Schema objects to TOML: the loader's inverse, ``loads(dumps(load(f))) == load(f)``.

Written from the schema's declarations, as the reader reads them (``reader.shape`` says how each
field is written), so a new key needs no code here: every section in the loader's order, in each table
its keys in declaration order with defaults left out (they reload identically), then its sub-tables
(``[cluster.cross_domain]``) and arrays of tables (``[[cluster.nodes]]``, ``[[pipelines]]`` with their
``[[pipelines.stages]]``, ``[[buckets]]``). NCCL variables are an inline table. A header (comment lines
on top) and comments at the end of chosen lines (named by TOML path, e.g. ``pipelines[0].stages[1].devices``
or ``buckets[0]`` for a table's header line) can be passed in. Cluster files (a layout without
``[[pipelines]]``, plus tables the caller reads itself such as the planner's ``[plan]``) have
``dumps_cluster``. Imports no torch.
"""

from __future__ import annotations

import enum
import math
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs

from hetero_llm._fs import write_atomically
from hetero_llm.layout import reader
from hetero_llm.layout.schema import Layout

_BARE_KEY = re.compile(r"[A-Za-z0-9_\-]+")
_ESCAPES = {"\\": "\\\\", '"': '\\"', "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def dumps(
    layout: Layout,
    *,
    header: str = "",
    comments: Mapping[str, str] | None = None,
    relative_to: str | os.PathLike | None = None,
) -> str:
    """The TOML text of ``layout``. ``relative_to``: the folder the text will be loaded from, for a layout
    from ``load`` (whose file paths include its folder): its paths are written relative to that folder.
    None writes them as they are (paths already relative to where the file goes, e.g. a cluster file's)."""
    if relative_to is not None:
        folder = Path(relative_to)
        layout = reader.map_paths(layout, lambda p: _relative(p, folder))
    sections = {name: getattr(layout, name) for name in reader.SECTIONS}
    arrays = {name: getattr(layout, name) for name in reader.ARRAYS}
    return _document(sections, arrays, {}, header, comments or {})


def dump(
    layout: Layout,
    path: str | os.PathLike,
    *,
    header: str = "",
    comments: Mapping[str, str] | None = None,
    relative_to: str | os.PathLike | None = None,
) -> str:
    """Write ``dumps(layout, ...)`` to ``path`` atomically (a crash leaves the old file or the new one);
    returns the text. For a layout from ``load`` pass ``relative_to=Path(path).parent``."""
    text = dumps(layout, header=header, comments=comments, relative_to=relative_to)
    write_atomically(Path(path), lambda f: f.write(text.encode("utf-8")))
    return text


def dumps_cluster(
    sections: Mapping[str, Any],
    extra: Mapping[str, Any] | None = None,
    *,
    header: str = "",
    comments: Mapping[str, str] | None = None,
) -> str:
    """A cluster file (the input of hetero-place and hetero-plan): ``sections`` as ``read_cluster_file``
    returns them (``model``, ``train``, ``data``, ``cluster``), then ``extra`` raw TOML tables the loader
    leaves to its caller (``{"plan": raw["plan"]}``), written as they are."""
    return _document(dict(sections), {}, dict(extra or {}), header, comments or {})


def toml_value(value: Any) -> str:
    """One TOML value: strings escaped, floats by ``repr`` (which reads back to the same float), arrays
    and tables inline; enums as their values."""
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return (
            '"'
            + "".join(_ESCAPES.get(c) or (f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c) for c in value)
            + '"'
        )
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + " }" if value else "{}"
    raise TypeError(f"no TOML form for {type(value).__name__} {value!r}")  # a bug in the caller, not user input


def toml_key(key: str) -> str:
    """A key bare where TOML allows it, else quoted."""
    return key if _BARE_KEY.fullmatch(key) else toml_value(key)


# --------------------------------------------------------------------------------------------


def _relative(path: str, folder: Path) -> str:
    """``path`` (relative to the working directory, or absolute) as the loader will find it from ``folder``:
    lexically below it when it is (so the loader's ``folder / path`` gives back the very string), else
    relative by absolute paths."""
    p = Path(path)
    if p.is_absolute() and not folder.is_absolute():
        return path
    try:
        return str(p.relative_to(folder))
    except ValueError:
        return os.path.relpath(os.path.abspath(path), os.path.abspath(folder))


def _document(
    sections: dict[str, Any], arrays: dict[str, tuple], extra: dict[str, Any], header: str, comments: Mapping[str, str]
) -> str:
    out: list[str] = [("# " + line).rstrip() if not line.startswith("#") else line for line in header.splitlines()]
    blocks: list[list[str]] = []
    for name, obj in sections.items():
        blocks.append(_table(obj, name, name, f"[{name}]", comments))
    for name, items in arrays.items():
        for i, obj in enumerate(items):
            blocks.append(_table(obj, f"{name}[{i}]", name, f"[[{name}]]", comments))
    for name, value in extra.items():
        blocks.append(_raw_table(value, [name], f"[{toml_key(name)}]", comments, name))
    for block in blocks:
        if block:
            if out:
                out.append("")
            out += block
    return "\n".join(out) + "\n"


def _line(text: str, comments: Mapping[str, str], path: str) -> str:
    comment = comments.get(path)
    return f"{text}  # {comment}" if comment else text


def _table(obj: Any, path: str, name: str, head: str, comments: Mapping[str, str]) -> list[str]:
    """Lines of one schema table: header, keys left off at their defaults, then sub-tables and arrays of
    tables. ``path`` names it with indices (for comments), ``name`` without (for headers). A table with
    nothing to say is left out (every table without required keys may be)."""
    cls = type(obj)
    keys: list[str] = []
    subs: list[str] = []
    for f in attrs.fields(cls):
        value = getattr(obj, f.name)
        if f.default is not attrs.NOTHING and _same(value, f.default):
            continue
        kind, _ = reader.shape(cls, f)
        where, at = f"{path}.{f.name}", f"{name}.{f.name}"
        if kind == "array":
            for i, item in enumerate(value):
                subs += _table(item, f"{where}[{i}]", at, f"[[{at}]]", comments)
        elif kind == "table":
            subs += _table(value, where, at, f"[{at}]", comments)
        elif kind == "nccl":
            keys.append(_line(f"{toml_key(f.name)} = {toml_value(dict(value))}", comments, where))
        else:
            keys.append(_line(f"{toml_key(f.name)} = {toml_value(value)}", comments, where))
    if not keys and not subs and not head.startswith("[["):
        return []
    return [_line(head, comments, path)] + keys + subs


def _same(value: Any, default: Any) -> bool:
    return value is default or value == default


def _raw_table(
    table: Mapping[str, Any], names: list[str], head: str, comments: Mapping[str, str], path: str
) -> list[str]:
    """A raw TOML table (a dict as ``tomllib`` reads it): plain keys, then sub-tables and arrays of tables."""
    keys, subs = [], []
    for key, value in table.items():
        where, at = f"{path}.{key}", [*names, key]
        if isinstance(value, Mapping):
            subs += _raw_table(value, at, f"[{_dotted(at)}]", comments, where)
        elif isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value):
            for i, item in enumerate(value):
                subs += _raw_table(item, at, f"[[{_dotted(at)}]]", comments, f"{where}[{i}]")
        else:
            keys.append(_line(f"{toml_key(key)} = {toml_value(value)}", comments, where))
    return [_line(head, comments, path)] + keys + subs


def _dotted(names: Iterable[str]) -> str:
    return ".".join(toml_key(n) for n in names)
