"""Hot switching with context parallelism, one storage for every bucket layout, buckets sized by their documents:
each run trains the one-process model (float32, 1e-5 per step, parameters as ``assert_same_model`` checks them).

- ``tests/data/buckets_cp.toml``: DP 2 -> cp 2 (rows of 16, elastic, topped up) -> home TP 2 (no cp): buckets
  of different cp, a cp bucket under a home layout without cp;
- ``tests/data/buckets_cp_home.toml``: home cp 2; DP 2 -> home's cp 2 on rows of 16 (a runner of its own, no
  switch) -> TP 2: buckets without cp under a context-parallel home;
- resumes into a bucket layout (from the one-process run's checkpoint) and out of one (the one-process layout
  from the cp home's checkpoint);
- the tensor meter: a rank's bucket parameters are one storage, the largest bucket layout's shards.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import attrs
import pytest
from helpers_buckets import one_process, switches

from harness import assert_same_model, launch
from hetero_llm import layout as layout_mod
from hetero_llm.data.documents import fill_documents
from hetero_llm.data.sources import make_document_source
from hetero_llm.plan import compile_plan
from hetero_llm.switching.bucketing import bucket_rows

DATA = Path(__file__).resolve().parents[1] / "data"
CP = DATA / "buckets_cp.toml"  # DP 2 | cp 2 | home TP 2
CP_HOME = DATA / "buckets_cp_home.toml"  # DP 2 | home cp 2 (rows of 16) | TP 2; home cp 2

SAVE = ("--checkpoint-every", "2")


def resumed(first, rest):
    """A run of ``first``'s first 2 steps and ``rest``'s resumed one, as one run."""
    assert len(rest.losses) == 1
    return attrs.evolve(rest, losses=first.losses[:2] + rest.losses, grad_norms=first.grad_norms[:2] + rest.grad_norms)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ref_cp")
    assert (
        CP.read_text().split("[cluster]")[0].splitlines()[2:]
        == CP_HOME.read_text().split("[cluster]")[0].splitlines()[2:]
    )
    return launch(one_process(CP, folder), folder, *SAVE)


@pytest.mark.multiprocess
def test_a_cp_bucket_beside_dp_and_a_home_without_cp_trains_the_one_process_model(reference, tmp_path):
    lay = layout_mod.load(CP)
    source = make_document_source(lay.data, lay.model.seq_len, lay.file)
    rows = [bucket_rows(lay, fill_documents(source, lay.train.seed, s, 4, lay.model.seq_len)) for s in range(3)]
    assert max(r[1].num_rows for r in rows if r[1] is not None) > 2  # cp 2, elastic: a step of more than one round
    assert rows[0][2].num_rows == 2 < lay.train.global_batch  # home's bucket: its document's rows, not the batch's
    meter = tmp_path / "meter"
    meter.mkdir()
    run = launch(CP, tmp_path / "run", env={"HETERO_TENSOR_METER": str(meter)})
    assert_same_model(run, reference)
    # one storage for both bucket layouts: the larger layout's shards (DP 2 and cp 2 each hold the whole model
    # on each device), not one copy per layout
    plan = compile_plan(lay)
    whole = sum(math.prod(info.shape) for info, _, _ in plan.buckets[0].params_of(0)) * 4
    for rank in (0, 1):
        report = json.loads((meter / f"rank{rank}.json").read_text())
        assert report["at_peak"]["bucket copies"] == whole, report


@pytest.mark.multiprocess
def test_resuming_into_a_bucket_layout_from_the_one_process_checkpoint(reference, tmp_path):
    rest = launch(CP, tmp_path, "--resume", str(reference.workdir / "ckpt" / "step-000002"))
    assert_same_model(resumed(reference, rest), reference)


@pytest.mark.multiprocess
def test_a_context_parallel_home_with_buckets_without_cp_trains_the_one_process_model(reference, tmp_path):
    run = launch(CP_HOME, tmp_path / "run", *SAVE, "--trace", str(tmp_path / "trace"))
    assert_same_model(run, reference)
    # bucket 1 runs home's parameters (cp 2 on rows of 16) with no switch of its own
    assert set(switches(tmp_path / "trace", 0)) == {"SWITCH>b0", "SWITCH>home", "SWITCH>b2"}
    out = launch(
        one_process(CP, tmp_path / "one"), tmp_path / "one", "--resume", str(run.workdir / "ckpt" / "step-000002")
    )
    assert_same_model(resumed(run, out), reference)
