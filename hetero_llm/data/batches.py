"""Training data: token sources and the layout-invariant global batch.

``make_source`` builds the source a layout's ``[data]`` names; every kind has the same small interface
(``vocab_size``, ``sample(rng, n, length)``):

- ``GrammarSource`` is an embedded dataset that needs no download: a seeded *stochastic grammar*, an
  order-2 Markov chain over ``grammar_vocab`` tokens. Each context (a, b) allows ``branching``
  successors with random (Dirichlet) probabilities, and a small uniform component (``UNIFORM_MIX``)
  lets every token follow every context, so the chain is irreducible and aperiodic: every token
  appears and the stationary distribution is unique. Because the generating distribution is known
  exactly, so is the best loss any model can reach (``loss_floor``): the first target is predicted
  from one token, H(X1 | X0) under stationarity, and every later target from the two before it, the
  entropy rate. A training run that approaches the floor has learned the task; one that stalls far
  above it has a bug, whatever the layout.
- ``TokenFileSource`` (``text_cache``) is bring-your-own text (``.txt`` or ``.jsonl``), tokenized once at
  the byte level into a memory-mapped cache beside the source (or in a user cache folder); with a
  ``tokenizer.json``, and for pre-tokenized ``.bin`` / ``.npy`` files, the same source is over a token file
  (``token_files``).

``global_batch`` makes the tokens of one step a pure function of (seed, step), identical on every
process, and ``pipeline_share`` cuts out one pipeline's rows and its microbatches (``Windows``: the same
cut as packed documents', ``documents.PackedRows``). This is what keeps the data side of training
layout-invariant (see docs/design.md). Which source a run's ``[data]`` gives is ``sources.py``.

Imports numpy and the standard library only, so data can be inspected and tested without torch.
"""

from __future__ import annotations

import functools
from typing import Protocol

import attrs
import numpy as np

# Weight of the uniform component of every grammar transition. It is what makes the chain
# irreducible (every pair state reaches every other in two steps) without blurring the grammar
# much: it adds about 0.1 nats to the floor at the defaults.
UNIFORM_MIX = 0.01
# Concentration of the Dirichlet draw over a context's successors: 1.0 is uniform on the simplex,
# so some contexts are nearly deterministic and others nearly flat.
DIRICHLET_ALPHA = 1.0

# Mixed into the data RNG seed so the data stream never coincides with another stream keyed by
# the same training seed (parameter initialization, dropout).
_DATA_STREAM = 0xDA7A


class TokenSource(Protocol):
    """What ``global_batch`` needs from a source."""

    @property
    def vocab_size(self) -> int: ...

    def sample(self, rng: np.random.Generator, n: int, length: int) -> np.ndarray: ...


# --------------------------------------------------------------------------------------------------
# Embedded stochastic grammar
# --------------------------------------------------------------------------------------------------


