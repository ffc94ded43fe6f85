"""[plan.documents]: attention priced per document (the sum of squared document lengths the runtime's document
masks compute), against the runtime's own packing of sampled documents and a Monte Carlo sample; its one-line
errors. Torch-free, one process."""

from __future__ import annotations

import math
from pathlib import Path

import attrs
import numpy as np
import pytest
from click.testing import CliRunner
from test_planner import SMALL

from hetero_llm.cli.plan import main as plan_main
from hetero_llm.data.documents import _cut, pack
from hetero_llm.errors import LayoutError
from hetero_llm.planner.candidates import TPGroup
from hetero_llm.planner.cluster import load_cluster
from hetero_llm.planner.cost import PlannerCostModel
from hetero_llm.planner.documents import Documents
from hetero_llm.predict.device import EmulatedDevice, action_seconds

LLAMA_32K = Path(__file__).resolve().parents[2] / "layouts" / "clusters" / "llama7b_32k.toml"
DOCS = '[plan.documents]\ndistribution = "lognormal"\nmedian = 6\nsigma = 1.2\n'


def cluster_file(tmp_path, documents: str = DOCS, packing: str = "documents", extra: str = ""):
    text = SMALL.read_text().replace('kind = "grammar"\n', f'kind = "grammar"\npacking = "{packing}"\n', 1)
    path = tmp_path / "cluster.toml"
    path.write_text(text + extra + documents)
    return path


def lognormal_sample(rng, median: float, sigma: float, n: int) -> np.ndarray:
    """Document lengths in tokens as the runtime's grammar source defines them: round(exp(N(ln median, sigma))),
    at least 2."""
    return np.maximum(2, np.rint(np.exp(rng.normal(math.log(median), sigma, n)))).astype(np.int64)


def packed_square_sum(lengths: np.ndarray, S: int) -> tuple[float, float]:
    """(sum of squared document lengths, positions) of the documents cut (data.documents._cut, as a file's are)
    and packed (data.documents.pack) into rows of S: what model/document_mask.DocumentMask.square_sum sums."""
    _, pieces = _cut(np.zeros(len(lengths), dtype=np.int64), lengths, S + 1)
    docs = [np.zeros(int(n), dtype=np.int64) for n in pieces]
    rows = pack(docs, S)
    spans = rows.spans[:, 2].astype(np.float64)
    return float((spans**2).sum()), float(spans.sum())


@pytest.mark.parametrize("median,sigma,S", [(40.0, 1.0, 256), (64.0, 0.0, 128)])
def test_expected_square_sum_matches_packed_documents(median, sigma, S):
    """A full row's expected square sum, ``S x E[l^2] / E[l]``, against the runtime's packer over 2000 sampled
    documents (cut at S + 1 tokens): the square sum per position within 3%."""
    rng = np.random.default_rng(5)
    squares, positions = packed_square_sum(lognormal_sample(rng, median, sigma, 2000), S)
    want = S * squares / positions
    got = Documents("lognormal", median=median, sigma=sigma).square_sum(S)
    assert got == pytest.approx(want, rel=0.03)
    assert got < S * S


@pytest.mark.parametrize("median,sigma,S", [(2048.0, 1.6, 32768), (300.0, 1.4, 512), (8.0, 2.5, 64)])
def test_expected_square_sum_matches_a_monte_carlo_sample(median, sigma, S):
    """With a tail past the row (lengths cut into pieces of S + 1 tokens): against 10^6 sampled lengths, pieces
    counted by hand, within 1%."""
    n = lognormal_sample(np.random.default_rng(7), median, sigma, 1_000_000).astype(np.float64)
    full, rest = np.floor(n / (S + 1)), np.mod(n, S + 1)
    tail = np.where(rest >= 2, rest - 1, 0)
    want = S * (full * S * S + tail**2).sum() / (full * S + tail).sum()
    assert Documents("lognormal", median=median, sigma=sigma).square_sum(S) == pytest.approx(want, rel=0.01)


def test_one_document_per_row_is_todays_pricing(tmp_path):
    """No [plan.documents] (or distribution = "row"): S^2 per row, the plan priced as before."""
    plain = PlannerCostModel(load_cluster(SMALL))
    row = PlannerCostModel(load_cluster(cluster_file(tmp_path, '[plan.documents]\ndistribution = "row"\n')))
    assert plain.square == row.square == 16 * 16
    assert plain.layer_forward_flops() == row.layer_forward_flops()


