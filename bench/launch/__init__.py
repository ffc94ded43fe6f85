"""Starting a run: the wall time of a 12-rank launch, the control plane's CPU seconds from 8 to 4,096 ranks, and
the README's quickstart console output.

Index of every benchmark: bench/README.md.
"""
