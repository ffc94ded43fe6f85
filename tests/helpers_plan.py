"""Layouts and hetero-plan runs that several test files share (not a test module: nothing here is collected).

``make`` and ``TP_MIX``: small layouts written inline and loaded without torch (tests/unit/test_plan.py,
tests/unit/test_rank_plan.py; test_plan runs them in a second interpreter too, so this module imports only the
library). ``run_plan`` and ``cluster``: ``hetero-plan`` on small_cpu.toml with packed documents
(tests/unit/test_plan_buckets.py, tests/integration/test_buckets.py).
"""

from __future__ import annotations

import inspect
from pathlib import Path

from click.testing import CliRunner

from harness import own_nodes
from hetero_llm.cli.plan import main as plan_main
from hetero_llm.layout import DataSpec, Layout, Mlp, ModelSpec, Norm, Position, Schedule, TrainSpec, dumps, loads

SMALL = Path(__file__).resolve().parents[1] / "layouts" / "clusters" / "small_cpu.toml"


def make(
    pipes, *, hidden=24, heads=6, ffn=0, norm="layernorm", mlp="gelu", position="learned", schedule="1f1b", vocab=32
):
    """A layout with one node per pipeline (``n0``, ``n1``, ...) whose devices its stages use in order.

    ``pipes``: one ``(batch, microbatches, [(layers, tp), ...])`` per pipeline.
    """
    model = ModelSpec(
        layers=sum(n for n, _ in pipes[0][2]),
        hidden=hidden,
        heads=heads,
        vocab=vocab,
        seq_len=8,
        ffn=ffn,
        norm=Norm(norm),
        mlp=Mlp(mlp),
        position=Position(position),
    )
    train = TrainSpec(steps=1, global_batch=sum(p[0] for p in pipes), schedule=Schedule(schedule))
    cluster, pipelines = own_nodes(pipes)
    made = Layout(
        file="inline.toml",
        model=model,
        train=train,
        data=DataSpec(grammar_vocab=16),
        cluster=cluster,
        pipelines=pipelines,
    )
    return loads(dumps(made), file="inline.toml")  # checked as the loader checks a file


TP_MIX = [(4, 2, [(1, 2), (1, 1)]), (2, 1, [(2, 3)])]  # ranks: p0 = 0 1 | 2 ; p1 = 3 4 5


def run_plan(*args):
    runner = (
        CliRunner(mix_stderr=False) if "mix_stderr" in inspect.signature(CliRunner.__init__).parameters else CliRunner()
    )
    return runner.invoke(plan_main, [str(a) for a in args])


def cluster(tmp_path: Path, seq_len: int = 1024, memory_gb: float = 8, packing: bool = True) -> Path:
    """small_cpu.toml with packed documents, longer rows and (optionally) little memory on the fast node."""
    text = SMALL.read_text().replace("seq_len = 16", f"seq_len = {seq_len}")
    text = text.replace("memory_gb = 8", f"memory_gb = {memory_gb}")
    if packing:
        text = text.replace('kind = "grammar"', 'kind = "grammar"\npacking = "documents"')
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return path


def flops_priced(c):
    """Cluster ``c`` as the cost model before the roofline one priced it: every kind by FLOPs at its peak, links at
    their line rate (the landscape some search-regression cases were found on). Its NCCL backend stays (gloo's
    rendezvous messages were not priced then), its domains' NCCL bus efficiency is 1 (kind 'other')."""
    import attrs

    from hetero_llm.layout import DomainKind

    nodes = tuple(
        attrs.evolve(n, kind=attrs.evolve(n.kind, pricing="flops", mem_fraction=1.0, link_fraction=1.0))
        for n in c.nodes
    )
    domains = tuple(attrs.evolve(d, kind=DomainKind.OTHER) for d in c.spec.domains)
    return attrs.evolve(c, nodes=nodes, spec=attrs.evolve(c.spec, domains=domains))