def test_per_document_flops_equal_the_emulated_devices_sum_over_documents(tmp_path):
    """A FLOP-priced kind's layer forward with the histogram's documents: the emulated runtime's charge
    (predict/device.action_seconds) for rows of those documents, whose square sum is counted by hand."""
    hist = tmp_path / "lengths.txt"
    hist.write_text("# length count\n5 3\n9\n17 2  # a whole row (16 positions)\n")
    c = load_cluster(cluster_file(tmp_path, '[plan.documents]\ndistribution = "lengths"\nfile = "lengths.txt"\n'))
    cost = PlannerCostModel(c)
    S = c.model.seq_len
    positions = 3 * 4 + 8 + 2 * 16
    squares = 3 * 4**2 + 8**2 + 2 * 16**2
    assert cost.square == pytest.approx(S * squares / positions)
    # rows of those documents: positions / S rows of them hold ``squares``
    device = EmulatedDevice(flops=1e9)
    rows = positions / S
    charged = action_seconds(c.model, "F", 1, 1, positions, squares, 1, False, device)
    assert rows * cost.layer_forward_flops() / 1e9 == pytest.approx(charged)
    # the cost model's stage forward on a FLOP-priced kind (the small cluster's cpu nodes): the same arithmetic
    node = c.node("slow0")
    g = TPGroup(node.name, node.domain, ("slow0:0",), node.kind)
    f, _, _, _ = cost.stage_times(g, 1, False, 2, False)
    assert f == pytest.approx(2 * cost.layer_forward_flops() / (g.kind.tflops * 1e12))


def test_per_document_pricing_lowers_attention_on_a_roofline_kind():
    """Llama-7B at 32K on A100s: the per-document layer is cheaper than the per-row one by what its attention
    saves, the matmuls unchanged."""
    c = load_cluster(LLAMA_32K)
    doc, row = PlannerCostModel(c), PlannerCostModel(attrs.evolve(c, documents=Documents()))
    k = c.nodes[0].kind
    fa_doc, ba_doc = doc.roofline.attention(k, 1, 8)
    fa_row, ba_row = row.roofline.attention(k, 1, 8)
    assert fa_doc / fa_row == pytest.approx(doc.square / row.square, rel=1e-6)
    f_doc, b_doc, _ = doc.roofline.layer(k, 1, 8)
    f_row, b_row, _ = row.roofline.layer(k, 1, 8)
    assert f_row - f_doc == pytest.approx(fa_row - fa_doc, rel=1e-6)
    assert b_row - b_doc == pytest.approx(ba_row - ba_doc, rel=1e-6)


BAD = [
    ('[plan.documents]\ndistribution = "zipf"\n', "plan.documents.distribution", "unknown distribution 'zipf'"),
    ('[plan.documents]\ndistribution = "lognormal"\nmedian = 1\nsigma = 1\n', "plan.documents.median", ">= 2"),
    ('[plan.documents]\ndistribution = "lognormal"\nmedian = 8\nsigma = -1\n', "plan.documents.sigma", ">= 0"),
    ('[plan.documents]\ndistribution = "row"\nmedian = 8\n', "plan.documents.median", "is not read by"),
    ('[plan.documents]\ndistribution = "lengths"\n', "plan.documents.file", "needs a histogram file"),
    ('[plan.documents]\ndistribution = "lengths"\nfile = "none.txt"\n', "plan.documents.file", "cannot read"),
    ("[plan.documents]\nmedain = 8\n", "plan.documents", "unknown key 'medain'"),
]


@pytest.mark.parametrize("documents,where,what", BAD)
def test_bad_corpus_declarations_are_one_line_errors(tmp_path, documents, where, what):
    with pytest.raises(LayoutError) as e:
        load_cluster(cluster_file(tmp_path, documents))
    msg = str(e.value)
    assert where in msg and what in msg and "\n" not in msg


@pytest.mark.parametrize(
    "text,what",
    [
        ("5 3 1\n", "line 1: expected 'LENGTH' or 'LENGTH COUNT', got '5 3 1'"),
        ("5\nten\n", "line 2: expected 'LENGTH' or 'LENGTH COUNT', got 'ten'"),
        ("1 4\n", "line 1: a length of at least 2 tokens and a count >= 0, got '1 4'"),
        ("# nothing\n", "holds no document"),
    ],
)
def test_bad_histogram_files_name_the_line(tmp_path, text, what):
    (tmp_path / "h.txt").write_text(text)
    with pytest.raises(LayoutError) as e:
        load_cluster(cluster_file(tmp_path, '[plan.documents]\ndistribution = "lengths"\nfile = "h.txt"\n'))
    assert what in str(e.value) and "plan.documents.file" in str(e.value)


def test_per_document_pricing_needs_document_packing(tmp_path):
    """Through the CLI: one line, exit code 2."""
    path = cluster_file(tmp_path, packing="none")
    res = CliRunner().invoke(plan_main, [str(path), "--json"])
    assert res.exit_code == 2
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert len(lines) == 1
    assert lines[0] == (
        f"error: {path}: plan.documents.distribution: 'lognormal' prices attention per document, but data.packing "
        "is 'none': the runtime attends across the whole row (set data.packing = 'documents', or remove "
        "[plan.documents])"
    )


