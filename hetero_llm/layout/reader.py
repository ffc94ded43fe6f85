"""TOML to schema objects: the only code that touches the raw TOML dict.

Reads the file (refusing what TOML cannot be: a folder, a BOM, non-UTF-8 text), applies ``--set``
overrides, then builds the attrs classes of ``schema`` key by key: a key the schema does not
declare is an error with a did-you-mean, and each value is converted by its field's annotation (enums
by their values, numbers, strings, arrays, nested tables), every message naming the key's TOML path.
How a field is read follows from its annotation alone, so a new key needs no code here. Nothing is
validated beyond types: that is ``rules``.
"""

from __future__ import annotations

import difflib
import enum
import math
import os
import re
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from hetero_llm.errors import LayoutError
from hetero_llm.layout.cluster_schema import NCCL_VARIABLES, ClusterSpec
from hetero_llm.layout.schema import BucketSpec, DataSpec, Layout, ModelSpec, PipelineSpec, TrainSpec

SECTIONS = {"model": ModelSpec, "train": TrainSpec, "data": DataSpec, "cluster": ClusterSpec}
ARRAYS = {"pipelines": PipelineSpec, "buckets": BucketSpec}  # top-level arrays of tables
_REQUIRED_SECTIONS = ("model", "train", "cluster", "pipelines")