class GrammarSource:
    """Seeded order-2 Markov chain over ``vocab`` tokens with an exactly known loss floor.

    P(c | a, b) = UNIFORM_MIX / vocab + (1 - UNIFORM_MIX) * q[a, b, k]  if c == successors[a, b, k]
                = UNIFORM_MIX / vocab                                    otherwise,
    with ``branching`` distinct successors per context and q[a, b] ~ Dirichlet(DIRICHLET_ALPHA).
    """

    def __init__(self, vocab: int, branching: int, seed: int):
        if vocab < 2:
            raise ValueError(f"grammar vocab must be at least 2, got {vocab}")
        if not 1 <= branching <= vocab:
            raise ValueError(f"grammar branching must be in [1, vocab={vocab}], got {branching}")
        self._vocab = vocab
        self.branching = branching
        self.seed = seed
        rng = np.random.default_rng(seed)
        # (V, V, K): the successors of context (a, b) and their share of the non-uniform mass.
        self.successors = _distinct_successors(rng, vocab, branching)
        self.successor_probs = rng.dirichlet(np.full(branching, DIRICHLET_ALPHA), size=(vocab, vocab))
        # Sampling draws the uniform component and the successor separately (an exact mixture), so
        # it only looks at the K successors of a context, never at all V tokens. The choice among
        # them is the number of cumulative probabilities a uniform draw passes; the last (= 1) is
        # never passed, so only the first K - 1 are kept, one contiguous column each for fast takes.
        cdf = np.cumsum(self.successor_probs, axis=-1).reshape(vocab * vocab, branching)
        self._cdf_columns = [np.ascontiguousarray(cdf[:, k]) for k in range(branching - 1)]
        self._successors_flat = self.successors.ravel()

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def transition_matrix(self) -> np.ndarray:
        """Dense P(c | a, b) as a (V, V, V) array: for tests and plots, sized V**3."""
        vocab = self._vocab
        probs = np.full((vocab, vocab, vocab), UNIFORM_MIX / vocab)
        a, b, _ = np.indices(self.successors.shape)
        np.add.at(probs, (a, b, self.successors), (1.0 - UNIFORM_MIX) * self.successor_probs)
        return probs

    @functools.cached_property
    def stationary_pairs(self) -> np.ndarray:
        """Stationary distribution of the pair chain (a, b) -> (b, c), shape (V, V), summing to 1."""
        vocab = self._vocab
        # Sparse view of the transitions: the successor mass of (a, b) lands on pair state (b, c).
        mass = (1.0 - UNIFORM_MIX) * self.successor_probs  # (V, V, K)
        middle = np.arange(vocab)[None, :, None]
        target_state = (middle * vocab + self.successors).ravel()
        pairs = np.full((vocab, vocab), 1.0 / vocab**2)
        for _ in range(100_000):
            # float64 (weighted counts), not the stubs' intp of an unweighted bincount
            updated: np.ndarray = np.bincount(target_state, (pairs[:, :, None] * mass).ravel(), vocab * vocab)
            updated = updated.reshape(vocab, vocab)
            # Uniform component: state (b, c) receives UNIFORM_MIX / V of all mass currently at (., b).
            updated += (UNIFORM_MIX / vocab) * pairs.sum(axis=0)[:, None]
            updated /= updated.sum()  # keeps rounding from drifting over many iterations
            change = np.abs(updated - pairs).sum()
            pairs = updated
            if change < 1e-14:
                return pairs
        raise RuntimeError(f"grammar stationary distribution did not converge (last L1 change {change:.3g})")

    def context_entropies(self) -> np.ndarray:
        """H(X_t | X_{t-2} = a, X_{t-1} = b) in nats, shape (V, V), without forming the V**3 table."""
        vocab = self._vocab
        floor = UNIFORM_MIX / vocab
        # Successors are distinct, so each gets floor + its share; the other V - K tokens get floor.
        successor_p = floor + (1.0 - UNIFORM_MIX) * self.successor_probs
        others = (vocab - self.branching) * floor * np.log(floor)
        return -(others + (successor_p * np.log(successor_p)).sum(axis=-1))

    def entropy_rate(self) -> float:
        """H(X_t | X_{t-1}, X_{t-2}) under stationarity, in nats per token."""
        return float((self.stationary_pairs * self.context_entropies()).sum())

    def first_target_entropy(self) -> float:
        """H(X1 | X0) under stationarity: the floor of the one target predicted from one token."""
        pairs = self.stationary_pairs
        return _entropy(pairs.ravel()) - _entropy(pairs.sum(axis=1))

    def loss_floor(self, seq_len: int) -> float:
        """Minimum expected mean cross-entropy (nats/token) over the ``seq_len`` targets of a window.

        A window has seq_len + 1 tokens; inputs are tokens[:-1], targets tokens[1:]. Target 1 sees
        only token 0; targets 2.. see at least two tokens, which is all an order-2 chain uses.
        """
        if seq_len < 1:
            raise ValueError(f"seq_len must be at least 1, got {seq_len}")
        return (self.first_target_entropy() + (seq_len - 1) * self.entropy_rate()) / seq_len

    def sample(self, rng: np.random.Generator, n: int, length: int) -> np.ndarray:
        """``n`` sequences of ``length`` tokens, int64 (n, length), starting in stationarity."""
        vocab = self._vocab
        # Position-major, so each step writes one contiguous row.
        tokens = np.empty((length, n), dtype=np.int64)
        if length >= 1:
            start = rng.choice(vocab * vocab, size=n, p=self.stationary_pairs.ravel())
            tokens[0] = start // vocab
        if length >= 2:
            tokens[1] = start % vocab
        # All randomness drawn up front so the per-position loop is a few 1-D takes (~10 ms for
        # 256 x 513 tokens); this loop is the cost of every grammar batch.
        steps = max(length - 2, 0)
        use_uniform = rng.random((steps, n)) < UNIFORM_MIX
        uniform_token = rng.integers(0, vocab, size=(steps, n))
        pick = rng.random((steps, n))
        context = tokens[0] * vocab + tokens[1] if length >= 2 else None
        for t in range(2, length):
            assert context is not None  # set above: length >= 2 here
            slot = context * self.branching
            for column in self._cdf_columns:
                slot += pick[t - 2] >= column.take(context)
            tokens[t] = np.where(use_uniform[t - 2], uniform_token[t - 2], self._successors_flat.take(slot))
            context = tokens[t - 1] * vocab + tokens[t]
        return np.ascontiguousarray(tokens.T)


