"""Elastic runs: a node lost and back on the netns testbed, snapshot cost per step, a restart from snapshots held
on other nodes. ``python -m bench.elastic`` runs ``bench.elastic.elastic``.

Index of every benchmark: bench/README.md.
"""
