"""What the package's modules promise, declared once: which import no torch, and which are the runtime side (they
run from a rank's ``RankPlan`` and never see the ``Layout``).

A package named here promises it for every module in it, the ones added later included. ``tests/unit/test_torch_free.py``
imports every torch-free module with torch hidden; ``tests/unit/test_rank_plan.py`` reads every runtime-side module for
the names and attributes that would reach the layout. Imports nothing of the package (and no torch).
"""

from __future__ import annotations

from pathlib import Path

# Every module of these packages imports no torch: the data's text and tokens, loading and validating a layout,
# schedules, compiling a plan and its dry run, simulation, planning and placement, sweeps.
TORCH_FREE_PACKAGES = ("data", "layout", "schedule", "plan", "predict", "planner", "sweep")
# The torch-free modules of the other packages (those of the top package by their own name).
TORCH_FREE_MODULES = (
    "errors",
    "_fs",
    "_properties",
    "api",
    "model.params",
    "model.cp_chunks",
    "runtime.emulation",
    "checkpoint.folders",
    "checkpoint.holders",
    "checkpoint.trust",
    "interop.hf_names",
    "interop.hf_config",
    "switching.transfers",
    "switching.bucketing",
    "switching.predict",
    "switching.worth",
    "switching.propose",
    "launch.node",
    "launch.hosts",
    "launch.external",
    "launch.restart",
    "launch.guards",
    "launch.preflight",
    "launch.outputs",
    "launch.memory",
    "cli.common",
    "cli.launch",
    "cli.plan",
    "cli.sweep",
    "cli.place",
    "cli.timeline",
    "cli.tokenize",
    "train.options",
)

# The runtime side: every module of these packages, and these modules of others, take a RankPlan (or pieces of
# one), never the Plan or the Layout.
RUNTIME_SIDE_PACKAGES = ("runtime", "train")
RUNTIME_SIDE_MODULES = (
    "comm.groups",
    "comm.collectives",
    "comm.p2p",
    "comm.heartbeat",
    "predict.trace",
    "checkpoint.shards",
)

PACKAGE = Path(__file__).resolve().parent


def _file(module: str) -> Path:
    """The source file of ``module`` (dotted, below the top package): ``a/b.py`` or ``a/b/__init__.py``."""
    path = PACKAGE.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _expand(packages: tuple[str, ...], modules: tuple[str, ...]) -> dict[str, Path]:
    """``hetero_llm.NAME`` -> its file, for ``modules`` and every module of ``packages`` in the tree (a package's
    ``__main__`` is a command, not a module)."""
    out = {f"hetero_llm.{m}": _file(m) for m in modules}
    for package in packages:
        for path in sorted((PACKAGE / package).rglob("*.py")):
            parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
            if parts[-1] != "__main__":
                out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def torch_free() -> dict[str, Path]:
    """Every module that imports no torch, with its file."""
    return _expand(TORCH_FREE_PACKAGES, TORCH_FREE_MODULES)


def runtime_side() -> dict[str, Path]:
    """Every runtime-side module, with its file."""
    return _expand(RUNTIME_SIDE_PACKAGES, RUNTIME_SIDE_MODULES)
