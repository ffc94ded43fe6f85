"""The pieces every benchmark shares: ``benchlib`` (layouts, the hetero-launch command line, launching, statistics,
the results files and their header) and ``traces`` (reading ``hetero-launch --trace`` folders).

Index of every benchmark: bench/README.md.
"""
