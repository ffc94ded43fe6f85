"""A rank's batches in one call (``train.batches.Batches``): each step's microbatches and the held-out ones, packed
or not, are the ones the loop's former packed and plain paths cut (written out here from the data layer's pieces:
the global batch, the pipeline's share, the document mask), for every rank of a two-pipeline layout."""

from __future__ import annotations

import attrs
import pytest
import torch

from harness import LAYOUTS
from hetero_llm import layout as layout_mod
from hetero_llm.data import batches, documents, held_out, sources
from hetero_llm.model.document_mask import DocumentMask
from hetero_llm.plan import compile_plan
from hetero_llm.train.batches import Batches

TWO_PIPELINES = LAYOUTS / "examples" / "two_pipelines.toml"  # 8 rows in 4 microbatches beside 4 rows in 2
HELD_OUT = ["train.eval_every=1", "train.eval_batches=2"]


def plain_microbatches(rp, batch):
    """The rank's microbatches of a window batch, as the loop cut them before (``pipeline_share``)."""
    share = rp.batch
    return [
        (torch.from_numpy(p[:, :-1]), torch.from_numpy(p[:, 1:]), None)
        for p in batches.pipeline_share(batch, share.offset, share.size, share.microbatches)
    ]


def packed_microbatches(rp, rows):
    """The rank's microbatches of packed rows, each with its document mask, as the loop cut them before."""
    share = rp.batch
    return [
        (torch.from_numpy(p.inputs), torch.from_numpy(p.targets), DocumentMask.from_spans(p.spans, p.positions))
        for p in rows.share(share.offset, share.size, share.microbatches)
    ]


def expected_step(rp, step):
    tr, seq = rp.train, rp.model.seq_len
    if rp.data.packing is layout_mod.Packing.DOCUMENTS:
        source, _ = sources.document_sources(rp.data, seq, rp.file)
        rows = documents.fill_rows(source, tr.seed, step, tr.global_batch, seq)
        return packed_microbatches(rp, rows), rows.num_targets
    source, _ = sources.train_and_held_out(rp.data, rp.file)
    return plain_microbatches(
        rp, batches.global_batch(source, tr.seed, step, tr.global_batch, seq)
    ), tr.global_batch * seq


def expected_held_out(rp):
    tr, seq = rp.train, rp.model.seq_len
    out = []
    for index in range(tr.eval_batches):
        if rp.data.packing is layout_mod.Packing.DOCUMENTS:
            _, valid = sources.document_sources(rp.data, seq, rp.file)
            rows = held_out.held_out_rows(valid, tr.seed, index, tr.global_batch, seq)
            out.append((packed_microbatches(rp, rows), rows.num_targets))
        else:
            _, valid = sources.train_and_held_out(rp.data, rp.file)
            batch = held_out.batch(valid, tr.seed, index, tr.global_batch, seq)
            out.append((plain_microbatches(rp, batch), tr.global_batch * seq))
    return out


def assert_same(mbs, expected):
    assert len(mbs) == len(expected)
    for mb, (inputs, targets, docs) in zip(mbs, expected):
        assert torch.equal(mb.inputs, inputs) and mb.inputs.stride() == inputs.stride()
        assert torch.equal(mb.targets, targets) and mb.targets.stride() == targets.stride()
        assert mb.ctx is None
        if docs is None:
            assert mb.docs is None
        else:
            assert torch.equal(mb.docs.positions, docs.positions) and mb.docs.shape == docs.shape
            assert mb.docs.square_sum == docs.square_sum
            assert len(mb.docs.groups) == len(docs.groups)
            for got, want in zip(mb.docs.groups, docs.groups):
                for a, b in zip(attrs_values(got), attrs_values(want)):
                    assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def attrs_values(group):
    return [getattr(group, f.name) for f in attrs.fields(type(group))]


@pytest.mark.parametrize("packing", ["none", "documents"])
def test_each_step_and_held_out_batch_is_the_old_paths(packing):
    plan = compile_plan(layout_mod.load(TWO_PIPELINES, [f"data.packing={packing}", *HELD_OUT]))
    shares = set()
    for r in range(plan.world_size):
        rp = plan.rank_plan(r)
        shares.add((rp.batch.offset, rp.batch.size, rp.batch.microbatches))
        got = Batches(rp)
        assert got.has_held_out
        for step in (0, 2):
            mbs, tokens = got.step(step)
            want, want_tokens = expected_step(rp, step)
            assert tokens == want_tokens
            assert_same(mbs, want)
        held = list(got.held_out())
        assert [t for _, t in held] == [t for _, t in expected_held_out(rp)]
        for (mbs, _), (want, _) in zip(held, expected_held_out(rp)):
            assert_same(mbs, want)
    assert shares == {(0, 8, 4), (8, 4, 2)}  # both pipelines' shares were cut


def test_packed_steps_count_targets_and_plain_steps_every_position():
    """What a step's mean loss divides by: the documents' targets (fewer than the rows' positions), or every
    position of the global batch."""
    packed = compile_plan(layout_mod.load(TWO_PIPELINES, ["data.packing=documents"])).rank_plan(0)
    plain = compile_plan(layout_mod.load(TWO_PIPELINES)).rank_plan(0)
    positions = plain.train.global_batch * plain.model.seq_len
    assert Batches(plain).step(1)[1] == positions
    assert 0 < Batches(packed).step(1)[1] < positions
    assert all(mb.docs is not None for mb in Batches(packed).step(1)[0])


def test_no_held_out_data_no_held_out_batches(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    lay = layout_mod.loads(
        TWO_PIPELINES.read_text()
        .replace('kind = "grammar"', f'kind = "text"\npath = "{text}"')
        .replace("vocab = 64", "vocab = 256"),
        file=str(tmp_path / "l.toml"),
        base_dir=str(tmp_path),
    )
    rp = compile_plan(lay).rank_plan(0)
    got = Batches(rp)
    assert not got.has_held_out
    mbs, tokens = got.step(0)
    assert tokens == rp.train.global_batch * rp.model.seq_len
    assert_same(mbs, expected_step(rp, 0)[0])
