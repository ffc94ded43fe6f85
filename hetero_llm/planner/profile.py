"""Measured per-layer compute times (``hetero-plan --profile``) that the cost model reads instead of peak FLOPS.

A profile is a JSON file written by ``measure`` + ``write``: for each device kind it names, the seconds of
one transformer layer's forward and backward and of the head's (final norm, output projection and the
loss) for **one sequence** at the model's shapes and ``train.precision``, on one device, TP 1. Reading it
(``read``) is torch-free; measuring imports torch.

The cost model scales a measured time by the microbatch's rows and divides it by the TP size (ideal TP:
the profile measures no TP split); a backward's weight-gradient part (ZB-H1's ``W``) is the measured
backward times the FLOP model's share of it (the matmuls' weight gradients). Kinds the profile does not
name keep the FLOP model at datasheet peak.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import attrs

from hetero_llm._fs import write_atomically
from hetero_llm.errors import LayoutError

FORMAT = "hetero-plan profile 1"
SHAPE_KEYS = ("hidden", "heads", "kv_heads", "ffn_width", "seq_len", "vocab", "mlp", "norm", "position", "bias")
TIMES = ("layer_forward_s", "layer_backward_s", "head_forward_s", "head_backward_s")


@attrs.frozen
class KindTimes:
    """Seconds for one sequence on one device of a kind."""

    layer_forward_s: float
    layer_backward_s: float
    head_forward_s: float
    head_backward_s: float


@attrs.frozen
class Profile:
    file: str
    kinds: tuple[tuple[str, KindTimes], ...]
    shape: tuple[tuple[str, object], ...] = ()  # model_shape() it was measured for

    def fits(self, model, precision) -> bool:
        """Measured for this model's shapes (a bucket plan at another seq_len is not)."""
        return dict(self.shape) == model_shape(model, precision)

    def get(self, kind: str) -> KindTimes | None:
        return dict(self.kinds).get(kind)


def model_shape(model, precision) -> dict:
    """What the measured times depend on: the layer's shapes and the compute precision."""
    out = {}
    for key in SHAPE_KEYS:
        value: Any = getattr(model, key, None)
        out[key] = value.value if hasattr(value, "value") else value
    out["precision"] = precision.value
    return out


