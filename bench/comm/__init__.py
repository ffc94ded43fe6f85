"""Communication: gloo's collectives on the netns testbed, shared-memory stage boundaries against gloo, NIC
domains (Holmes-style placement) on the testbed.

Index of every benchmark: bench/README.md.
"""
