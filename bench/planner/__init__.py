"""hetero-plan: search quality and time against an exhaustive reference and re-implemented baselines, predicted
against measured step times, the cost model against published measurements.

Index of every benchmark: bench/README.md.
"""
