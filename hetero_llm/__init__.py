"""hetero_llm: train language models across heterogeneous clusters, layout-invariantly.

The public API (docs/api.md) is ``hetero_llm.api``'s, re-exported here on first use: ``import hetero_llm`` stays
light (no torch, no layout code) and the package's low modules (``errors``, ``progress``) import nothing above them.
"""

from importlib import metadata as _metadata
from typing import Any

try:  # one place: the version pyproject.toml gives the installed package (every command's --version prints it)
    __version__ = _metadata.version("hetero_llm")
except _metadata.PackageNotFoundError:  # a source tree used without installing it
    __version__ = "0+unknown"

__all__ = [
    "Checkpoint",
    "Cluster",
    "Layout",
    "LayoutError",
    "Plan",
    "Planned",
    "Prediction",
    "Profiled",
    "RunResult",
    "compile_plan",
    "evaluate",
    "layout_hash",
    "load",
    "load_cluster",
    "load_params",
    "loads",
    "plan_cluster",
    "profile_cluster",
    "read_checkpoint",
    "run",
    "validate",
]


def __getattr__(name: str) -> Any:
    """``hetero_llm.load`` and the rest of ``__all__``: imported from ``hetero_llm.api`` when first asked for."""
    if name in __all__:
        from hetero_llm import api  # the one upward import: lazy, so the layers below never load it

        return getattr(api, name)
    raise AttributeError(f"module 'hetero_llm' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
