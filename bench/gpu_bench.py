"""``python -m bench.gpu_bench``: the GPU benchmark's old module path, kept because the project's instructions name it;
the benchmark is ``bench.gpu.gpu_bench`` (same options)."""

import runpy

runpy.run_module("bench.gpu.gpu_bench", run_name="__main__", alter_sys=True)
