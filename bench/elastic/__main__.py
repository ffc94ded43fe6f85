"""``python -m bench.elastic``: the same as ``python -m bench.elastic.elastic`` (its command line, recorded in the
results files, is that module's)."""

import runpy

runpy.run_module("bench.elastic.elastic", run_name="__main__", alter_sys=True)
