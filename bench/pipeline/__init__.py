"""Pipeline schedules on CPU ranks (gloo): ours against torch.distributed.pipelining, dynamic and zero-bubble
against 1F1B, the simulator against traced runs; the paired same-process driver (``paired``, ``paired_rank``).

Index of every benchmark: bench/README.md.
"""
