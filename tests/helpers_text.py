"""A few documents, a JSONL file of them and a tokenizer trained on them, for the tests of token files and of
the README walkthrough (tests/unit/test_token_files.py, tests/integration/test_walkthrough.py); not a test module.
"""

from __future__ import annotations

import json
from pathlib import Path

DOCS = ["the cat sat on the mat", "a dog ran after the cat", "héllo wörld"]


def make_tokenizer(path: Path) -> Path:
    """A tiny byte-level BPE tokenizer trained here (never downloaded), with an <|endoftext|> token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(DOCS * 5, trainer)
    tok.save(str(path))
    return path


def write_jsonl(path: Path) -> Path:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    return path
