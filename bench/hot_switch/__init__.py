"""Hot switching between layouts against the best static layout (loopback or the netns testbed).
``python -m bench.hot_switch`` runs ``bench.hot_switch.hot_switch``.

Index of every benchmark: bench/README.md.
"""
