"""Document masks on the torch side: attention inside each document of a packed microbatch only.

How: per-document causal attention, documents of similar length batched together. Each document is
gathered out of its row into a batch of documents padded to a length on a ladder (8, 12, 16, 24, 32,
48, ...: powers of two and 1.5 times them), one causal ``scaled_dot_product_attention`` runs per ladder
length, and the real positions are scattered back. Padding sits at the end of a document, so under a
causal mask no real query ever sees it: the result is exact. Why this and not a block-diagonal mask
over the row: a (T, T) mask makes SDPA cost T^2 per row (and rules out the flash kernels); per-length
batches cost the sum of squared document lengths, at most 2.25x that from the ladder's rounding
(1.5^2), with at most 2 log2(T) kernel calls per layer. The gather indices are built once per
microbatch and shared by every block. Positions restart at 0 in every document, for learned
embeddings and RoPE alike.
"""

from __future__ import annotations

import attrs
import numpy as np
import torch
import torch.nn.functional as F


def ladder_length(n: int) -> int:
    """The smallest of 8, 12, 16, 24, 32, 48, ... that is >= ``n``."""
    step = 8
    while True:
        if n <= step:
            return step
        if n <= step * 3 // 2:
            return step * 3 // 2
        step *= 2


@attrs.frozen(eq=False)
class AttentionGroup:
    """Documents attended together: ``gather`` (n, P) flat row positions (padding repeats the document's
    first), ``real`` the flat indices of the n * P slots that are real positions, ``dest`` their row positions."""

    gather: torch.Tensor
    real: torch.Tensor
    dest: torch.Tensor


@attrs.frozen(eq=False)
class DocumentMask:
    """Where the documents of one packed (B, T) microbatch lie; see the module doc."""

    positions: torch.Tensor  # (B, T) int64: position inside its document (0 at padding)
    groups: tuple[AttentionGroup, ...]
    shape: tuple[int, int]  # (B, T)
    square_sum: int = 0  # sum of squared document lengths: what masked attention costs (emulated devices)

    @classmethod
    def from_spans(cls, spans: np.ndarray, positions: np.ndarray, device: torch.device | str = "cpu") -> DocumentMask:
        """From ``documents.PackedRows``' spans (row, start, length) and positions."""
        B, T = positions.shape
        by_length: dict[int, list[tuple[int, int]]] = {}
        for row, start, n in spans.tolist():
            by_length.setdefault(ladder_length(n), []).append((row * T + start, n))
        groups = []
        for padded, docs in sorted(by_length.items()):
            offsets = np.arange(padded)
            starts = np.array([s for s, _ in docs])[:, None]
            lengths = np.array([n for _, n in docs])[:, None]
            inside = offsets[None, :] < lengths  # (n, P)
            gather = np.where(inside, starts + offsets[None, :], starts)
            groups.append(
                AttentionGroup(
                    torch.as_tensor(gather, device=device),
                    torch.as_tensor(np.flatnonzero(inside), device=device),
                    torch.as_tensor(gather[inside], device=device),
                )
            )
        square_sum = int((spans[:, 2].astype(np.int64) ** 2).sum()) if len(spans) else 0
        return cls(torch.as_tensor(positions, device=device), tuple(groups), (B, T), square_sum)

    def to(self, device: torch.device) -> DocumentMask:
        groups = tuple(
            AttentionGroup(*(t.to(device, non_blocking=True) for t in (g.gather, g.real, g.dest))) for g in self.groups
        )
        return DocumentMask(self.positions.to(device, non_blocking=True), groups, self.shape, self.square_sum)

    def at_positions(self, table: torch.Tensor) -> torch.Tensor:
        """Rows of a per-position ``table`` (T, ...) for every token: (B, 1, T, ...), broadcasting over heads."""
        return table[self.positions].unsqueeze(1)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention inside each document: q (B, nh, T, hd), k and v (B, nkv, T, hd) -> (B, nh, T, hd).

        Padding positions of the rows (in no document) get zeros.
        """
        B, nh, T, hd = q.shape
        flat = [t.transpose(1, 2).reshape(B * T, t.shape[1], hd) for t in (q, k, v)]  # (B*T, heads, hd)
        outs, dests = [], []
        for g in self.groups:
            n, P = g.gather.shape
            qg, kg, vg = (t[g.gather].transpose(1, 2) for t in flat)  # (n, heads, P, hd)
            y = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, enable_gqa=kg.shape[1] != nh)
            outs.append(y.transpose(1, 2).reshape(n * P, nh, hd)[g.real])
            dests.append(g.dest)
        out = q.new_zeros(B * T, nh, hd)
        if outs:
            out = out.index_copy(0, torch.cat(dests), torch.cat(outs))
        return out.view(B, T, nh, hd).transpose(1, 2)
