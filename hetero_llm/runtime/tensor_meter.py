"""A meter of the bytes of tensors one rank holds, for benchmarks (``HETERO_TENSOR_METER=DIR``).

Process RSS cannot resolve a few MB of model state under the torch runtime's hundreds, so this counts tensors:

- **state**, at checkpoints the training code calls (``checkpoint``): every tensor of the sources registered
  (``register``: the home parameters, each switching layout's parameter copies, the optimizer's state, the inputs
  and output gradients a split backward holds for its put-off weight gradients), and each parameter's ``.grad``;
  one storage counted once however many tensors view it;
- **activations**: what autograd saves for backward, counted through ``torch.autograd.graph.saved_tensors_hooks``
  from the moment a tensor is saved to the moment autograd frees it (after its backward, or with its graph),
  storages already counted as state left out, a storage saved twice counted once.

A checkpoint adds the state it counts to the most activations held since the previous checkpoint; the peak is
the largest such sum. Checkpoints are placed where the state is largest (after a schedule has accumulated its
gradients, inside a switch once the target's gradients exist beside the source's, after the optimizer step), so
the state counted at a checkpoint was held while the activations before it were; and after every compute action
(runtime/interpreter.py), with the activations held then (``instant``): a forward only adds saved tensors and a
backward only frees them while it adds gradients (and put-off weight gradients' tensors), so the most held at once
during an action is at its start (the previous action's checkpoint) or its end, up to one autograd node's
transient tensors; these see the gradients beside the activations before ZeRO-1's reduce-scatter frees them and
before a split backward's ``W`` consumes what it put off. Not counted:
tensors held outside autograd and the sources (stage-boundary buffers, data), and the recomputed forward's
transient tensors inside a recomputing stage's backward (its checkpointed inputs are counted). At exit the
meter writes ``DIR/rank{R}.json`` (whole or not at all).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from hetero_llm._fs import write_atomically

ENV = "HETERO_TENSOR_METER"

_active: TensorMeter | None = None


class _Saved:
    """What the pack hook stores in the graph for one saved tensor; releases its bytes when autograd drops it."""

    __slots__ = ("key", "meter", "tensor")

    def __init__(self, meter: TensorMeter, key: int | None, tensor: torch.Tensor):
        # detached: the same storage, without the graph (an output saved by its own node would otherwise hold
        # its node through this object: a cycle that outlives a graph dropped without its backward)
        self.meter, self.key, self.tensor = meter, key, tensor.detach()

    def __del__(self) -> None:
        if self.key is not None:
            self.meter._release(self.key)


class TensorMeter:
    """See the module doc. ``register`` sources, run the step inside ``saving()``, call ``checkpoint``."""

    def __init__(self) -> None:
        self.sources: dict[str, Callable[[], Iterable[torch.Tensor]]] = {}
        self.static_keys: set[int] = set()
        self.saved: dict[int, list[int]] = {}  # storage key -> [references, bytes]
        self.activations = 0
        self.segment_peak = 0  # the most activation bytes since the last checkpoint
        self.peak = 0
        self.at_peak: dict[str, int] = {}
        self.checkpoints = 0

    def register(self, category: str, tensors: Callable[[], Iterable[torch.Tensor]]) -> None:
        """A source of state tensors (called at each checkpoint): parameters, their copies, optimizer state."""
        self.sources[category] = tensors

    def saving(self):
        """The context in which autograd's saved tensors are counted."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, tensor: torch.Tensor) -> _Saved:
        key = _key(tensor)
        if key in self.static_keys:
            return _Saved(self, None, tensor)
        entry = self.saved.get(key)
        if entry is None:
            nbytes = tensor.untyped_storage().nbytes()
            self.saved[key] = [1, nbytes]
            self.activations += nbytes
            self.segment_peak = max(self.segment_peak, self.activations)
        else:
            entry[0] += 1
        return _Saved(self, key, tensor)

    def _release(self, key: int) -> None:
        entry = self.saved.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.activations -= entry[1]
            del self.saved[key]

    def state_bytes(self) -> dict[str, int]:
        """Bytes per category of the registered sources' tensors now (each storage once, in registration order),
        the parameters' gradients as ``gradients``."""
        seen: set[int] = set()
        out: dict[str, int] = {}
        grads: list[torch.Tensor] = []
        for category, tensors in self.sources.items():
            out[category] = 0
            for t in tensors():
                out[category] += _once(t, seen)
                if t.grad is not None:
                    grads.append(t.grad)
        out["gradients"] = sum(_once(g, seen) for g in grads)
        self.static_keys = seen
        return out

    def checkpoint(self, instant: bool = False) -> None:
        """State now plus the most activations since the last checkpoint (``instant``: the activations now, for a
        checkpoint after each compute action, see the module doc); the peak if it is the largest."""
        state = self.state_bytes()
        held = self.activations if instant else self.segment_peak
        total = sum(state.values()) + held
        self.checkpoints += 1
        if total > self.peak:
            self.peak = total
            self.at_peak = {**state, "activations": held}
        self.segment_peak = self.activations

    def report(self) -> dict:
        return {"peak_bytes": self.peak, "at_peak": self.at_peak, "checkpoints": self.checkpoints}

    def write(self, folder: str | Path, rank: int) -> None:
        data = json.dumps(self.report()).encode()
        write_atomically(Path(folder) / f"rank{rank}.json", lambda f: f.write(data))


def tensors_of(obj, depth: int = 3) -> list[torch.Tensor]:
    """The tensors an object keeps (an optimizer's moments, step counts, buffers): its own if it is a tensor, else
    those in its containers and attributes, ``depth`` levels down (parameters found there again are counted
    once: ``state_bytes`` counts each storage once)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if depth == 0:
        return []
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    elif hasattr(obj, "__dict__"):
        items = list(vars(obj).values())
    else:
        return []
    return [t for x in items for t in tensors_of(x, depth - 1)]


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _once(t: torch.Tensor, seen: set[int]) -> int:
    key = _key(t)
    if key in seen:
        return 0
    seen.add(key)
    return t.untyped_storage().nbytes()


def _unpack(saved: _Saved) -> torch.Tensor:
    return saved.tensor


def from_env() -> TensorMeter | None:
    """A meter when ``HETERO_TENSOR_METER`` names a folder (and it becomes the active one), else None."""
    global _active
    _active = TensorMeter() if os.environ.get(ENV) else None
    return _active


def active() -> TensorMeter | None:
    return _active


def saving():
    """``TensorMeter.saving`` of the active meter; a context that does nothing without one."""
    return _active.saving() if _active is not None else contextlib.nullcontext()


def checkpoint(instant: bool = False) -> None:
    """``TensorMeter.checkpoint`` of the active meter; nothing without one."""
    if _active is not None:
        _active.checkpoint(instant)