def _distinct_successors(rng: np.random.Generator, vocab: int, branching: int) -> np.ndarray:
    """(V, V, K) int64: for each context, K distinct tokens in random order."""
    # One first token at a time keeps the random keys at V**2 floats rather than V**3.
    blocks = [np.argsort(rng.random((vocab, vocab)), axis=-1)[:, :branching] for _ in range(vocab)]
    return np.stack(blocks).astype(np.int64)


def _entropy(probs: np.ndarray) -> float:
    nonzero = probs[probs > 0]
    return float(-(nonzero * np.log(nonzero)).sum())


# --------------------------------------------------------------------------------------------------
# Batches of windows
# --------------------------------------------------------------------------------------------------


def global_batch(source: TokenSource, seed: int, step: int, global_batch: int, seq_len: int) -> np.ndarray:
    """All windows of one step, int64 (global_batch, seq_len + 1): a pure function of (seed, step).

    Every process computes the same array, whatever its rank or the layout, and takes its rows from
    it; no process ever needs another's data. ``seed`` and ``step`` must be non-negative.
    """
    if global_batch < 1 or seq_len < 1:
        raise ValueError(f"global_batch and seq_len must be positive, got {global_batch} and {seq_len}")
    rng = np.random.default_rng([_DATA_STREAM, seed, step])
    return source.sample(rng, global_batch, seq_len + 1)


def pipeline_share(batch: np.ndarray, offset: int, size: int, microbatches: int) -> list[np.ndarray]:
    """Rows [offset, offset + size) of ``batch`` as ``microbatches`` equal contiguous views."""
    if microbatches < 1 or size % microbatches:
        raise ValueError(f"pipeline batch {size} is not divisible into {microbatches} microbatches")
    if offset < 0 or offset + size > batch.shape[0]:
        raise ValueError(f"rows [{offset}, {offset + size}) do not fit a global batch of {batch.shape[0]}")
    return np.split(batch[offset : offset + size], microbatches)


@attrs.frozen(eq=False)
class Windows:
    """A batch of windows of ``seq_len + 1`` tokens cut anywhere in the data, with the interface of packed
    documents (``documents.PackedRows``): inputs and targets, no document spans (one causal row each)."""

    tokens: np.ndarray  # (rows, seq_len + 1) int64
    spans = None  # no documents: attention runs over the whole row
    positions = None

    @property
    def inputs(self) -> np.ndarray:
        return self.tokens[:, :-1]

    @property
    def targets(self) -> np.ndarray:
        return self.tokens[:, 1:]

    @property
    def num_targets(self) -> int:
        """Every position has a target: what the step's mean loss divides by."""
        return int(self.tokens.shape[0] * (self.tokens.shape[1] - 1))

    def share(self, offset: int, size: int, microbatches: int) -> list[Windows]:
        """Rows [offset, offset + size) as ``microbatches`` equal contiguous views (``pipeline_share``)."""
        return [Windows(p) for p in pipeline_share(self.tokens, offset, size, microbatches)]