def read(path: str | os.PathLike) -> dict:
    """The TOML of a layout file, every way of not being one refused in one located line."""
    file = str(path)
    p = Path(path)
    if p.is_dir():
        raise LayoutError(
            file, "", "is a folder, not a layout file (pass the path of a .toml layout, e.g. layouts/quickstart.toml)"
        )
    if not p.is_file():
        raise LayoutError(
            file, "", "no such layout file (pass the path of a .toml layout, e.g. layouts/quickstart.toml)"
        )
    try:
        data = p.read_bytes()
    except OSError as e:
        raise LayoutError(file, "", f"cannot read the file: {e.strerror} (check its permissions)") from None
    if data.startswith(b"\xef\xbb\xbf"):
        raise LayoutError(
            file,
            "",
            "starts with a UTF-8 byte order mark (BOM), which TOML does not allow (save the file as UTF-8 without BOM)",
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise LayoutError(
            file, "", f"line {line} is not UTF-8 text (save the file as UTF-8: TOML requires it)"
        ) from None
    if not text.strip():
        raise LayoutError(file, "", "file is empty (start from layouts/quickstart.toml)")
    return parse(text, file)


# The largest cluster a layout or cluster file may describe, refused in one line before anything reads its nodes one
# by one (a million nodes would otherwise take minutes to say nothing); a file larger than such a cluster needs is
# refused before it is parsed. The papers' largest published run has 315 nodes and 2520 GPUs.
MAX_NODES = 4096
MAX_DEVICES = 65536
MAX_FILE_MB = 8  # a planned layout takes ~37 bytes per GPU (megatron_529.6b.toml: 93 KB for 2520): 2.4 MB at the most


def parse(text: str, file: str) -> dict:
    if len(text) > MAX_FILE_MB << 20:
        most = f"{MAX_FILE_MB} MB: a cluster of {MAX_NODES} nodes and {MAX_DEVICES} devices, the most it handles"
        raise LayoutError(
            file, "", f"{len(text) >> 20} MB, larger than any layout hetero_llm reads ({most}, fits in far less)"
        )
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise LayoutError(file, "", f"TOML syntax error: {e} (fix the TOML syntax there)") from None
    except RecursionError:
        raise LayoutError(file, "", "TOML nested too deeply to read (fix the TOML there)") from None
    cluster = raw.get("cluster")  # nodes and devices counted before any is built: their types are checked later
    nodes = cluster.get("nodes") if isinstance(cluster, dict) else None
    nodes = nodes if isinstance(nodes, list) else []
    devices = sum(len(n["devices"]) for n in nodes if isinstance(n, dict) and isinstance(n.get("devices"), list))
    for count, what, limit in ((len(nodes), "nodes", MAX_NODES), (devices, "devices in all", MAX_DEVICES)):
        if count > limit:
            limits = f"at most {MAX_NODES} nodes and {MAX_DEVICES} devices"
            message = f"{count} {what}, more than hetero_llm handles ({limits}: plan and run a part of the cluster)"
            raise LayoutError(file, "cluster.nodes", message)
    return raw


def to_layout(raw: dict, file: str, base_dir: Path) -> Layout:
    """The typed layout of a TOML dict, its file paths made relative to ``base_dir``; not yet validated."""
    check_keys(raw, list(SECTIONS) + list(ARRAYS), "", file, what="section")
    for name in _REQUIRED_SECTIONS:
        if name not in raw:
            hint = "[[pipelines]]" if name == "pipelines" else f"[{name}]"
            raise LayoutError(file, name, f"missing section (add a {hint} section; see layouts/quickstart.toml)")
    sections = {name: build(cls, raw.get(name, {}), name, file) for name, cls in SECTIONS.items()}
    pipes = raw["pipelines"]
    if not isinstance(pipes, list) or not pipes:
        raise LayoutError(file, "pipelines", "expected one or more [[pipelines]] tables")
    pipelines = tuple(build(PipelineSpec, t, f"pipelines[{i}]", file) for i, t in enumerate(pipes))
    buckets = raw.get("buckets", [])
    if not isinstance(buckets, list) or not buckets and "buckets" in raw:
        raise LayoutError(file, "buckets", "expected one or more [[buckets]] tables")
    buckets = tuple(build(BucketSpec, t, f"buckets[{i}]", file) for i, t in enumerate(buckets))
    layout = Layout(
        file=file,
        model=sections["model"],
        train=sections["train"],
        data=sections["data"],
        cluster=sections["cluster"],
        pipelines=pipelines,
        buckets=buckets,
    )
    return map_paths(layout, lambda p: str(base_dir / p))


def map_paths(layout: Layout, fn: Callable[[str], str]) -> Layout:
    """``layout`` with ``fn`` applied to every file path in it (the keys read relative to the layout file:
    model.init_from, data.path, data.tokenizer unless 'bytes', data.valid_path, every schedule_file), the
    ones left unset ('') untouched. The loader resolves them with it, the writer makes them relative again."""

    def pipes(pipelines: tuple[PipelineSpec, ...]) -> tuple[PipelineSpec, ...]:
        return tuple(attrs.evolve(p, schedule_file=fn(p.schedule_file)) if p.schedule_file else p for p in pipelines)

    model, data = layout.model, layout.data
    if model.init_from:
        model = attrs.evolve(model, init_from=fn(model.init_from))
    if data.path:
        data = attrs.evolve(data, path=fn(data.path))
    if data.tokenizer != "bytes":
        data = attrs.evolve(data, tokenizer=fn(data.tokenizer))
    if data.valid_path:
        data = attrs.evolve(data, valid_path=fn(data.valid_path))
    return attrs.evolve(
        layout,
        model=model,
        data=data,
        pipelines=pipes(layout.pipelines),
        buckets=tuple(attrs.evolve(b, pipelines=pipes(b.pipelines)) for b in layout.buckets),
    )


def check_keys(table: dict, allowed: list[str], path: str, file: str, what: str = "key") -> None:
    for key in table:
        if key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else f" (known: {', '.join(allowed)})"
            where = f"{path}.{key}" if path else key
            raise LayoutError(file, where, f"unknown {what} '{key}'{hint}")


# --------------------------------------------------------------------------------------------
# One table, key by key


def shape(cls: type, f: attrs.Attribute) -> tuple[str, Any]:
    """How field ``f`` of ``cls`` is written in TOML, from its annotation (a string under PEP 563):
    ``("array", C)`` an array of C tables, ``("table", C)`` one C table, ``("nccl", None)`` a table of
    NCCL variables, ``("enum", E)``, or ``(annotation, None)`` for a plain value."""
    assert isinstance(f.type, str), f"{cls.__name__}.{f.name}: the schema modules use PEP 563 annotations"
    annotation = f.type.removesuffix(" | None")  # optional keys: TOML has no null, so a value is given
    if annotation == "tuple[tuple[str, str], ...]":
        return "nccl", None
    inner = re.fullmatch(r"tuple\[(\w+), \.\.\.\]", annotation)
    found = vars(sys.modules[cls.__module__]).get(inner.group(1) if inner else annotation)
    if isinstance(found, type) and attrs.has(found):
        return ("array" if inner else "table"), found
    if isinstance(found, type) and issubclass(found, enum.Enum):
        return "enum", found
    return annotation, None


def build(cls: type, table: Any, path: str, file: str) -> Any:
    """A ``cls`` from TOML table ``table`` at TOML path ``path``: unknown and missing keys refused, values converted."""
    if not isinstance(table, dict):
        raise LayoutError(file, path, f"expected a table, got {type_name(table)}")
    fields = attrs.fields(cls)
    check_keys(table, [f.name for f in fields], path, file)
    kwargs: dict[str, Any] = {}
    for f in fields:
        where = f"{path}.{f.name}"
        if f.name not in table:
            if f.default is attrs.NOTHING:
                raise LayoutError(file, where, f"missing required key ({f.metadata['doc']})")
            continue
        value = table[f.name]
        kind, nested = shape(cls, f)
        if kind == "array":
            if not isinstance(value, list) or not value:
                array = re.sub(r"\[\d+\]", "", where)  # pipelines[0].stages -> pipelines.stages
                raise LayoutError(file, where, f"expected one or more [[{array}]] tables")
            kwargs[f.name] = tuple(build(nested, t, f"{where}[{i}]", file) for i, t in enumerate(value))
        elif kind == "table":
            if isinstance(value, list):
                raise LayoutError(
                    file,
                    where,
                    f"expected one [{where}] table, got an array of tables (write [{where}] with single brackets)",
                )
            kwargs[f.name] = build(nested, value, where, file)
        elif kind == "nccl":
            kwargs[f.name] = _nccl_table(value, where, file)
        elif kind == "enum":
            kwargs[f.name] = _enum(value, nested, where, file)
        else:
            kwargs[f.name] = _value(value, kind, where, file, f.metadata.get("checks", ()))
    return cls(**kwargs)


def _nccl_table(value: Any, where: str, file: str) -> tuple[tuple[str, str], ...]:
    """An ``nccl`` table: known NCCL variable names, values as the text NCCL will read."""
    if not isinstance(value, dict):
        raise LayoutError(
            file,
            where,
            f'expected a table of NCCL variables, got {type_name(value)} (e.g. nccl = {{ NCCL_IB_HCA = "mlx5_0" }})',
        )
    out = []
    for key, v in value.items():
        at = f"{where}.{key}"
        if key not in NCCL_VARIABLES:
            close = difflib.get_close_matches(key.upper(), NCCL_VARIABLES, n=1)
            if not close and not key.upper().startswith("NCCL_"):
                close = difflib.get_close_matches("NCCL_" + key.upper(), NCCL_VARIABLES, n=1)
            hint = f"did you mean '{close[0]}'?" if close else "docs/domains.md lists the accepted names"
            raise LayoutError(file, at, f"unknown NCCL variable '{key}' ({hint})")
        if isinstance(v, bool) or not isinstance(v, (str, int)):
            raise LayoutError(
                file,
                at,
                f'expected a string or an integer, got {type_name(v)} (NCCL reads its variables as text, e.g. "1")',
            )
        if isinstance(v, str) and not v.strip():
            raise LayoutError(file, at, "is empty (remove it to keep NCCL's default)")
        out.append((key, str(v)))
    return tuple(out)


def type_name(v: Any) -> str:
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a float",
        str: "a string",
        list: "an array",
        dict: "a table",
    }.get(type(v), type(v).__name__) + f" ({v!r})"


