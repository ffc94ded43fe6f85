"""hetero_llm: train language models across heterogeneous clusters, layout-invariantly."""

from importlib import metadata as _metadata

try:  # one place: the version pyproject.toml gives the installed package (every command's --version prints it)
    __version__ = _metadata.version("hetero_llm")
except _metadata.PackageNotFoundError:  # a source tree used without installing it
    __version__ = "0+unknown"
