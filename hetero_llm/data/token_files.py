"""Pre-tokenized token files and ``hetero-tokenize``, which writes them.

A token file is a flat array of token ids, one document after another, each ended by the tokenizer's
end-of-document token:

- ``.bin``: raw little-endian ``uint16`` (as nanoGPT's prepare scripts write) or ``uint32`` (vocabularies
  over 65536 tokens; ``data.token_dtype`` says which);
- ``.npy``: a NumPy array file, whose header carries the dtype.

Both are memory-mapped: a rank reads only the windows it samples. Training windows are ``seq_len + 1``
consecutive tokens at uniform random offsets of the whole stream (``TokenFileSource.sample``), so a window
may span the end of one document and the start of the next, with the EOS token between them: the model
learns to end a document and that what follows an EOS is unrelated (GPT-2's and nanoGPT's convention;
attention is not masked at the boundary).

Text or JSONL with a tokenizer.json (``data.tokenizer``) is tokenized once into such a file: a cache beside
the source (``<source>.hf-tokens.bin`` with a ``.json`` sidecar that says what it was made from), or under the
user cache directory when the source's folder is read-only, or in ``$HETERO_LLM_CACHE`` when that is set. Imports numpy only (``tokenizers`` on use).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np

from hetero_llm.data import tokenizers
from hetero_llm.data.text_cache import CACHE_ENV, TokenFileSource, jsonl_document
from hetero_llm.errors import LayoutError

DTYPES: dict[str, np.dtype] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
BATCH_DOCS = 256  # documents encoded per tokenizers batch call


def dtype_for(vocab: int) -> str:
    return "uint16" if vocab <= 1 << 16 else "uint32"


class TokenArraySource(TokenFileSource):
    """Random windows of a memory-mapped token array (a .bin/.npy file, or a tokenized cache)."""

    def __init__(self, tokens_: np.ndarray, path: str, file_for_errors: str, vocab: int):
        super().__init__(tokens_, path, file_for_errors)
        self._vocab = vocab

    @property
    def vocab_size(self) -> int:
        return self._vocab


def open_tokens(path: str, token_dtype: str, file_for_errors: str) -> TokenArraySource:
    """``data.kind = 'tokens'``: a .bin (``token_dtype``) or .npy file, memory-mapped; its largest id sets the vocab."""
    if not os.path.isfile(path):
        raise LayoutError(
            file_for_errors,
            "data.path",
            f"file '{path}' does not exist (give a .bin or .npy token file, e.g. one hetero-tokenize wrote)",
        )
    if path.endswith(".npy"):
        try:
            array = np.load(path, mmap_mode="r")
        except (ValueError, OSError) as e:
            raise LayoutError(file_for_errors, "data.path", f"file '{path}' is not a NumPy .npy file ({e})") from None
        if array.ndim != 1 or array.dtype.kind != "u" or array.dtype.itemsize not in (2, 4):
            raise LayoutError(
                file_for_errors,
                "data.path",
                f"file '{path}' holds a {array.dtype} array of shape "
                f"{array.shape}; expected a 1-D uint16 or uint32 array of token ids",
            )
    elif path.endswith(".bin"):
        dtype = DTYPES[token_dtype]
        size = os.path.getsize(path)
        if size % dtype.itemsize:
            raise LayoutError(
                file_for_errors,
                "data.path",
                f"file '{path}' has {size} bytes, not a whole number of {token_dtype} tokens (check data.token_dtype)",
            )
        array = np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype)
    else:
        raise LayoutError(
            file_for_errors,
            "data.path",
            f"file '{path}' is neither .bin nor .npy (data.kind 'tokens' "
            "reads token files; use kind 'text' or 'jsonl' for text)",
        )
    return TokenArraySource(array, path, file_for_errors, int(_max(array)) + 1 if len(array) else 0)


def _max(array: np.ndarray, chunk: int = 1 << 24) -> int:
    """The largest id, read in chunks so a large memory-mapped file is not held in memory."""
    return max(int(array[i : i + chunk].max()) for i in range(0, len(array), chunk))


def check_vocab(source, vocab: int, file_for_errors: str) -> None:
    """Every token id of a token-array source is below ``model.vocab`` (an embedding lookup would fail later)."""
    if isinstance(source, TokenArraySource) and source.vocab_size > vocab:
        raise LayoutError(
            file_for_errors,
            "model.vocab",
            f"{vocab} is too small for '{source.path}', whose token ids "
            f"go up to {source.vocab_size - 1} (set model.vocab >= {source.vocab_size})",
        )


# ------------------------------------------------------------------------------------------
# Writing token files


def documents(
    path: str, kind: str, field: str, file_for_errors: str, read: Callable[[int], None] | None = None
) -> Iterator[str]:
    """The documents of a text file (the whole file) or a JSONL file (each line's ``field``); ``read(bytes)``
    with the bytes of the file each document came from, as it is read."""
    read = read or (lambda n: None)
    if kind == "text":
        read(os.path.getsize(path))
        yield Path(path).read_text(encoding="utf-8", errors="replace")
        return
    with open(path, "rb") as reader:
        for number, line in enumerate(reader, start=1):
            read(len(line))
            if line.strip():
                yield jsonl_document(line, number, path, field, file_for_errors).decode("utf-8")


def encode_documents(docs: Iterable[str], tok) -> Iterator[np.ndarray]:
    """Token arrays of batches of documents, each document followed by the tokenizer's EOS."""
    batch: list[str] = []

    def flush() -> np.ndarray:
        encoded = tok.encode_batch(batch) if hasattr(tok, "encode_batch") else [tok.encode(d) for d in batch]
        batch.clear()
        return np.fromiter((t for ids in encoded for t in (*ids, tok.eos_id)), dtype=np.int64)

    for doc in docs:
        batch.append(doc)
        if len(batch) >= BATCH_DOCS:
            yield flush()
    if batch:
        yield flush()


def write_tokens(out: str, arrays: Iterable[np.ndarray], dtype: str, progress=None) -> int:
    """Write the concatenated ``arrays`` to ``out`` (.bin raw, .npy with a header) atomically; return the count."""
    directory = os.path.dirname(os.path.abspath(out))
    os.makedirs(directory, exist_ok=True)
    np_dtype = DTYPES[dtype]
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=os.path.basename(out) + ".", suffix=".tmp")
    count = 0
    try:
        with os.fdopen(fd, "wb") as raw:
            for a in arrays:
                raw.write(a.astype(np_dtype).tobytes())
                count += len(a)
                if progress is not None:
                    progress(len(a))
            raw.flush()
            os.fsync(raw.fileno())
        if out.endswith(".npy"):  # NumPy's format: a header, then the same bytes (copied in chunks)
            _raw_to_npy(tmp, np_dtype, count)
        os.replace(tmp, out)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return count


