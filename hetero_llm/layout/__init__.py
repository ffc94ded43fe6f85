"""Layouts: the TOML a user writes, loaded once into frozen attrs classes and validated.

The front of the package's modules, in data-flow order:

- ``schema``: the classes and enums; every key declared once with its type, default, meaning
  and single-field rules (``fields`` says how a key is declared); ``cluster_schema`` the
  ``[cluster]`` tables.
- ``reader``: the only code that touches the raw TOML dict: reading, ``--set`` overrides, and
  conversion key by key (unknown keys are errors with a did-you-mean, because a silently ignored
  typo such as ``train.stpes`` is the classic way a TOML config lies to its user).
- ``rules``: validation, the rules between keys and the order all rules run in (those of
  ``[data]`` in ``data_rules``, of ``[cluster]`` in ``cluster_rules``).
- ``cluster_file``: a layout without pipelines, read by hetero-place and hetero-plan.
- ``writer``: the loader's inverse, ``dumps`` / ``dump`` (and ``dumps_cluster``): every TOML file the
  package writes is written by it.

Importers use this module (``from hetero_llm import layout``); it re-exports the schema's names.
Imports no torch: ``--dry-run``, planning and most tests run anywhere.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import attrs

from hetero_llm.errors import LayoutError
from hetero_llm.layout import reader
from hetero_llm.layout.cluster_file import read_cluster_file
from hetero_llm.layout.cluster_rules import validate_cluster
from hetero_llm.layout.cluster_schema import (
    CROSS_DOMAIN,
    DEFAULT_TRANSPORT,
    MIN_TIMEOUT_S,
    NCCL_VARIABLES,
    P2P,
    SHM,
    Backend,
    ClusterSpec,
    CommLib,
    CrossDomainSpec,
    DomainKind,
    DomainSpec,
    NodeSpec,
)
from hetero_llm.layout.rules import SPLIT_BACKWARD_NO_COMPILE, validate
from hetero_llm.layout.schema import (
    BucketSpec,
    Compile,
    DataKind,
    DataSpec,
    Layout,
    Mlp,
    ModelSpec,
    Norm,
    Optimizer,
    Packing,
    PipelineSpec,
    Position,
    Precision,
    Recompute,
    Schedule,
    StageSpec,
    TokenDtype,
    TrainSpec,
    bucket_layout,
    elastic_divisor,
    elastic_layout,
)
from hetero_llm.layout.writer import dump, dumps, dumps_cluster

__all__ = [
    "CROSS_DOMAIN",
    "DEFAULT_TRANSPORT",
    "MIN_TIMEOUT_S",
    "NCCL_VARIABLES",
    "P2P",
    "SHM",
    "SPLIT_BACKWARD_NO_COMPILE",
    "Backend",
    "BucketSpec",
    "ClusterSpec",
    "CommLib",
    "Compile",
    "CrossDomainSpec",
    "DataKind",
    "DataSpec",
    "DomainKind",
    "DomainSpec",
    "Layout",
    "LayoutError",
    "Mlp",
    "ModelSpec",
    "NodeSpec",
    "Norm",
    "Optimizer",
    "Packing",
    "PipelineSpec",
    "Position",
    "Precision",
    "Recompute",
    "Schedule",
    "StageSpec",
    "TokenDtype",
    "TrainSpec",
    "build",
    "bucket_layout",
    "dump",
    "dumps",
    "dumps_cluster",
    "elastic_divisor",
    "elastic_layout",
    "from_dict",
    "load",
    "loads",
    "model_from_dict",
    "read_cluster_file",
    "schema_markdown",
    "spec_dict",
    "validate",
    "validate_cluster",
]

build = reader.build  # one TOML table into an attrs class, type-checked (the planner's [plan] tables too)


def load(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> Layout:
    """Read, override (``--set a.b=v``), type-check and validate a layout file."""
    raw = reader.read(path)
    for item in overrides:
        reader.apply_override(raw, item, str(path))
    return from_dict(raw, str(path), base_dir=Path(path).parent)


def loads(text: str, file: str = "<string>", base_dir: str | os.PathLike = ".") -> Layout:
    """Load a layout from TOML text (tests, generated layouts)."""
    return from_dict(reader.parse(text, file), file, base_dir=Path(base_dir))


def from_dict(raw: dict, file: str, base_dir: Path) -> Layout:
    """A validated layout from its TOML dict; relative paths in it are taken from ``base_dir``."""
    layout = reader.to_layout(raw, file, base_dir)
    validate(layout)
    return layout


def spec_dict(spec: Any) -> dict[str, Any]:
    """A flat spec (``ModelSpec``, ``DataSpec``) as the TOML table it loads from: enums as their values."""
    return {f.name: getattr(getattr(spec, f.name), "value", getattr(spec, f.name)) for f in attrs.fields(type(spec))}


def model_from_dict(table: dict, file: str) -> ModelSpec:
    """A ``ModelSpec`` from a ``spec_dict`` table (a checkpoint's meta.json), type-checked like [model]."""
    return build(ModelSpec, table, "model", file)


def schema_markdown() -> str:
    """Every layout key with its default and meaning, for docs/layout.md."""
    rows = []
    for section, cls in [
        ("model", ModelSpec),
        ("train", TrainSpec),
        ("data", DataSpec),
        ("cluster", ClusterSpec),
        ("cluster.nodes[]", NodeSpec),
        ("cluster.domains[]", DomainSpec),
        ("cluster.cross_domain", CrossDomainSpec),
        ("pipelines[]", PipelineSpec),
        ("pipelines[].stages[]", StageSpec),
        ("buckets[]", BucketSpec),
    ]:
        for fl in attrs.fields(cls):
            default = "required" if fl.default is attrs.NOTHING else repr(getattr(fl.default, "value", fl.default))
            kind = reader.shape(cls, fl)[0]
            if kind in ("table", "nccl"):
                default = "{}" if kind == "nccl" else "(table)"
            rows.append(f"| `{section}.{fl.name}` | {default} | {fl.metadata['doc']} |")
    return "| key | default | meaning |\n| --- | --- | --- |\n" + "\n".join(rows) + "\n"
