"""Tokenizers: bytes (token = byte value, vocab 256) or a local Hugging Face ``tokenizer.json``.

``data.tokenizer`` names one. Every document ends with the tokenizer's end-of-document token (``eos_id``):
byte 0 for bytes (NUL does not occur in text), the tokenizer's own EOS token (``</s>``, ``<|endoftext|>``,
...) for a ``tokenizer.json``, appended by its id: special-token text inside a document is encoded as
plain text. Torch-free; the ``tokenizers`` library is imported only for a tokenizer.json.
"""

from __future__ import annotations

import os
from typing import Protocol

BYTES = "bytes"
BYTE_VOCAB = 256
BYTE_EOS = 0
# Names tokenizers give their end-of-document token, most common first.
EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "<|im_end|>", "[SEP]")


class Tokenizer(Protocol):
    name: str  # "bytes" or the tokenizer.json path
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    name = BYTES
    vocab_size = BYTE_VOCAB
    eos_id = BYTE_EOS

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizers`` tokenizer read from a local tokenizer.json (never from the hub)."""

    def __init__(self, path: str, tok):
        self.name = path
        # Text is text: a document that spells a special token ("<|endoftext|>" in a text about tokenizers) is
        # encoded as those characters, never as the special token. The one EOS between documents is appended
        # by its id (token_files.encode_documents); tokenizers would otherwise match added tokens in the text.
        tok.encode_special_tokens = True
        self._tok = tok
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        eos = next((vocab[n] for n in EOS_NAMES if n in vocab), None)
        if eos is None:
            raise ValueError(
                f"it has none of the end-of-document tokens {', '.join(EOS_NAMES)} (add one as a special token)"
            )
        self.eos_id = eos
        self.eos_token = next(n for n in EOS_NAMES if vocab.get(n) == eos)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


def load(name: str) -> ByteTokenizer | HFTokenizer:
    """The tokenizer ``data.tokenizer`` names: 'bytes' or a tokenizer.json path (ValueError says why not)."""
    if name == BYTES:
        return ByteTokenizer()
    if not os.path.isfile(name):
        raise ValueError(f"file '{name}' does not exist (give 'bytes' or a local Hugging Face tokenizer.json)")
    try:
        from tokenizers import Tokenizer as _Tokenizer
    except ImportError:
        raise ValueError("needs the 'tokenizers' library (pip install 'hetero_llm[hf]')") from None
    try:
        tok = _Tokenizer.from_file(name)
    except Exception:  # tokenizers raises its own Exception type, whose wording changes between versions
        raise ValueError(
            f"'{name}' is not a tokenizer.json that the tokenizers library reads (write one with tokenizer.save(path))"
        ) from None
    return HFTokenizer(name, tok)
