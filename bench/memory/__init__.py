"""Memory: ZeRO-1 per rank, the planner's memory model against measured peaks and the tensor meter, resident
memory over a long run (soak).

Index of every benchmark: bench/README.md.
"""