def read(path: str | os.PathLike, cluster_file: str, where: str, model, precision) -> Profile:
    """Load and check a profile; every problem is one LayoutError naming the cluster file and ``where``."""
    fix = f"write one with: hetero-plan {cluster_file} --profile {path}"
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise LayoutError(cluster_file, where, f"cannot read profile '{path}': {e.strerror or e} ({fix})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LayoutError(cluster_file, where, f"profile '{path}' is not JSON ({e}); {fix}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("kinds"), dict):
        raise LayoutError(
            cluster_file,
            where,
            f"profile '{path}' is not a hetero-plan profile (expected format '{FORMAT}' and a 'kinds' table); {fix}",
        )
    want = model_shape(model, precision)
    got = data.get("model", {})
    for key, value in want.items():
        if not isinstance(got, dict) or got.get(key) != value:
            have = got.get(key) if isinstance(got, dict) else None
            raise LayoutError(
                cluster_file,
                where,
                f"profile '{path}' was measured with {key} = {have!r}, the "
                f"cluster's model has {value!r}; measure again ({fix})",
            )
    kinds = []
    for name, times in sorted(data["kinds"].items()):
        if not isinstance(times, dict):
            raise LayoutError(cluster_file, where, f"profile '{path}': kinds.{name} is not a table")
        values = []
        for key in TIMES:
            v = times.get(key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise LayoutError(
                    cluster_file,
                    where,
                    f"profile '{path}': kinds.{name}.{key} must be a number of seconds > 0, got {v!r}; {fix}",
                )
            values.append(float(v))
        kinds.append((name, KindTimes(*values)))
    return Profile(str(path), tuple(kinds), tuple(sorted(want.items())))


def measure(model, precision, device: str = "cpu", repeats: int = 7, warmup: int = 3) -> tuple[KindTimes, dict]:
    """Time one layer's and the head's forward and backward for one sequence on ``device`` (median of
    ``repeats`` after ``warmup``), with the library's own block and head (``model.block``, ``model.head``)."""
    import torch

    from hetero_llm.layout import Precision
    from hetero_llm.model import forward as model_mod
    from hetero_llm.model.params import layer_params

    dev = torch.device(device)
    dtype = torch.bfloat16 if precision is Precision.BF16 else torch.float32
    gen = torch.Generator().manual_seed(0)
    infos = layer_params(model, 0)
    params = {
        info.name.split(".", 2)[2]: (torch.randn(info.shape, generator=gen) * 0.02).to(dev).requires_grad_()
        for info in infos
    }
    head_params = {
        "final_norm.weight": torch.ones(model.hidden, device=dev, requires_grad=True),
        "lm_head.weight": (torch.randn(model.vocab, model.hidden, generator=gen) * 0.02).to(dev).requires_grad_(),
    }
    if getattr(model, "norm", None) is not None and model.norm.value == "layernorm":
        head_params["final_norm.bias"] = torch.zeros(model.hidden, device=dev, requires_grad=True)
    x0 = torch.randn(1, model.seq_len, model.hidden, generator=gen).to(dev, dtype)
    targets = torch.randint(0, model.vocab, (1, model.seq_len), generator=gen).to(dev)
    head_model = attrs.evolve(model, tie_embeddings=False) if getattr(model, "tie_embeddings", False) else model

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def timed(fn) -> float:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    def layer_times() -> tuple[float, float]:
        x = x0.detach().requires_grad_()
        holder: dict[str, Any] = {}
        f = timed(lambda: holder.setdefault("y", model_mod.block(params, x, model)))
        g = torch.ones_like(holder["y"])
        b = timed(lambda: holder["y"].backward(g))
        return f, b

    def head_times() -> tuple[float, float]:
        x = x0.detach().requires_grad_()
        holder: dict[str, Any] = {}
        f = timed(
            lambda: holder.setdefault(
                "loss", model_mod.token_loss_sum(model_mod.head(head_params, x, head_model), targets)
            )
        )
        b = timed(lambda: holder["loss"].backward())
        return f, b

    out, spread = [], {}
    for fn, names in ((layer_times, TIMES[:2]), (head_times, TIMES[2:])):
        runs = [fn() for _ in range(warmup + repeats)][warmup:]
        for i, name in enumerate(names):
            values = [r[i] for r in runs]
            spread[name] = [min(values), statistics.median(values), max(values)]
            out.append(statistics.median(values))
    info = {
        "device": str(dev),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "min_median_max_s": spread,
        "rows": 1,
        "measured": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    return KindTimes(*out), info


MAX_SPREAD = 0.5  # --max-spread's default: (max - min) / median of the repeats above this is noise, not a measurement


def noisiest(info: dict) -> tuple[str, float, list[float]]:
    """(time, spread, [min, median, max]) of the measured time whose repeats vary most: spread = (max - min) /
    median (``measure`` records min, median and max of each in info['min_median_max_s'])."""
    name, mmm = max(info["min_median_max_s"].items(), key=lambda kv: ((kv[1][2] - kv[1][0]) / kv[1][1], kv[0]))
    return name, (mmm[2] - mmm[0]) / mmm[1], mmm


def write(
    path: str | os.PathLike, model, precision, kind: str, times: KindTimes, info: dict, previous: dict | None = None
) -> None:
    """Write (or add ``kind`` to) a profile file, atomically."""
    data: dict[str, Any]
    data = (
        previous
        if previous and previous.get("format") == FORMAT and previous.get("model") == model_shape(model, precision)
        else {"format": FORMAT, "model": model_shape(model, precision), "kinds": {}}
    )
    data["kinds"][kind] = attrs.asdict(times) | {"info": info}
    write_atomically(Path(path), lambda f: f.write((json.dumps(data, indent=1) + "\n").encode()))
