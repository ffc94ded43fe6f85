"""Benchmarks, their shared helpers (``benchlib``) and the emulated network testbed (``testbed``).

Not part of the installed library. Run the scripts from the repository root as modules,
``python -m bench.NAME [options]``; they import one another as ``from bench import benchlib``.
"""