class LognormalSource:
    """A document source (data.documents.DocumentSource) of lognormal lengths cut at rows (data.documents._cut)."""

    def __init__(self, median: float, sigma: float, S: int):
        self.median, self.sigma, self.S = median, sigma, S

    def candidates(self, rng, n):  # the documents cut into pieces of at most S + 1 tokens, as a file's are
        _, pieces = _cut(np.zeros(n, dtype=np.int64), lognormal_sample(rng, self.median, self.sigma, n), self.S + 1)
        return np.arange(len(pieces), dtype=np.int64), pieces

    def documents(self, rng, ids, lengths):
        return [np.zeros(int(n), dtype=np.int64) for n in lengths]


def runtime_rank_pairs(median: float, sigma: float, S: int, cp: int, batch: int, steps: int) -> np.ndarray:
    """(steps x batch, cp): per row of ``steps`` steps filled as training fills them (data.documents._fill, then
    pack_placed), the visible query/key pairs of each CP rank's positions (model/cp_chunks.local_positions): a query
    sees its document's keys up to itself; ring attention computes a rank's own queries (model/context.py's pacing
    counts the same pairs)."""
    from hetero_llm.data.documents import _fill, pack_placed
    from hetero_llm.model.cp_chunks import local_positions

    out = []
    for step in range(steps):
        docs, placed = _fill(LognormalSource(median, sigma, S), np.random.default_rng([7, step]), batch, S)
        rows = pack_placed(docs, placed, batch, S)
        seen = np.zeros((batch, S))
        for row, start, n in rows.spans:
            seen[row, start : start + n] = np.arange(1, n + 1)
        out.append(np.stack([seen[:, local_positions(S, cp, r)].sum(1) for r in range(cp)], axis=1))
    return np.concatenate(out)


def test_cp_rank_pairs_by_hand():
    """Rows of 8 at cp 2 (rank 0 holds positions 0, 1, 6, 7; rank 1 2-5): one causal document is balanced; two
    of 6 and 2 leave rank 0 with 1 + 2 + 1 + 2 pairs and rank 1 with 3 + 4 + 5 + 6."""
    from hetero_llm.planner.documents import rank_pairs, zigzag_owner

    assert list(zigzag_owner(8, 2)) == [0, 0, 1, 1, 1, 1, 0, 0]
    assert list(rank_pairs(np.array([0]), 8, 2)) == [18, 18]
    assert list(rank_pairs(np.array([0, 6]), 8, 2)) == [6, 18]
    assert list(rank_pairs(np.array([0]), 16, 4)) == [34] * 4  # zigzag: every rank the same share of a causal row


@pytest.mark.parametrize("median,sigma,S,cp", [(48.0, 1.2, 512, 2), (20.0, 1.0, 256, 4)])
def test_cp_imbalance_matches_the_runtimes_packed_rows(median, sigma, S, cp):
    """The slowest CP rank's attention over the mean rank's (one and two rows per microbatch, steps of 8 rows),
    against training's own fill and the runtime's CP chunks over 150 steps: within 5%; more than 1 (a packed row's
    documents fall unevenly on the chunks); 1 with one document per row or without CP."""
    pairs = runtime_rank_pairs(median, sigma, S, cp, 8, 150)
    want = pairs.max(1).sum() / pairs.mean(1).sum()
    docs = Documents("lognormal", median=median, sigma=sigma)
    got = docs.cp_imbalance(S, cp, 1, 8)
    assert want > 1.05 and got == pytest.approx(want, rel=0.05)
    two = pairs.reshape(-1, 2, cp).sum(1)  # microbatches of 2 rows
    assert docs.cp_imbalance(S, cp, 2, 8) == pytest.approx(two.max(1).sum() / two.mean(1).sum(), rel=0.05)
    assert Documents().cp_imbalance(S, cp, 1, 8) == 1.0 and docs.cp_imbalance(S, 1, 1, 8) == 1.0


def test_cp_stage_pays_the_slowest_ranks_attention(tmp_path, monkeypatch):
    """A FLOP-priced CP 2 stage over packed documents: its forward is the balanced one plus (imbalance - 1) x the
    attention of its rows on the group, its backward twice that (three times recomputing)."""
    c = load_cluster(cluster_file(tmp_path))
    cost = PlannerCostModel(c)
    nd = c.spec.nodes[0]
    node = c.node(nd.name)
    g = TPGroup(node.name, node.domain, tuple(f"{node.name}:{i}" for i in range(2)), node.kind, 2)
    assert g.kind.pricing != "roofline"  # the FLOP model (the roofline charges the same share of its attention)
    rows, layers = 2, 2
    base = {r: PlannerCostModel(c) for r in (False, True)}
    for recompute in (False, True):
        monkeypatch.setattr(Documents, "cp_imbalance", lambda self, S, cp, rows, batch: 1.0)
        f0, b0, _, _ = base[recompute].stage_times(g, layers, False, rows, recompute)
        monkeypatch.undo()
        f, b, _, _ = cost.stage_times(g, layers, False, rows, recompute)
        extra = (cost.cp_imbalance(2, rows) - 1) * rows * layers * 2 * cost.square * cost.H / g.flops
        assert extra > 0
        assert f == pytest.approx(f0 + extra) and b == pytest.approx(b0 + (3 if recompute else 2) * extra)
