"""Bring-your-own text for training: ``.txt`` / ``.jsonl`` files tokenized once at the byte level into a
memory-mapped cache (``TokenFileSource``), written atomically so concurrent ranks never read half a cache.

Where the cache lives is ``cache_path``'s choice: beside the source when its folder is writable, else
``$HETERO_LLM_CACHE`` or the user cache folder. Numpy and the standard library only (torch-free).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile

import numpy as np

from hetero_llm._fs import fsync_dir
from hetero_llm.errors import LayoutError

BYTE_VOCAB = 256
# Token that ends every JSONL document. Byte 0 (NUL) does not occur in ordinary text, so it can
# mark document boundaries without an extra vocabulary entry.
END_OF_DOCUMENT = 0

# Cache header: magic (8 bytes) + token count (uint64 LE) + digest (16 bytes) of what the tokens
# were made from: tokenizer, kind, JSONL field, and the source's size and mtime. Any difference makes
# the cache stale. Comparing recorded stamps rather than "source newer than cache" also catches a
# source replaced by an older copy and survives a source whose mtime lies in the future.
_CACHE_MAGIC = b"HLTOKv1\x00"
_CACHE_HEADER_BYTES = 32
_CACHE_DTYPE = np.dtype("<u2")  # little-endian so caches move between machines
_TOKENIZER_VERSION = "bytes-v1"
_WRITE_CHUNK_BYTES = 1 << 24


# --------------------------------------------------------------------------------------------------
# Bring-your-own text, byte-level tokens
# --------------------------------------------------------------------------------------------------


class TokenFileSource:
    """Random windows of a byte-level token stream, memory-mapped from ``<path>.tokens.u16``.

    Tokenizer: token = byte value (vocab 256). A ``text`` file is one document, its raw bytes. A
    ``jsonl`` file holds one JSON object per line; each object's ``field`` is encoded as UTF-8 and
    followed by ``END_OF_DOCUMENT`` (byte 0). Blank lines are skipped. The cache is a 32-byte header
    (see ``_CACHE_MAGIC``) then little-endian uint16 tokens; uint16 leaves room for a larger vocabulary.
    """

    def __init__(self, tokens: np.ndarray, path: str, file_for_errors: str):
        self.tokens = tokens
        self.path = path
        self.file_for_errors = file_for_errors

    @classmethod
    def from_file(
        cls, path: str, kind: str, field: str = "text", file_for_errors: str = "layout.toml"
    ) -> TokenFileSource:
        """Tokenize ``path`` once (or reuse its fresh cache) and memory-map the tokens.

        Several processes may call this at once: each writes a complete temporary file and renames
        it into place, so a reader sees either no cache or a whole one, never half of one.
        """
        if kind not in ("text", "jsonl"):
            raise LayoutError(file_for_errors, "data.kind", unknown_kind_message(kind))
        _require_file(path, file_for_errors)
        cache = cache_path(path)
        # Stamped before reading: a source edited while it is tokenized is tokenized again next time.
        digest = _cache_digest(path, kind, field)
        tokens = _open_cache(cache, digest)
        if tokens is None:
            _write_cache(cache, path, kind, field, digest, file_for_errors)
            tokens = _open_cache(cache, digest)
            if tokens is None:  # a concurrent writer of a different source version won the rename
                raise RuntimeError(f"token cache '{cache}' changed while it was being read; run again")
        return cls(tokens, path, file_for_errors)

    @property
    def vocab_size(self) -> int:
        return BYTE_VOCAB

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    def require_window(self, length: int) -> None:
        """Raise a located error now, rather than mid-training, if one window does not fit."""
        if length > self.num_tokens:
            raise LayoutError(
                self.file_for_errors,
                "data.path",
                f"file '{self.path}' has {self.num_tokens} tokens, fewer than one window of {length} "
                "tokens (seq_len + 1); give a longer file or a smaller seq_len",
            )

    def require_text(self, length: int) -> None:
        """``require_window``, and some text: a file whose documents are all empty holds only their markers."""
        self.require_window(length)
        if not np.any(self.tokens != END_OF_DOCUMENT):
            raise LayoutError(
                self.file_for_errors,
                "data.path",
                f"file '{self.path}' holds no text: its "
                f"{self.num_tokens} tokens all end empty documents (give documents with text)",
            )

    def sample(self, rng: np.random.Generator, n: int, length: int) -> np.ndarray:
        """``n`` windows of ``length`` consecutive tokens at uniform random offsets, int64 (n, length)."""
        self.require_window(length)
        starts = rng.integers(0, self.num_tokens - length + 1, size=n)
        return self.tokens[starts[:, None] + np.arange(length)].astype(np.int64)


CACHE_ENV = "HETERO_LLM_CACHE"


def cache_path(path: str) -> str:
    """Where the token cache of ``path`` lives: beside it, so it moves and is deleted with it, when its folder is
    writable. Otherwise (a read-only data folder), or whenever ``$HETERO_LLM_CACHE`` names a folder, in that
    folder or else the user cache folder (``$XDG_CACHE_HOME/hetero_llm``, by default ``~/.cache/hetero_llm``),
    under a name made from the source's absolute path."""
    chosen = os.environ.get(CACHE_ENV)
    if not chosen and os.access(os.path.dirname(os.path.abspath(path)), os.W_OK | os.X_OK):
        return f"{path}.tokens.u16"
    folder = chosen or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "hetero_llm")
    key = hashlib.blake2b(os.path.abspath(path).encode(), digest_size=8).hexdigest()
    return os.path.join(folder, f"{os.path.basename(path)}.{key}.tokens.u16")


