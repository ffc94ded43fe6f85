"""hetero_llm: train language models across heterogeneous clusters, layout-invariantly."""

__version__ = "0.1.0"
