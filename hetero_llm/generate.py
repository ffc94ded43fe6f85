"""``hetero-generate CHECKPOINT_DIR --prompt TEXT``: sample from a trained checkpoint on one device.

The checkpoint (any layout's) is assembled into full parameters and run as one process with a KV cache:
the prompt goes through the model once, then each new token attends to the cached keys and values of
every position before it, so a token costs one position's compute rather than the whole sequence's. The
math is ``model.block``'s (same norms, projections, RoPE pairs, grouped-query heads); greedy decoding
(``--temperature 0``) gives what ``transformers.generate`` gives on the exported model.
"""

from __future__ import annotations

import re
import sys

import click
import torch
import torch.nn.functional as F

from hetero_llm.cli import FiniteFloatRange, OneLineCommand, WholeRange, version_option
from hetero_llm.errors import LayoutError
from hetero_llm.layout import DataKind, Mlp, ModelSpec, Position
from hetero_llm.model import Params, _apply_rope, _bias, _norm, _projections, block_params, head, rope_tables

def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w.T


class KVCache:
    """Keys and values of every layer for the positions seen so far: (B, kv heads, positions, head size)."""

    def __init__(self, layers: int):
        self.k: list[torch.Tensor | None] = [None] * layers
        self.v: list[torch.Tensor | None] = [None] * layers
        self.length = 0

    def extend(self, i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k[i] is not None:
            k, v = torch.cat([self.k[i], k], dim=2), torch.cat([self.v[i], v], dim=2)
        self.k[i], self.v[i] = k, v
        return k, v


def _cached_block(p: Params, x: torch.Tensor, model: ModelSpec, cache: KVCache, i: int) -> torch.Tensor:
    """``model.block`` for new positions ``x`` (B, t, C) after ``cache.length`` cached ones."""
    B, t, _ = x.shape
    hd, start = model.head_dim, cache.length
    q, k, v = _projections(_norm(x, p, "attn_norm", model), p, ["attn.wq", "attn.wk", "attn.wv"], _linear)
    nh, nkv = q.shape[-1] // hd, k.shape[-1] // hd
    q = q.view(B, t, nh, hd).transpose(1, 2)  # (B, nh, t, hd)
    k, v = (a.view(B, t, nkv, hd).transpose(1, 2) for a in (k, v))  # (B, nkv, t, hd)
    if model.position is Position.ROPE:
        cos, sin = rope_tables(start + t, hd, x.device, q.dtype, model.rope_theta)
        q, k = _apply_rope(q, cos[start:], sin[start:]), _apply_rope(k, cos[start:], sin[start:])
    k, v = cache.extend(i, k, v)  # (B, nkv, start + t, hd)
    if nkv != nh:
        k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
    # new position j (absolute start + j) sees every cached position and the new ones up to itself
    mask = torch.ones(t, start + t, dtype=torch.bool, device=x.device).tril(diagonal=start)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(B, t, nh * hd)
    x = x + _bias(y @ p["attn.wo"].T, p, "attn.wo")
    h = _norm(x, p, "mlp_norm", model)
    if model.mlp is Mlp.SWIGLU:
        a, gate = _projections(h, p, ["mlp.w1", "mlp.w3"], _linear)
        a = F.silu(a) * gate
    else:
        a = F.gelu(_projections(h, p, ["mlp.w1"], _linear)[0], approximate="tanh")
    return x + _bias(a @ p["mlp.w2"].T, p, "mlp.w2")


@torch.no_grad()
def forward(params: Params, model: ModelSpec, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits (B, t, V) of new tokens ``ids`` (B, t) after the cached positions; the cache takes them in."""
    start = cache.length
    x = F.embedding(ids, params["embed.tok"])
    if model.position is Position.LEARNED:
        x = x + params["embed.pos"][start:start + ids.shape[1]]
    for i in range(model.layers):
        x = _cached_block(block_params(params, i, model), x, model, cache, i)
    cache.length += ids.shape[1]
    return head(params, x, model)


@torch.no_grad()
def generate(params: Params, model: ModelSpec, prompt: list[int], max_new_tokens: int, temperature: float = 1.0,
             top_k: int = 0, seed: int = 0, eos_id: int | None = None) -> list[int]:
    """New tokens after ``prompt``: greedy when ``temperature`` is 0, else sampled from softmax(logits / T)
    over the ``top_k`` likeliest (0: all); stops after ``eos_id``."""
    gen = torch.Generator().manual_seed(seed)
    device = params["embed.tok"].device
    cache = KVCache(model.layers)
    logits = forward(params, model, torch.tensor([prompt], device=device), cache)[0, -1]
    out: list[int] = []
    for _ in range(max_new_tokens):
        scaled = logits.float() / temperature if temperature else logits
        if temperature == 0 or not torch.isfinite(scaled).all():  # greedy (or a temperature so small that the
            token = int(logits.argmax())                          # logits overflow: its limit, greedy too)
        else:
            if top_k:
                kth = scaled.topk(min(top_k, scaled.numel())).values[-1]
                scaled = scaled.masked_fill(scaled < kth, float("-inf"))
            token = int(torch.multinomial(scaled.softmax(-1).cpu(), 1, generator=gen))
        out.append(token)
        if token == eos_id or len(out) == max_new_tokens:
            break
        logits = forward(params, model, torch.tensor([[token]], device=device), cache)[0, -1]
    return out


MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes 64 bits
DEFAULT_NEW_TOKENS = 64


class _Device(click.ParamType):
    """``--device``: 'cpu', or 'cuda[:N]' of a GPU this machine has; anything else is a one-line usage error."""

    name = "device"

    def convert(self, value, param, ctx):
        text = str(value).strip()
        found = re.fullmatch(r"cpu|cuda(?::(0|[1-9][0-9]*))?", text)
        if found is None:
            self.fail(f"'{value}' is not a device this command runs on (give 'cpu' or 'cuda:N')", param, ctx)
        if text != "cpu":
            if not torch.cuda.is_available():
                self.fail(f"'{value}' needs CUDA, which this machine does not have (use --device cpu)", param, ctx)
            count, index = torch.cuda.device_count(), int(found.group(1) or 0)
            if index >= count:
                self.fail(f"'{value}' is not one of this machine's {count} GPU(s) (use cuda:0 to cuda:{count - 1})",
                          param, ctx)
        return text


@click.command("hetero-generate", cls=OneLineCommand, context_settings={"help_option_names": ["-h", "--help"]})
@version_option("hetero-generate")
@click.argument("checkpoint_dir", metavar="CHECKPOINT_DIR", type=click.Path())
@click.option("--prompt", required=True, help="Text the model continues.")
@click.option("--max-new-tokens", type=WholeRange(min=1), default=None, show_default="64, or what fits",
              help="Tokens to generate at most (fewer after an EOS); the prompt and them must fit in model.seq_len. "
                   "Default: 64, or as many as fit after the prompt.")
@click.option("--temperature", type=FiniteFloatRange(min=0), default=1.0, show_default=True,
              help="Softmax temperature; 0 = greedy (the likeliest token each time).")
@click.option("--top-k", type=WholeRange(min=0), default=0, show_default=True,
              help="Sample among the K likeliest tokens only (0: all; at most model.vocab).")
@click.option("--seed", type=WholeRange(0, MAX_SEED), default=0, show_default=True,
              help="Seed of the sampling (0 to 2**64 - 1).")
@click.option("--device", type=_Device(), default="cpu", show_default=True, help="Where to run: 'cpu' or 'cuda:N'.")
def main(checkpoint_dir, prompt, max_new_tokens, temperature, top_k, seed, device):
    """Continue --prompt with the model a checkpoint holds (prints the prompt and its continuation)."""
    from hetero_llm import export
    from hetero_llm.checkpoint_io import load_full_params

    try:
        s = export.saved(checkpoint_dir)
        tok = export.load_tokenizer(s.data, str(s.ckpt.path))
        grammar = s.data.kind is DataKind.GRAMMAR  # its tokens are ids, not text
        ids = _ids(prompt, str(s.ckpt.path)) if grammar else tok.encode(prompt)
        if not ids:
            raise LayoutError(str(s.ckpt.path), "--prompt", "is empty (give some text to continue)")
        if max(ids) >= s.model.vocab or min(ids) < 0:
            raise LayoutError(str(s.ckpt.path), "--prompt", f"token {max(ids)} is outside the model's vocabulary of "
                              f"{s.model.vocab} (model.vocab)")
        room = s.model.seq_len - len(ids)
        if room < 1:
            raise LayoutError(str(s.ckpt.path), "--prompt", f"{len(ids)} tokens leave no room for new ones in "
                              f"model.seq_len {s.model.seq_len}, the positions the model was trained on (give at most "
                              f"{s.model.seq_len - 1} tokens)")
        if max_new_tokens is None:  # the default: as many as fit, up to 64
            max_new_tokens = min(DEFAULT_NEW_TOKENS, room)
        if max_new_tokens > room:
            raise LayoutError(str(s.ckpt.path), "--max-new-tokens", f"{max_new_tokens} tokens after a prompt of "
                              f"{len(ids)} exceed model.seq_len {s.model.seq_len}, the positions the model was trained "
                              f"on (use at most {max(room, 0)}, or a shorter prompt)")
        if top_k > s.model.vocab:
            raise LayoutError(str(s.ckpt.path), "--top-k", f"{top_k} is more than the model's {s.model.vocab} tokens "
                              f"(model.vocab; use at most {s.model.vocab}, or 0 for all)")
        params = {n: t.to(device) for n, t in load_full_params(str(s.ckpt.path)).items()}
    except LayoutError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    if grammar:
        new = generate(params, s.model, ids, max_new_tokens, temperature, top_k, seed)
        click.echo(" ".join(map(str, ids + new)))
        return
    new = generate(params, s.model, ids, max_new_tokens, temperature, top_k, seed, tok.eos_id)
    click.echo(tok.decode(ids + [t for t in new if t != tok.eos_id]))  # the EOS ends the text, unprinted


def _ids(prompt: str, where: str) -> list[int]:
    try:
        return [int(t) for t in prompt.split()]
    except ValueError:
        raise LayoutError(where, "--prompt", "the model was trained on the embedded grammar, whose tokens are ids, "
                          "not text: give ids separated by spaces, e.g. --prompt '3 17 5'") from None


if __name__ == "__main__":
    main()