def _cache_digest(source: str, kind: str, field: str) -> bytes:
    stat = os.stat(source)
    jsonl_field = field if kind == "jsonl" else ""
    recipe = f"{_TOKENIZER_VERSION}|{kind}|{jsonl_field}|{stat.st_size}|{stat.st_mtime_ns}"
    return hashlib.blake2b(recipe.encode(), digest_size=16).digest()


def _open_cache(cache: str, digest: bytes) -> np.ndarray | None:
    """The cached tokens, or None when the cache is missing, stale (another digest) or damaged."""
    try:
        stat = os.stat(cache)
        with open(cache, "rb") as handle:
            header = handle.read(_CACHE_HEADER_BYTES)
    except (FileNotFoundError, NotADirectoryError):  # no cache yet (its folder may not exist either)
        return None
    if len(header) != _CACHE_HEADER_BYTES or header[:8] != _CACHE_MAGIC or header[16:] != digest:
        return None
    count = int.from_bytes(header[8:16], "little")
    if stat.st_size != _CACHE_HEADER_BYTES + count * _CACHE_DTYPE.itemsize:
        return None
    if count == 0:  # mmap refuses an empty range
        return np.zeros(0, dtype=_CACHE_DTYPE)
    return np.memmap(cache, dtype=_CACHE_DTYPE, mode="r", offset=_CACHE_HEADER_BYTES, shape=(count,))


def _write_cache(cache: str, source: str, kind: str, field: str, digest: bytes, file_for_errors: str) -> None:
    """Tokenize ``source`` into ``cache`` atomically: temp file in the same directory, fsync, rename."""
    directory = os.path.dirname(os.path.abspath(cache))
    try:
        os.makedirs(directory, exist_ok=True)
        handle = tempfile.NamedTemporaryFile(
            "wb", dir=directory, prefix=os.path.basename(cache) + ".", suffix=".tmp", delete=False
        )
    except OSError as error:
        raise _data_error(
            file_for_errors,
            f"cannot write the token cache of '{source}' in '{directory}': "
            f"{error.strerror} (set {CACHE_ENV} to a writable folder)",
        ) from None
    try:
        with handle:
            handle.write(b"\x00" * _CACHE_HEADER_BYTES)  # placeholder until the count is known
            chunks = _text_chunks(source) if kind == "text" else _jsonl_chunks(source, field, file_for_errors)
            count = 0
            for chunk in chunks:
                handle.write(np.frombuffer(chunk, dtype=np.uint8).astype(_CACHE_DTYPE).tobytes())
                count += len(chunk)
            handle.seek(0)
            handle.write(_CACHE_MAGIC + count.to_bytes(8, "little") + digest)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(handle.name, cache)
    except BaseException:
        os.unlink(handle.name)
        raise
    fsync_dir(directory)


def _text_chunks(source: str):
    with open(source, "rb") as reader:
        while chunk := reader.read(_WRITE_CHUNK_BYTES):
            yield chunk


def _jsonl_chunks(source: str, field: str, file_for_errors: str):
    """UTF-8 bytes of each document's ``field`` plus END_OF_DOCUMENT, batched into large chunks."""
    pending = bytearray()
    with open(source, "rb") as reader:
        for line_number, line in enumerate(reader, start=1):
            if not line.strip():
                continue
            pending += jsonl_document(line, line_number, source, field, file_for_errors)
            pending.append(END_OF_DOCUMENT)
            if len(pending) >= _WRITE_CHUNK_BYTES:
                yield bytes(pending)
                pending.clear()
    if pending:
        yield bytes(pending)


def jsonl_document(line: bytes, line_number: int, source: str, field: str, file_for_errors: str) -> bytes:
    where = f"file '{source}' line {line_number}"
    try:
        # Without its newline, so a column past the end reads as the end of this line, not line 2.
        record = json.loads(line.rstrip(b"\r\n"))
    except json.JSONDecodeError as error:
        raise _data_error(file_for_errors, f"{where} is not valid JSON ({error.msg} at column {error.colno})") from None
    except UnicodeDecodeError:
        raise _data_error(file_for_errors, f"{where} is not valid UTF-8") from None
    if not isinstance(record, dict):
        raise _data_error(
            file_for_errors, f"{where} is a JSON {type(record).__name__}, expected an object with key '{field}'"
        )
    if field not in record:
        raise _data_error(file_for_errors, f"{where} has no key '{field}' (set data.field to the key holding the text)")
    text = record[field]
    if not isinstance(text, str):
        raise _data_error(file_for_errors, f"{where}: key '{field}' holds a {type(text).__name__}, expected a string")
    return text.encode("utf-8")


def _data_error(file_for_errors: str, message: str) -> LayoutError:
    return LayoutError(file_for_errors, "data.path", message)


_KINDS = ("grammar", "text", "jsonl", "tokens")


def unknown_kind_message(kind: str) -> str:
    expected = ", ".join(f"'{name}'" for name in _KINDS)
    return f"unknown kind '{kind}' (expected one of {expected})"


def _require_file(path: str, file_for_errors: str) -> None:
    if not path:
        raise _data_error(file_for_errors, "no file given (give an existing .txt or .jsonl file)")
    if not os.path.isfile(path):
        raise _data_error(file_for_errors, f"file '{path}' does not exist (give an existing .txt or .jsonl file)")