def _enum(value: Any, enum_cls: type[enum.Enum], where: str, file: str) -> enum.Enum:
    choices = [m.value for m in enum_cls]
    if not isinstance(value, str):
        raise LayoutError(
            file, where, f"expected a string, got {type_name(value)} (choose one of: {', '.join(choices)})"
        )
    if value not in choices:
        # case-insensitive first: "1F1B" and "GPipe" are the likeliest slips
        lowered = {c.lower(): c for c in choices}
        close = (
            [lowered[value.lower()]]
            if value.lower() in lowered
            else difflib.get_close_matches(value.lower(), choices, n=1)
        )
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise LayoutError(file, where, f"unknown value {value!r} ({hint}choose one of: {', '.join(choices)})")
    return enum_cls(value)


def _value(value: Any, annotation: str, where: str, file: str, checks: tuple = ()) -> Any:
    """One scalar or array of strings, checked against its annotation (an integer written as a float: against the
    key's own ``checks`` too, so that the fix offered is a value the key takes)."""
    if annotation in ("int", "float"):
        return _number(value, annotation, where, file, checks)
    if annotation == "bool":
        if not isinstance(value, bool):
            raise LayoutError(file, where, f"expected true or false, got {type_name(value)}")
        return value
    if annotation == "str":
        if not isinstance(value, str):
            raise LayoutError(file, where, f"expected a string, got {type_name(value)} (put it in quotes)")
        return value
    if annotation == "tuple[str, ...]":
        if not isinstance(value, list):
            raise LayoutError(
                file,
                where,
                f"expected an array of strings, got {type_name(value)} (put the values in [ ], each in quotes)",
            )
        for i, v in enumerate(value):
            if not isinstance(v, str):
                raise LayoutError(file, f"{where}[{i}]", f"expected a string, got {type_name(v)} (put it in quotes)")
        return tuple(value)
    raise TypeError(f"layout field type {annotation!r} has no converter")  # a bug here, not user input


