"""GPU: our stage against a plain PyTorch loop and MFU on CUDA (``python -m bench.gpu.gpu_bench``; the old
``python -m bench.gpu_bench`` still works), the cost model's prediction of those runs, the session check script.

Index of every benchmark: bench/README.md.
"""
