"""Long sequences and context parallelism: activation memory and tokens/s against cp, the planner's attention
pricing per document.

Index of every benchmark: bench/README.md.
"""
