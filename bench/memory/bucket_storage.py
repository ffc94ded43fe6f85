"""Per-rank peak of tensor bytes with and without hot-switching buckets, with 1 and with 3 bucket layouts.

    python -m bench.memory.bucket_storage                        # this checkout's hetero_llm
    PYTHONPATH=OTHER python bench/memory/bucket_storage.py       # the same layouts under another checkout's code

Two CPU ranks train a 4-layer, hidden-256 model on packed documents (seq_len 64) for 2 steps under
``HETERO_TENSOR_METER`` (hetero_llm/runtime/tensor_meter.py): the static home layout (TP 2), the same home with one
bucket layout (DP 2 for documents of up to 16 positions), with three (DP 2, a TP 2 of its own, PP 2) and with three
of which one is context-parallel (DP 2, cp 2, PP 2). Each rank's peak and what it held then: parameters (home's),
bucket copies (every bucket layout's shards: since one storage is shared, the largest layout's), gradients,
optimizer state, activations. A memory measurement, not a timing. Results: bench/results/bucket_storage.md.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import hetero_llm
from bench.common import benchlib
from hetero_llm.errors import LayoutError
from hetero_llm.runtime.tensor_meter import ENV

HEAD = """[model]
layers = 4
hidden = 256
heads = 4
vocab = 64
seq_len = 64

[train]
steps = 2
global_batch = 4
seed = 3

[data]
packing = "documents"
doc_len_median = 16.0

[cluster]
[[cluster.nodes]]
name = "node0"
devices = ["cpu", "cpu"]

[[pipelines]]
batch = 4
microbatches = 2
[[pipelines.stages]]
layers = 4
devices = ["node0:0", "node0:1"]
"""
DP2 = """
[[buckets]]
max_len = {max_len}
[[buckets.pipelines]]
batch = 1
microbatches = 1
[[buckets.pipelines.stages]]
layers = 4
devices = ["node0:0"]
[[buckets.pipelines]]
batch = 1
microbatches = 1
[[buckets.pipelines.stages]]
layers = 4
devices = ["node0:1"]
"""
ONE_STAGE = """
[[buckets]]
max_len = {max_len}
[[buckets.pipelines]]
batch = 2
microbatches = 1
[[buckets.pipelines.stages]]
layers = 4
devices = ["node0:0", "node0:1"]
cp = {cp}
"""
PP2 = """
[[buckets]]
max_len = {max_len}
[[buckets.pipelines]]
batch = 2
microbatches = 2
[[buckets.pipelines.stages]]
layers = 2
devices = ["node0:0"]
[[buckets.pipelines.stages]]
layers = 2
devices = ["node0:1"]
"""
HOME = "\n[[buckets]]\nmax_len = 64\n"
LAYOUTS = {
    "static (home TP 2)": HEAD,
    "1 bucket layout (DP 2) + home": HEAD + DP2.format(max_len=16) + HOME,
    "3 bucket layouts (DP 2, TP 2, PP 2) + home": HEAD
    + DP2.format(max_len=8)
    + ONE_STAGE.format(max_len=16, cp=1)
    + PP2.format(max_len=32)
    + HOME,
    "3 bucket layouts (DP 2, cp 2, PP 2) + home": HEAD
    + DP2.format(max_len=8)
    + ONE_STAGE.format(max_len=16, cp=2)
    + PP2.format(max_len=32)
    + HOME,
}


def measure(text: str, work: Path) -> list[dict] | str:
    folder = work / str(len(os.listdir(work)))
    folder.mkdir()
    layout = folder / "layout.toml"
    layout.write_text(text)
    meter = folder / "meter"
    meter.mkdir()
    try:
        benchlib.launch_layout(layout, folder / "run", env={ENV: str(meter)})
    except (RuntimeError, LayoutError) as e:  # another checkout may refuse a layout (before: no cp in buckets)
        return str(e).splitlines()[-1][:200]
    return [json.loads((meter / f"rank{r}.json").read_text()) for r in range(2)]


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    kb = lambda b: f"{b / 1024:.0f}"  # noqa: E731
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in LAYOUTS.items():
            got = measure(text, Path(tmp))
            if isinstance(got, str):
                rows.append([name, "-", f"refused: {got}", "", "", "", "", ""])
                continue
            for rank, rep in enumerate(got):
                at = rep["at_peak"]
                rows.append(
                    [
                        name,
                        str(rank),
                        kb(rep["peak_bytes"]),
                        kb(at.get("parameters", 0)),
                        kb(at.get("bucket copies", 0)),
                    ]
                    + [kb(at.get(k, 0)) for k in ("gradients", "optimizer", "activations")]
                )
    print(f"code: {hetero_llm.__file__}")
    print(
        benchlib.markdown_table(
            ["layout", "rank", "peak KiB", "parameters", "bucket copies", "gradients", "optimizer", "activations"], rows
        )
    )


if __name__ == "__main__":
    main()
