"""Peer replicas of an elastic run's snapshots: each rank's snapshot is also held in the memory of another node.

A snapshot (``checkpoint.snapshots``) lives in the snapshot folder of the node that wrote it; losing that node
would lose the blocks only its ranks held. So every rank also sends the bytes of its snapshot (the ``rankR.pt``
and its signed ``rankR.json`` record, unchanged) to its *keeper*, a rank of the next node in a ring over the
nodes that run ranks (``keepers``), which writes them into its own node's snapshot folder at the same place
(``ROUND/step-NNNNNN/rankR``): what a restart reads there (``checkpoint.holders``) cannot tell a replica from the
original, and the record's MAC vouches for both. Losing any one node then leaves every block with a holder: the
lost node's ranks' files are on the next node (``covered_without``). The exchange runs in the snapshot's
background thread over a gloo group of its own (made once, collectively, at the first snapshot), after the
rank's own file is written; a received file is written only once its size and sha256 are its record's and the
record is vouched for by the run's key (``trust.vouched``, what ``holders.held`` checks again at a restart).

The pairing is torch-free; the exchange imports torch when it runs.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence

from hetero_llm.checkpoint import trust


def node_of(device_id: str) -> str:
    """The node of a device id (``node:local``)."""
    return device_id.rsplit(":", 1)[0]


def keepers(peers: Sequence[str]) -> dict[int, int]:
    """Rank -> the rank that keeps a replica of its snapshots, for a plan whose rank ``r`` runs on device
    ``peers[r]``: the nodes in the order of their first rank, in a ring; the ``j``-th rank of a node is kept by
    the ``j``-th rank (modulo its count) of the next node. Empty when the ranks run on one node (no other node's
    memory to hold a replica)."""
    by_node: dict[str, list[int]] = {}
    for rank, device in enumerate(peers):
        by_node.setdefault(node_of(device), []).append(rank)
    nodes = list(by_node)
    if len(nodes) < 2:
        return {}
    kept = {}
    for i, node in enumerate(nodes):
        nxt = by_node[nodes[(i + 1) % len(nodes)]]
        for j, rank in enumerate(by_node[node]):
            kept[rank] = nxt[j % len(nxt)]
    return kept


def sources(kept: Mapping[int, int], rank: int) -> list[int]:
    """The ranks whose replicas ``rank`` keeps, in rank order."""
    return sorted(r for r, k in kept.items() if k == rank)


def covered_without(peers: Sequence[str], kept: Mapping[int, int], lost: str) -> bool:
    """Whether every rank's snapshot still has a holder once node ``lost`` is gone (its own node, or its keeper's)."""
    return all(node_of(peers[r]) != lost or node_of(peers[kept[r]]) != lost for r in range(len(peers)) if r in kept)


def check_received(key: bytes, where: str, pt: bytes, record_text: bytes) -> dict:
    """The record of a replica received for place ``where`` (``ROUND/step-NNNNNN/rankR``), checked: vouched for by
    the run's key, and ``pt`` of the size and sha256 it states. Raises ``ValueError`` saying which check failed."""
    record = json.loads(record_text)
    if not isinstance(record, dict) or not trust.vouched(key, record, where):
        raise ValueError(f"the replica's record for {where} is not vouched for by this run's key")
    if len(pt) != record.get("bytes") or hashlib.sha256(pt).hexdigest() != record.get("sha256"):
        raise ValueError(f"the replica for {where} is not the file its record describes (size or sha256)")
    return record


def exchange(group, keeper: int | None, from_ranks: Sequence[int], pt: bytes, record: bytes) -> dict[int, tuple]:
    """Send this rank's snapshot (``pt`` and its ``record``) to ``keeper`` and receive the snapshots of
    ``from_ranks`` (ranks of the plan, in ``group``, which holds every rank), all at once: sizes first, then bytes.
    Returns source rank -> (pt bytes, record bytes)."""
    import torch
    import torch.distributed as dist

    sizes = {s: torch.zeros(2, dtype=torch.int64) for s in from_ranks}
    mine = torch.tensor([len(pt), len(record)], dtype=torch.int64)
    _all([dist.isend(mine, keeper, group=group)] if keeper is not None else [], sizes, group)
    data = {s: torch.empty(int(sizes[s].sum()), dtype=torch.uint8) for s in from_ranks}
    out = []
    if keeper is not None:
        out.append(dist.isend(torch.frombuffer(bytearray(pt + record), dtype=torch.uint8), keeper, group=group))
    _all(out, data, group)
    got = {}
    for s in from_ranks:
        blob, n = data[s].numpy().tobytes(), int(sizes[s][0])
        got[s] = (blob[:n], blob[n:])
    return got


def _all(sends: list, receives: Mapping[int, object], group) -> None:
    """Post every receive beside ``sends``, then wait for all of them (no pair waits on another: no deadlock)."""
    import torch.distributed as dist

    requests = sends + [dist.irecv(t, s, group=group) for s, t in receives.items()]  # type: ignore[arg-type]
    for request in requests:
        request.wait()
