"""Benchmarks by area (``common``, ``pipeline``, ``launch``, ``comm``, ``planner``, ``memory``, ``context``,
``hot_switch``, ``elastic``, ``gpu``) and the emulated network testbed (``testbed``). Index: bench/README.md.

Not part of the installed library. Run the scripts from the repository root as modules,
``python -m bench.AREA.NAME [options]``; they import one another as ``from bench.common import benchlib``.
"""
