"""A modelled device: how long one compute action of a microbatch lasts on it (torch-free).

``HETERO_EMULATE_DEVICE`` gives one to each rank (runtime/emulation.py), which then makes every compute
action last ``action_seconds`` (the real computation runs inside it, the rank sleeps the rest); the
hot-switching simulator (switching/predict.py) prices buckets with the same function.
"""

from __future__ import annotations

import math

import attrs

__all__ = ["EmulatedDevice", "action_seconds"]

FLOAT32_BYTES = 4


@attrs.frozen
class EmulatedDevice:
    """A modelled device: compute speed, the link its TP group all-reduces over (inside compute actions),
    and the costs a switch pays (``switch_seconds``). ``HETERO_EMULATE_DEVICE`` gives one to the runtime
    (``RANK:gflops=..;tp_gbps=..;tp_latency_us=..``), which then makes every compute action last
    ``action_seconds`` (the real computation runs inside it, the rank sleeps the rest)."""

    flops: float  # FLOP/s of one device
    tp_bandwidth: float = math.inf  # bytes/s of the TP group's link
    tp_latency: float = 0.0  # seconds per TP all-reduce

    KEYS = {"gflops": ("flops", 1e9), "tp_gbps": ("tp_bandwidth", 1e9 / 8), "tp_latency_us": ("tp_latency", 1e-6)}

    @classmethod
    def parse(cls, spec: str) -> EmulatedDevice:
        """From ``gflops=2;tp_gbps=0.5;tp_latency_us=100`` (gflops required); ValueError naming a bad key."""
        values: dict[str, float] = {}
        for item in filter(None, (x.strip() for x in spec.split(";"))):
            key, _, value = item.partition("=")
            if key.strip() not in cls.KEYS:
                raise ValueError(f"emulated device: unknown key {key.strip()!r} (known: {', '.join(cls.KEYS)})")
            name, scale = cls.KEYS[key.strip()]
            try:
                values[name] = float(value) * scale
            except ValueError:
                raise ValueError(f"emulated device: {key.strip()} = {value!r} is not a number") from None
            if not values[name] >= 0:
                raise ValueError(f"emulated device: {key.strip()} must be >= 0, got {value}")
        if not values.get("flops", 0) > 0:
            raise ValueError(f"emulated device {spec!r}: gflops > 0 is required")
        if values.get("tp_bandwidth", 1) == 0:
            raise ValueError("emulated device: tp_gbps must be > 0")
        return cls(**values)


def action_seconds(
    model,
    kind: str,
    layers: int,
    rows: int,
    width: int,
    square_sum: int,
    tp: int,
    head: bool,
    device: EmulatedDevice,
    recompute: bool = False,
) -> float:
    """Modelled seconds of one compute action (``F``, ``B``, ``I`` or ``W``) over ``layers`` blocks of a
    microbatch of ``rows`` x ``width`` positions on one device of a TP group of ``tp``.

    The planner's FLOP conventions (planner/cost.py): per position and layer ``8 H^2 + 2 nm H F`` of
    matmuls (every position, padding included), attention ``2 H`` times the **sum of squared document
    lengths** (``square_sum``: document masks; ``rows * width^2`` without them), the head ``2 H V`` per
    position; split over the TP group. A backward is twice the forward, its weight-gradient part (``W``)
    the matmuls' forward, ``I`` the rest. With TP, each layer all-reduces its activations twice forward
    and twice backward (``I``), ring all-reduce over ``device.tp_bandwidth`` plus ``tp_latency`` each."""
    h, f = model.hidden, model.ffn_width
    nm = 3 if getattr(model.mlp, "value", model.mlp) == "swiglu" else 2
    positions = rows * width
    matmul = layers * positions * (8 * h * h + 2 * nm * h * f) + (2 * positions * h * model.vocab if head else 0)
    forward = matmul + layers * 2 * h * square_sum
    again = recompute and kind in ("B", "I")  # the recomputed forward of the blocks, before their backward
    extra = layers * positions * (8 * h * h + 2 * nm * h * f) + layers * 2 * h * square_sum if again else 0
    flops = {"F": forward, "B": 2 * forward, "W": matmul, "I": 2 * forward - matmul}[kind] + extra
    compute = flops / (tp * device.flops)
    if tp == 1 or kind == "W":
        return compute
    nbytes = positions * h * FLOAT32_BYTES
    one = 2 * (tp - 1) / tp * nbytes / device.tp_bandwidth + device.tp_latency
    return compute + (4 if again else 2) * layers * one