def _number(value: Any, annotation: str, where: str, file: str, checks: tuple) -> int | float:
    """``_value`` of an "int" or "float": a float finite; the fix offered for a quoted number or an integer
    written as a float."""
    wanted = "an integer" if annotation == "int" else "a number"
    ok = (int,) if annotation == "int" else (int, float)
    if isinstance(value, bool) or not isinstance(value, ok):
        fix = ""
        if isinstance(value, str):
            try:
                unquoted = tomllib.loads(f"v = {value}")["v"]
            except tomllib.TOMLDecodeError:
                unquoted = None
            if isinstance(unquoted, ok) and not isinstance(unquoted, bool):
                fix = " (remove the quotes)"
        elif annotation == "int" and isinstance(value, float) and value.is_integer():
            problem = next((p for p in (rule(value) for rule in checks) if isinstance(p, str)), None)
            fix = f", and {problem}" if problem else f" (write {int(value)})"
        raise LayoutError(file, where, f"expected {wanted}, got {type_name(value)}{fix}")
    if annotation == "float" and not math.isfinite(value):
        raise LayoutError(file, where, f"expected a finite number, got {value!r}")
    return value if annotation == "int" else float(value)


# --------------------------------------------------------------------------------------------
# --set overrides


_SEGMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(?:\[(\d+)\])?$")


def apply_override(raw: dict, item: str, file: str) -> None:
    """Apply ``a.b[0].c=value`` (``a.b.0.c`` also accepted) to the TOML dict; the value is parsed as TOML."""
    if "=" not in item:
        raise LayoutError(file, f"--set {item}", "expected KEY=VALUE (e.g. --set train.steps=5)")
    key, _, text = item.partition("=")
    key = key.strip()
    if not key:
        raise LayoutError(file, f"--set {item}", "no key before '=' (e.g. --set train.steps=5)")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text  # bare words are strings: --set data.kind=text
    segments = _override_segments(key, file)
    _check_override_path(segments, key, file)
    _set_at(raw, segments, value, key, file)


