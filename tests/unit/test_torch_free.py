"""The torch-free core (layout, plan, schedules, simulator, placement, dry runs) works without torch.

Python is started with ``sys.modules["torch"] = None``, which makes every ``import torch`` fail as
if torch were not installed; it then imports the torch-free modules and runs their test files.
"""

from __future__ import annotations

from helpers_torch_free import run_without_torch

from hetero_llm import _properties

TORCH_FREE_MODULES = sorted(_properties.torch_free())  # declared once, in hetero_llm/_properties.py


def test_blocking_works():
    """The harness really hides torch (else the other tests here prove nothing)."""
    proc = run_without_torch("import torch")
    assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr


def test_the_declared_modules_exist():
    """Every package and module hetero_llm/_properties.py names is in the tree (a misspelt one would promise
    nothing)."""
    packages = _properties.TORCH_FREE_PACKAGES + _properties.RUNTIME_SIDE_PACKAGES
    assert [p for p in packages if not (_properties.PACKAGE / p / "__init__.py").is_file()] == []
    declared = _properties.torch_free() | _properties.runtime_side()
    assert [name for name, path in declared.items() if not path.is_file()] == []
    assert {"hetero_llm.planner.moves", "hetero_llm.layout.writer", "hetero_llm.cli.plan"} <= set(TORCH_FREE_MODULES)


def test_core_modules_import_without_torch():
    """Every module of a torch-free package (the tree's, new ones included) and every torch-free module named."""
    imports = "; ".join(f"import {m}" for m in TORCH_FREE_MODULES)
    proc = run_without_torch(imports)
    assert proc.returncode == 0, proc.stderr
