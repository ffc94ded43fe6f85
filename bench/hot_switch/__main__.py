"""``python -m bench.hot_switch``: the same as ``python -m bench.hot_switch.hot_switch`` (its command line, recorded in the
results files, is that module's)."""

import runpy

runpy.run_module("bench.hot_switch.hot_switch", run_name="__main__", alter_sys=True)