def _raw_to_npy(path: str, dtype: np.dtype, count: int, chunk: int = 1 << 24) -> None:
    """Turn the raw token file ``path`` into a .npy file in place (through a second temporary file)."""
    tmp = path + ".npy"
    raw = np.memmap(path, dtype=dtype, mode="r", shape=(count,)) if count else np.zeros(0, dtype)
    out = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=(count,))
    for i in range(0, count, chunk):
        out[i : i + chunk] = raw[i : i + chunk]
    out.flush()
    del out, raw
    os.replace(tmp, path)


def tokenize_file(
    source: str,
    out: str,
    kind: str,
    field: str,
    tokenizer: str,
    file_for_errors: str,
    progress=None,
    read: Callable[[int], None] | None = None,
) -> tuple[int, str]:
    """Tokenize ``source`` into the token file ``out``; return (tokens written, dtype). ``progress(tokens)``
    after each batch written; ``read(bytes)`` as the source is read (``documents``)."""
    tok = tokenizers.load(tokenizer)
    dtype = dtype_for(tok.vocab_size)
    docs = documents(source, kind, field, file_for_errors, read)
    count = write_tokens(out, encode_documents(docs, tok), dtype, progress)
    return count, dtype


# ------------------------------------------------------------------------------------------
# Text with a tokenizer.json: a cache of the tokens


def cache_paths(source: str) -> list[Path]:
    """Where the tokens of ``source`` may be cached, in order: the folder ``$HETERO_LLM_CACHE`` names when set;
    else beside the source, then the user cache folder (as ``text_cache.cache_path`` for byte tokens)."""
    name = os.path.basename(source) + ".hf-tokens.bin"
    chosen = os.environ.get(CACHE_ENV)
    home = Path(chosen) if chosen else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hetero_llm"
    user = home / f"{hashlib.sha256(os.path.abspath(source).encode()).hexdigest()[:16]}-{name}"
    return [user] if chosen else [Path(source).with_name(name), user]


def _recipe(source: str, kind: str, field: str, tokenizer: str) -> str:
    stat = os.stat(source)
    tok_digest = hashlib.sha256(Path(tokenizer).read_bytes()).hexdigest()
    # "special-as-text": a cache from when special-token text in a document became the special token is stale
    return f"{tok_digest}|special-as-text|{kind}|{field if kind == 'jsonl' else ''}|{stat.st_size}|{stat.st_mtime_ns}"


def tokenized_source(path: str, kind: str, field: str, tokenizer: str, file_for_errors: str) -> TokenArraySource:
    """Text/JSONL through a tokenizer.json, tokenized once into a cache and memory-mapped."""
    if not os.path.isfile(path):
        raise LayoutError(
            file_for_errors, "data.path", f"file '{path}' does not exist (give an existing text or JSONL file)"
        )
    recipe = _recipe(path, kind, field, tokenizer)
    for cache in cache_paths(path):
        meta = cache.with_suffix(".json")
        try:
            saved = json.loads(meta.read_text())
            if saved["recipe"] == recipe and cache.stat().st_size == saved["count"] * DTYPES[saved["dtype"]].itemsize:
                return _cached(cache, saved, file_for_errors)
        except (OSError, ValueError, KeyError):
            pass
    for cache in cache_paths(path):
        try:
            count, dtype = tokenize_file(path, str(cache), kind, field, tokenizer, file_for_errors)
        except PermissionError:
            continue  # a read-only data folder: the user cache directory next
        saved = {"recipe": recipe, "count": count, "dtype": dtype, "source": os.path.abspath(path)}
        tmp = cache.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(saved))
        os.replace(tmp, cache.with_suffix(".json"))  # written last: the cache counts once its sidecar is there
        return _cached(cache, saved, file_for_errors)
    raise LayoutError(
        file_for_errors,
        "data.path",
        f"cannot write the token cache of '{path}' beside it or in "
        f"{cache_paths(path)[1].parent} (make one of them writable)",
    )


def _cached(cache: Path, saved: dict, file_for_errors: str) -> TokenArraySource:
    return open_tokens(str(cache), saved["dtype"], file_for_errors)


# ------------------------------------------------------------------------------------------
# hetero-tokenize
