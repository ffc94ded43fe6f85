"""The pieces of a plan that follow from the layout's stages: each stage's layer ranges per model chunk, the
stage boundaries and the routes of their pieces, the gradient-sync blocks (finest common blocks) and the
transport of every group. Pure data, no torch; ``compile_plan`` puts them together.
"""

from __future__ import annotations

from collections import defaultdict

from hetero_llm.layout import CROSS_DOMAIN, DEFAULT_TRANSPORT, P2P, SHM, Backend, Layout
from hetero_llm.model import cp_chunks
from hetero_llm.model.params import ParamInfo, shard_range
from hetero_llm.plan.rank import RankInfo, Route, StagePlan, SyncBlocks


def transport_of(layout: Layout, nodes: list[str]) -> str:
    """A group's transport: its members' domain if they share one, else the cross-domain network (Holmes)."""
    cluster = layout.cluster
    if not cluster.domains:
        return DEFAULT_TRANSPORT
    domains = {cluster.domain_of(n) for n in nodes}
    return domains.pop() if len(domains) == 1 else CROSS_DOMAIN


def p2p_transport(layout: Layout, members: list[RankInfo]) -> str:
    """A stage boundary's transport: SHM when its ranks share one node whose ``p2p`` allows it ('shm'; 'auto'
    when they are all CPU ranks), else the network transport of their nodes (``transport_of``)."""
    nodes = {r.node for r in members}
    if len(nodes) == 1 and layout.cluster.backend is Backend.GLOO:
        p2p = layout.cluster.node(nodes.pop()).p2p
        if p2p is P2P.SHM or (p2p is P2P.AUTO and all(r.device == "cpu" for r in members)):
            return SHM
    return transport_of(layout, [r.node for r in members])


def chunk_ranges(stage_layers: list[int], chunks: int) -> list[tuple[tuple[int, int], ...]]:
    """Layer ranges per (stage, chunk): virtual stage v = chunk * stages + stage takes the next
    layers_s / chunks layers, so chunk c of every stage comes before chunk c + 1 of any stage."""
    out: list[list[tuple[int, int]]] = [[] for _ in stage_layers]
    lo = 0
    for _c in range(chunks):
        for s, layers in enumerate(stage_layers):
            if layers % chunks:  # the validator refuses this; a silent floor would drop layers from the model
                raise ValueError(f"stage {s}: {layers} layers do not split into {chunks} chunks")
            width = layers // chunks
            out[s].append((lo, lo + width))
            lo += width
    return [tuple(r) for r in out]


def boundary_pairs(stages: list[StagePlan], wrap: bool) -> list[tuple[StagePlan, StagePlan]]:
    """(sender, receiver) of activations: consecutive stages of each pipeline, plus last -> first when
    model chunks wrap around (interleaved schedules)."""
    pairs = [(a, b) for a, b in zip(stages, stages[1:]) if a.pipeline == b.pipeline]
    if wrap:
        pairs += [(s, next(f for f in stages if f.pipeline == s.pipeline and f.first)) for s in stages if s.last]
    return pairs


def boundary_routes(pairs: list[tuple[StagePlan, StagePlan]], seq_len: int) -> tuple[list[Route], list[Route]]:
    """Each boundary between the TP groups of the same context-parallel rank (the same chunks of every sequence):
    one piece per receiver, senders taken in turn; between stages of different cp, ``rechunk``'s runs."""
    fwd: list[Route] = []
    bwd: list[Route] = []
    for a, b in pairs:
        if a.cp != b.cp:
            fwd += rechunk(a, b, seq_len)
            bwd += rechunk(b, a, seq_len)
            continue
        for c in range(a.cp):
            senders, receivers = a.tp_ranks(c), b.tp_ranks(c)
            fwd += [Route(senders[j % len(senders)], receivers[j], j, len(receivers)) for j in range(len(receivers))]
            bwd += [Route(receivers[i % len(receivers)], senders[i], i, len(senders)) for i in range(len(senders))]
    return fwd, bwd


def rechunk(a: StagePlan, b: StagePlan, seq_len: int) -> list[Route]:
    """Routes from stage ``a`` to stage ``b`` of another cp: every rank of ``b`` receives exactly the positions it
    holds, from each CP rank of ``a`` holding some of them (its TP rank of the same index modulo ``a``'s TP size,
    so the TP ranks of ``a`` share the sending), as runs of consecutive positions."""
    out = []
    for i, dst in enumerate(b.ranks):
        c_b, t_b = divmod(i, b.tp)
        want = cp_chunks.local_positions(seq_len, b.cp, c_b)
        for c_a in range(a.cp):
            have = cp_chunks.local_positions(seq_len, a.cp, c_a)
            src_of = {int(p): j for j, p in enumerate(have)}
            pairs = [(src_of[int(p)], k) for k, p in enumerate(want) if int(p) in src_of]
            if pairs:
                out.append(Route(a.tp_ranks(c_a)[t_b % a.tp], dst, 0, 1, _runs(pairs)))
    return out


def _runs(pairs: list[tuple[int, int]]) -> tuple[tuple[int, int, int], ...]:
    """(src, dst) index pairs, in dst order, as runs (src, dst, length) of pairs both consecutive."""
    runs: list[list[int]] = []
    for src, dst in pairs:
        if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
            runs[-1][2] += 1
        else:
            runs.append([src, dst, 1])
    return tuple((s, d, n) for s, d, n in runs)


def sync_blocks(layout: Layout, stages: list[StagePlan]) -> list[SyncBlocks]:
    # holders[name] = [(rank, lo, hi)], for every parameter shard of every rank
    holders: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
    infos: dict[str, ParamInfo] = {}
    stage_of: dict[int, tuple[str, int]] = {}  # rank -> (stage, context-parallel index): its TP group
    for st in stages:
        for info in st.params(layout.model):
            infos[info.name] = info
            for i, rank in enumerate(st.ranks):
                holders[info.name].append((rank, *shard_range(info, st.tp, i % st.tp)))
                stage_of[rank] = (st.label, i // st.tp)
    by_group: dict[tuple[int, ...], list[tuple[str, int, int, int]]] = defaultdict(list)
    for name, held in holders.items():
        dim = infos[name].shard_dim or 0
        cuts = sorted({x for _, lo, hi in held for x in (lo, hi)})
        for lo, hi in zip(cuts, cuts[1:]):
            group = tuple(sorted(r for r, a, b in held if a <= lo and hi <= b))
            # Holders inside one TP group already have identical gradients (replicated tensors see
            # replicated activations and all-reduced input gradients): nothing to sum. The TP groups of a
            # stage's context-parallel ranks hold the same blocks with the gradients of their own tokens: summed.
            if len({stage_of[r] for r in group}) > 1:
                by_group[group].append((name, dim, lo, hi))
    return [SyncBlocks(g, tuple(e)) for g, e in sorted(by_group.items())]
