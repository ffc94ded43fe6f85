"""Cluster files: a layout without ``[[pipelines]]``, the input of placement (hetero-place) and planning (hetero-plan)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hetero_llm.errors import LayoutError
from hetero_llm.layout import reader
from hetero_llm.layout.cluster_rules import validate_cluster


def read_cluster_file(
    path: str | os.PathLike, writer: str, extra: tuple[str, ...] = ()
) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """A layout file without ``[[pipelines]]`` (the input of placement and the planner, named ``writer`` in the
    message that refuses pipelines): its text, raw TOML and typed sections, checked like a layout's cluster.
    ``extra``: sections the caller reads itself (e.g. the planner's ``[plan]``)."""
    file = str(path)
    p = Path(path)
    if not p.is_file():
        raise LayoutError(file, "", "no such file (pass a TOML file with [model], [train] and [cluster])")
    try:
        text = p.read_text()
    except UnicodeDecodeError:
        raise LayoutError(file, "", "not UTF-8 text (save the file as UTF-8: TOML requires it)") from None
    raw = reader.parse(text, file)
    reader.check_keys(raw, list(reader.SECTIONS) + ["pipelines", *extra], "", file, what="section")
    if "pipelines" in raw:
        raise LayoutError(
            file,
            "pipelines",
            f"the file already has [[pipelines]] ({writer} writes them: start from a copy without them)",
        )
    for name in ("model", "train", "cluster"):
        if name not in raw:
            raise LayoutError(file, name, f"missing section (add a [{name}] section)")
    sections = {name: reader.build(cls, raw.get(name, {}), name, file) for name, cls in reader.SECTIONS.items()}
    validate_cluster(file, sections["cluster"])
    return text, raw, sections
