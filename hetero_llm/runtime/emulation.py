"""Emulated devices for benchmarks on a CPU machine: documented as emulation, never on by default.

Each rank reads its emulation from the environment, once, here: ``HETERO_EMULATE_SLOWDOWN`` and
``HETERO_EMULATE_JITTER`` (sleep after each compute action), ``HETERO_EMULATE_ACTION_S`` (fixed
durations per action kind) and ``HETERO_EMULATE_DEVICE`` (a modelled device, predict/device.py: every
compute action lasts its modelled duration; the real computation runs inside it and the rank sleeps the
rest). Each is ``"RANK:value,..."`` with ``*`` for every rank. Torch-free.
"""

from __future__ import annotations

import math
import os

import attrs

from hetero_llm.errors import ENVIRONMENT, LayoutError
from hetero_llm.predict.device import EmulatedDevice
from hetero_llm.schedule import Kind

DEVICE_ENV = "HETERO_EMULATE_DEVICE"
EXAMPLES = {  # the variables of emulated devices (Emulation), "RANK:VALUE,...", RANK a rank or '*'
    "HETERO_EMULATE_SLOWDOWN": "'*:1.5' or '1:2,*:1'",
    "HETERO_EMULATE_JITTER": "'*:0.6'",
    "HETERO_EMULATE_ACTION_S": "'*:F=0.02;B=0.04' or '0:F=0.01;B=0.02;I=0.012;W=0.008'",
    "HETERO_EMULATE_DEVICE": "'*:gflops=100;tp_gbps=200;tp_latency_us=5'",
}


def check_environment(environ, world_size: int) -> None:
    """Every ``HETERO_EMULATE_*`` entry well-formed for a layout of ``world_size`` ranks (hetero-launch checks this
    before any rank starts); else a located ``LayoutError`` naming the variable, its value and an example."""
    for var in EXAMPLES:
        for item in filter(None, environ.get(var, "").split(",")):
            who, sep, spec = item.partition(":")
            problem = _emulation_problem(var, who.strip(), sep, spec, world_size)
            if problem:
                raise LayoutError(
                    ENVIRONMENT,
                    var,
                    f"'{environ[var]}': {problem} (write RANK:VALUE entries "
                    f"separated by commas, RANK a rank or '*', e.g. {EXAMPLES[var]})",
                )


def _emulation_problem(var: str, who: str, sep: str, spec: str, world_size: int) -> str | None:
    """What is wrong with one ``RANK:VALUE`` entry of an emulation variable, or None."""
    if not sep:
        return f"'{who}' has no ':'"
    if who != "*" and not (who.isdigit() and int(who) < world_size):
        return f"'{who}' is not '*' or one of the layout's ranks 0..{world_size - 1}"
    if var == "HETERO_EMULATE_DEVICE":
        try:
            EmulatedDevice.parse(spec)
        except ValueError as e:
            return str(e)
        return None
    if var == "HETERO_EMULATE_ACTION_S":
        pairs = [(k.strip(), v) for k, _, v in (x.partition("=") for x in spec.split(";"))]
        for kind, value in pairs:
            if kind not in ("F", "B", "I", "W"):
                return f"'{kind}' is not a compute action (F, B, I or W)"
            seconds = _number(value)
            if seconds is None or seconds < 0:
                return f"{kind} = '{value}' is not a number of seconds >= 0"
        return None
    least = 1 if var == "HETERO_EMULATE_SLOWDOWN" else 0
    number = _number(spec)
    if number is None or number < least:
        what = "a slowdown factor >= 1" if least else "a jitter >= 0 (a fraction of the compute time)"
        return f"'{spec}' is not {what}"
    return None


def _number(text: str) -> float | None:
    """A finite float, or None."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def device_spec(rank: int | str) -> str | None:
    """``HETERO_EMULATE_DEVICE``'s entry for ``rank`` (or ``*``), the last one given; None when it has none."""
    spec = None
    for item in filter(None, os.environ.get(DEVICE_ENV, "").split(",")):
        who, _, rest = item.partition(":")
        if who.strip() in (str(rank), "*"):
            spec = rest
    return spec


def dry_run_device() -> EmulatedDevice | None:
    """The modelled device of ``--dry-run``'s hot-switching prediction: ``HETERO_EMULATE_DEVICE``'s entry for
    every rank (``*``) or rank 0; None when it has none; a bad one is a located ``LayoutError``."""
    spec = device_spec(0)
    if spec is None:
        return None
    try:
        return EmulatedDevice.parse(spec)
    except ValueError as e:
        example = "'*:gflops=100;tp_gbps=200;tp_latency_us=5'"
        raise LayoutError(ENVIRONMENT, DEVICE_ENV, f"{e} (e.g. {example})") from None


_KINDS_BY_VALUE = {kind.value: kind for kind in Kind}


@attrs.frozen
class Emulation:
    """Emulated slower / jittery devices for benchmarks (documented as emulation, never on by default).

    After each compute action the rank sleeps ``(slowdown - 1 + U(0, jitter)) * compute time``, its own compute
    time: what it spent inside TP all-reduces (waiting for its TP peers) left out (``collectives.TpWaits``).
    Read from ``HETERO_EMULATE_SLOWDOWN`` and ``HETERO_EMULATE_JITTER``: ``"rank:value,..."``.
    """

    slowdown: float = 1.0
    jitter: float = 0.0
    seed: int = 0
    # Emulated device: each compute action lasts this many seconds (by kind: F, B, I, W); the real
    # computation runs inside it and the rank sleeps the rest (HETERO_EMULATE_ACTION_S, "rank:F=s;B=s,...").
    seconds: tuple[tuple[Kind, float], ...] = ()
    # Emulated device: each compute action lasts predict.device.action_seconds of its microbatch (HETERO_EMULATE_DEVICE,
    # "rank:gflops=..;tp_gbps=..;tp_latency_us=.."): durations that follow the rows, widths and documents.
    device: EmulatedDevice | None = None

    @classmethod
    def from_env(cls, rank: int) -> Emulation:
        def pick(var: str, default: float) -> float:
            for item in filter(None, os.environ.get(var, "").split(",")):
                r, _, v = item.partition(":")
                if r.strip() in (str(rank), "*"):
                    return float(v)
            return default

        seconds: tuple[tuple[Kind, float], ...] = ()
        for item in filter(None, os.environ.get("HETERO_EMULATE_ACTION_S", "").split(",")):
            r, _, spec = item.partition(":")
            if r.strip() in (str(rank), "*"):
                pairs = [(k.strip(), float(v)) for k, _, v in (x.partition("=") for x in spec.split(";"))]
                seconds = tuple((_KINDS_BY_VALUE[k], s) for k, s in pairs if k in _KINDS_BY_VALUE)  # others never ran
        device_text = device_spec(rank)
        device = EmulatedDevice.parse(device_text) if device_text is not None else None
        return cls(pick("HETERO_EMULATE_SLOWDOWN", 1.0), pick("HETERO_EMULATE_JITTER", 0.0), rank, seconds, device)

    @property
    def active(self) -> bool:
        return self.slowdown != 1.0 or self.jitter > 0 or bool(self.seconds) or self.device is not None
