"""A run's output paths, checked before any rank starts: writable, and never one of the run's inputs.

A run writes ``--metrics-jsonl FILE`` (the reporting rank, every step), ``--checkpoint DIR`` (every rank,
at each save) and ``--trace DIR`` (every rank, every step). Found unwritable only at the first save, or
pointing at the layout the run was started from, they would cost the run or destroy its input; so the CLI
checks them here, before it forks a rank (``hetero-place -o`` and the timeline's files: ``check_output_file``).
Torch-free; the only side effect is a probe file created and removed in each output's nearest existing folder.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Sequence

from hetero_llm.checkpoint import folders as checkpoint_mod
from hetero_llm.errors import CheckpointError, LayoutError
from hetero_llm import layout as layout_mod
from hetero_llm.layout import Layout, Packing

STEP_FOLDER = re.compile(re.escape(checkpoint_mod.STEP_PREFIX) + r"\d+")
TRACE_FILE = re.compile(r"rank\d+\.jsonl?(\.tmp)?")  # the rank files trace.py writes (and wrote before streaming)


def check_run_paths(layout: Layout, metrics: str | None, checkpoint: str | None, trace: str | None,
                    resume: str | None) -> None:
    """Raise a located ``LayoutError`` for the first output that cannot be written or would overwrite an input."""
    if resume and Path(resume).exists() and not Path(resume).is_dir():
        raise CheckpointError(resume, "--resume", f"is a file, not a folder ({checkpoint_mod.FIX})")
    outputs = [(flag, path, folder) for flag, path, folder in (("--metrics-jsonl", metrics, False),
                                                               ("--checkpoint", checkpoint, True),
                                                               ("--trace", trace, True)) if path]
    for flag, path, folder in outputs:
        _check_kind(flag, path, folder)
    inputs = _inputs(layout)
    for flag, path, _ in outputs:
        for what, source in inputs:
            if _writes(flag, path, source):
                raise _overwrites(flag, path, what, source)
    if metrics and resume and (_writes("--checkpoint", resume, metrics) or  # a file of a save under a root
                               _inside(metrics, resume) and STEP_FOLDER.fullmatch(Path(resume).resolve().name)):
        raise LayoutError(metrics, "--metrics-jsonl", f"is a file of the --resume checkpoint '{resume}' (an input "
                          "of this run; give another path)")
    for flag, path, _ in outputs:
        if flag != "--metrics-jsonl" and metrics and _writes(flag, path, metrics):
            raise LayoutError(metrics, "--metrics-jsonl", f"is a file that {flag} {path} writes (give another path)")
    for flag, path, folder in outputs:
        _check_writable(flag, path, folder)


def check_output_file(flag: str, path: str, inputs: list[tuple[str, str]]) -> None:
    """One output file on its own (``hetero-place -o``): a file path, none of ``inputs`` (what, path), writable."""
    _check_kind(flag, path, folder=False)
    for what, source in inputs:
        if _same(path, source):
            raise _overwrites(flag, path, what, source)
    _check_writable(flag, path, folder=False)


def _overwrites(flag: str, path: str, what: str, source: str) -> LayoutError:
    return LayoutError(path, flag, f"would overwrite {what} '{source}', an input of this run (give another path)")


def _inputs(layout: Layout) -> list[tuple[str, str]]:
    found = [("the layout file", layout.file)]
    if layout.data.path:
        found.append(("data.path", layout.data.path))
    found += [(f"pipelines[{i}].schedule_file", p.schedule_file) for i, p in enumerate(layout.pipelines)
              if p.schedule_file]
    return found


def _same(a: str | Path, b: str | Path) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _inside(path: str, folder: str) -> bool:
    real, root = os.path.realpath(path), os.path.realpath(folder)
    return real.startswith(root.rstrip(os.sep) + os.sep)


def _writes(flag: str, output: str, path: str) -> bool:
    """Whether the output ``flag`` names would write the file ``path``."""
    if flag == "--metrics-jsonl":
        return _same(output, path)
    real, root = Path(os.path.realpath(path)), os.path.realpath(output)
    if flag == "--trace":
        return str(real.parent) == root and TRACE_FILE.fullmatch(real.name) is not None
    if str(real.parent) == root:  # --checkpoint: DIR/latest, DIR/step-NNNNNN/...
        return (real.name in (checkpoint_mod.LATEST, checkpoint_mod.LATEST + ".tmp")
                or STEP_FOLDER.fullmatch(real.name) is not None)
    return _inside(str(real), root) and STEP_FOLDER.fullmatch(real.relative_to(root).parts[0]) is not None


def _check_kind(flag: str, path: str, folder: bool) -> None:
    p = Path(path)
    if folder and p.exists() and not p.is_dir():
        raise LayoutError(path, flag, "is a file, not a folder (give a folder to write into)")
    if not folder and p.is_dir():
        example = f", e.g. {p / 'metrics.jsonl'}" if flag == "--metrics-jsonl" else ""
        raise LayoutError(path, flag, f"is a folder, not a file (give a file path{example})")


def _check_writable(flag: str, path: str, folder: bool) -> None:
    p = Path(path).absolute()
    if not folder and p.exists():
        try:
            os.close(os.open(p, os.O_WRONLY | os.O_APPEND))  # appends nothing: the file is kept as it is
        except OSError as e:
            raise LayoutError(path, flag, f"cannot write it: {e.strerror} (give a writable path)") from None
        return
    existing = p if folder and p.is_dir() else p.parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise LayoutError(path, flag, f"'{existing}' is a file, so no folder can be made under it (give another path)")
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".hetero_llm_probe_")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise LayoutError(path, flag, f"cannot write in '{existing}': {e.strerror} (give a writable path)") from None


def load_layout(path: str | os.PathLike, overrides: Sequence[str] = ()) -> Layout:
    """The layout at ``path`` (with ``--set`` overrides), with every check that reads no data: the TOML's keys and
    values (layout.load) and the files it names that must match it (``init_from``'s config.json)."""
    lay = layout_mod.load(path, overrides)
    check_init_from(lay)
    return lay


def check_init_from(lay: Layout) -> None:
    """``model.init_from``'s config.json against [model]: a located ``LayoutError`` for the first difference
    (torch-free: reads config.json only; the weights are read by each rank, its slices only)."""
    if lay.model.init_from:
        from hetero_llm.interop import hf

        hf.check_config(lay)


def check_init_weights(lay: Layout, resume: str | None) -> None:
    """``model.init_from``'s weights read once, before any rank starts: a tensor holding NaN or infinite values
    is named here (a resumed run takes its parameters from the checkpoint instead)."""
    if lay.model.init_from and not resume:
        from hetero_llm.interop import hf

        hf.check_weights(lay)


def checked_source(lay: Layout):
    """The layout's data source, refused now if it cannot give one window of text or holds ids outside
    model.vocab (rather than in every rank)."""
    from hetero_llm.data import batches as data
    from hetero_llm.data import text_cache as textcache
    from hetero_llm.data import token_files as tokenfiles

    source = data.make_source(lay.data, lay.file)
    if lay.data.packing is Packing.DOCUMENTS:  # whole documents, however short: found now, or why not
        from hetero_llm.data import held_out as evaluate

        evaluate.document_sources(lay.data, lay.model.seq_len, lay.file)  # and the held-out ones
    elif isinstance(source, textcache.TokenFileSource):
        source.require_text(lay.model.seq_len + 1)
    tokenfiles.check_vocab(source, lay.model.vocab, lay.file)
    return source