def _override_segments(key: str, file: str) -> list[str | int]:
    """``a.b[0].c`` (or ``a.b.0.c``) as ``["a", "b", 0, "c"]``."""
    segments: list[str | int] = []
    for part in key.split("."):
        if part.isascii() and part.isdigit():
            segments.append(int(part))
            continue
        m = _SEGMENT.match(part)
        if not m:
            raise LayoutError(file, f"--set {key}", f"cannot parse key segment '{part}' (use e.g. pipelines[0].batch)")
        segments.append(m.group(1))
        if m.group(2) is not None:
            segments.append(int(m.group(2)))
    return segments


def _set_at(raw: dict, segments: list[str | int], value: Any, key: str, file: str) -> None:
    """Set ``value`` at ``segments`` of the TOML dict, making the tables on the way (``key``: for messages)."""
    node: Any = raw
    done = ""  # the part of the key walked so far, for messages
    for i, seg in enumerate(segments):
        if isinstance(seg, int):
            if not isinstance(node, list):
                raise LayoutError(file, f"--set {key}", f"'{done}' is not an array (drop the index [{seg}])")
            if seg >= len(node):
                have = f"{done} has {len(node)} entr{'y' if len(node) == 1 else 'ies'}"
                fix = f"use an index below {len(node)}" if node else "add one to the file first"
                raise LayoutError(file, f"--set {key}", f"index {seg} is out of range: {have} ({fix})")
            if i == len(segments) - 1:
                if isinstance(node[seg], dict):
                    raise LayoutError(file, f"--set {key}", "cannot replace a whole table (set one of its keys)")
                node[seg] = value  # one entry of a plain array: --set pipelines.0.stages.0.devices.0=node0:1
                return
            node = node[seg]
            done += f"[{seg}]"
            continue
        if isinstance(node, list):
            raise LayoutError(file, f"--set {key}", f"'{done}' is an array of tables (pick one, e.g. {done}[0].{seg})")
        if not isinstance(node, dict):
            raise LayoutError(file, f"--set {key}", f"'{done}' is a value, not a table (set '{done}' itself)")
        if i == len(segments) - 1:
            node[seg] = value
            return
        node = node.setdefault(seg, [] if isinstance(segments[i + 1], int) else {})
        done = f"{done}.{seg}" if done else seg


def _check_override_path(segments: list[str | int], key: str, file: str) -> None:
    """Reject --set keys that are not in the schema, even where the file leaves them at a default."""
    cls: type | None = None
    for n, seg in enumerate(segments):
        if isinstance(seg, int):
            continue
        if cls is dict:  # a free-key table (nccl): the loader checks the name
            cls = None
            continue
        if cls is None and n > 0:  # the previous key was a value, not a table
            done = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in segments[:n]).lstrip(".")
            raise LayoutError(file, f"--set {key}", f"'{done}' is a value, not a table (set '{done}' itself)")
        if cls is None:
            allowed = list(SECTIONS) + list(ARRAYS)
            if seg not in allowed:
                close = difflib.get_close_matches(seg, allowed, n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                raise LayoutError(file, f"--set {key}", f"unknown section '{seg}'{hint}")
            cls = ARRAYS.get(seg) or SECTIONS[seg]
            continue
        fields = attrs.fields_dict(cls)
        if seg not in fields:
            names = list(fields)
            close = difflib.get_close_matches(seg, names, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else f" (known: {', '.join(names)})"
            raise LayoutError(file, f"--set {key}", f"unknown key '{seg}'{hint}")
        kind, nested = shape(cls, fields[seg])
        cls = nested if kind in ("array", "table") else dict if kind == "nccl" else None
