"""The command-line layer: each ``main`` parses, loads, calls one library function and prints.

Nothing in the library imports this package. ``python -m hetero_llm.cli`` runs ``hetero-launch``."""
