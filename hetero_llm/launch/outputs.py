"""A run's output paths, checked before any rank starts: writable, and never one of the run's inputs.

A run writes ``--metrics-jsonl FILE`` (the reporting rank, every step), ``--checkpoint DIR`` (every rank,
at each save), ``--trace DIR`` (every rank, every step) and ``--tensorboard DIR``. Found unwritable only at the
first save, or pointing at the layout the run was started from, they would cost the run or destroy its input; so
the CLI checks them here, before it forks a rank. Every other command's outputs go through the same checks:
``check_output_file`` (hetero-place -o, hetero-plan -o / --profile, hetero-tokenize -o, the timeline's files) and
``check_output_folder`` (hetero-export --hf). An output is refused when it would write over any file the command
reads (or into a folder it reads, such as model.init_from), when it or a file it writes in its folder is a
symbolic link (writes never follow a link the program did not make), or when it cannot be written.
Torch-free; the only side effect is a probe file created and removed in each output's nearest existing folder.
"""

from __future__ import annotations

import errno
import os
import re
import tempfile
from pathlib import Path

from hetero_llm.checkpoint import folders as checkpoint_mod
from hetero_llm.errors import ENVIRONMENT, CheckpointError, LayoutError
from hetero_llm.layout import Layout

STEP_FOLDER = re.compile(re.escape(checkpoint_mod.STEP_PREFIX) + r"\d+")
TRACE_FILE = re.compile(r"rank\d+\.jsonl?(\.tmp)?")  # the rank files trace.py writes (and wrote before streaming)
SAVE_FILE = re.compile(r"(rank\d+\.pt|meta\.json)(\.tmp)?")  # the files of a step folder (checkpoint.py)
# The files an output folder's flag writes directly in it (--checkpoint: see _writes); what a link there would redirect.
FOLDER_FILES = {
    "--trace": TRACE_FILE,
    "--tensorboard": re.compile(r"events\.out\.tfevents\..*"),  # SummaryWriter's event files
    "--hf": re.compile(r"(config\.json|model\.safetensors|tokenizer(_config)?\.json)(\.tmp)?"),
}  # hf.export


def check_run_paths(
    layout: Layout | list[tuple[str, str]],
    metrics: str | None,
    checkpoint: str | None,
    trace: str | None,
    resume: str | None,
    tensorboard: str | None = None,
) -> None:
    """Raise a located ``LayoutError`` for the first output that cannot be written, would overwrite an input
    (any file or folder the layout reads: ``layout_inputs``; or the inputs given as (what, path), as an elastic
    worker gives its cluster file's before any round plans a layout), would write into the save being resumed,
    shares its path with another output, or would write through a symbolic link."""
    inputs = layout_inputs(layout) if isinstance(layout, Layout) else layout
    if resume and Path(resume).exists() and not Path(resume).is_dir():
        raise CheckpointError(resume, "--resume", f"is a file, not a folder ({checkpoint_mod.FIX})")
    outputs = [
        (flag, path, folder)
        for flag, path, folder in (
            ("--metrics-jsonl", metrics, False),
            ("--checkpoint", checkpoint, True),
            ("--trace", trace, True),
            ("--tensorboard", tensorboard, True),
        )
        if path
    ]
    for flag, path, folder in outputs:
        _check_kind(flag, path, folder)
    for i, (flag, path, _) in enumerate(outputs):
        first = next((other for other, earlier, _ in outputs[:i] if same_path(earlier, path)), None)
        if first:
            raise LayoutError(path, flag, f"is also the path of {first} (give each output its own path)")
    for flag, path, _ in outputs:
        _check_inputs(flag, path, inputs)
    for flag, path, folder in outputs if resume else ():
        if _in_save(path, str(resume)):
            what = "would write into" if folder else "is a file of"
            raise LayoutError(
                path, flag, f"{what} the --resume checkpoint '{resume}' (an input of this run; give another path)"
            )
    for flag, path, _ in outputs:
        if flag != "--metrics-jsonl" and metrics and _writes(flag, path, metrics):
            raise LayoutError(metrics, "--metrics-jsonl", f"is a file that {flag} {path} writes (give another path)")
    for flag, path, folder in outputs:
        _check_links(flag, path, folder)
        _check_writable(flag, path, folder)


def check_output_file(flag: str, path: str, inputs: list[tuple[str, str]]) -> None:
    """One output file on its own (``hetero-place -o``, ``hetero-plan -o`` / ``--profile``, ``hetero-tokenize -o``):
    a file path, none of ``inputs`` (what, path; a folder: nothing inside it), not a symbolic link, writable."""
    _check_kind(flag, path, folder=False)
    _check_inputs(flag, path, inputs)
    _check_links(flag, path, folder=False)
    _check_writable(flag, path, folder=False)


def check_output_folder(flag: str, path: str, inputs: list[tuple[str, str]]) -> None:
    """One output folder on its own (``hetero-export --hf``): a folder path, not one of ``inputs`` nor inside an
    input folder, no file it writes (``FOLDER_FILES[flag]``) an input or a symbolic link, writable."""
    _check_kind(flag, path, folder=True)
    _check_inputs(flag, path, inputs)
    _check_links(flag, path, folder=True)
    _check_writable(flag, path, folder=True)


def _check_inputs(flag: str, path: str, inputs: list[tuple[str, str]]) -> None:
    for what, source in inputs:
        if _writes(flag, path, source):
            raise _overwrites(flag, path, what, source)


def _overwrites(flag: str, path: str, what: str, source: str) -> LayoutError:
    verb = "write into" if os.path.isdir(source) else "overwrite"
    return LayoutError(path, flag, f"would {verb} {what} '{source}', an input of this run (give another path)")


def layout_inputs(layout: Layout) -> list[tuple[str, str]]:
    """Every file and folder a run of ``layout`` reads, as (its key, its path): the layout file, [data]'s files,
    model.init_from and every schedule file (of [[pipelines]] and of each bucket's)."""
    found = [("the layout file", layout.file), *spec_inputs(layout.model, layout.data)]
    found += [
        (f"pipelines[{i}].schedule_file", p.schedule_file) for i, p in enumerate(layout.pipelines) if p.schedule_file
    ]
    found += [
        (f"buckets[{b}].pipelines[{i}].schedule_file", p.schedule_file)
        for b, bucket in enumerate(layout.buckets)
        for i, p in enumerate(bucket.pipelines)
        if p.schedule_file
    ]
    return found


def spec_inputs(model, data, base: str | os.PathLike = "") -> list[tuple[str, str]]:
    """The paths a [model] and [data] read (data.path, valid_path, tokenizer; model.init_from, a folder), taken
    relative to ``base`` (a layout's are already resolved; a cluster file's are relative to its folder)."""
    paths = [
        ("data.path", data.path),
        ("data.valid_path", data.valid_path),
        ("data.tokenizer", data.tokenizer if data.tokenizer != "bytes" else ""),
        ("model.init_from", model.init_from),
    ]
    return [(key, str(Path(base) / path)) for key, path in paths if path]


def cluster_inputs(cluster, profile_file: str | None = None, plan_profile: bool = True) -> list[tuple[str, str]]:
    """What ``hetero-plan`` reads of a planner cluster (``planner.cluster.Cluster``): the cluster file, the paths of
    its [model] and [data], its plan.profile (unless ``plan_profile`` is False: ``--profile`` adds to it) and
    ``--profile-file``."""
    base = Path(cluster.file).parent
    found = [("the cluster file", cluster.file), *spec_inputs(cluster.model, cluster.data, base)]
    if plan_profile and cluster.limits.profile:
        found.append(("plan.profile", str(base / cluster.limits.profile)))
    if profile_file:
        found.append(("--profile-file", profile_file))
    return found


def same_path(a: str | Path, b: str | Path) -> bool:
    """Whether ``a`` and ``b`` name one file (links and ``..`` resolved)."""
    return os.path.realpath(a) == os.path.realpath(b)


def _inside(path: str, folder: str) -> bool:
    real, root = os.path.realpath(path), os.path.realpath(folder)
    return real.startswith(root.rstrip(os.sep) + os.sep)


def _writes(flag: str, output: str, path: str) -> bool:
    """Whether the output ``flag`` names would write the file ``path``, or write anything into the folder ``path``."""
    if os.path.isdir(path) and (same_path(output, path) or _inside(output, path)):
        return True  # into an input folder (model.init_from, a checkpoint read), or a folder inside it
    if flag not in ("--checkpoint", *FOLDER_FILES):  # a file
        return same_path(output, path)
    real, root = Path(os.path.realpath(path)), os.path.realpath(output)
    if str(real.parent) == root:  # DIR/rank0.jsonl; --checkpoint: DIR/latest, DIR/step-NNNNNN/...
        return _written_name(flag, real.name)
    if flag in FOLDER_FILES:
        return False
    return _inside(str(real), root) and STEP_FOLDER.fullmatch(real.relative_to(root).parts[0]) is not None


def _in_save(path: str, resume: str) -> bool:
    """Whether ``path`` is, or is inside, the step folder ``resume`` names, or one of checkpoint root ``resume``'s
    step folders or its ``latest`` (beside the saves of a root is fine: a resumed run saves there too)."""
    real, root = os.path.realpath(path), os.path.realpath(resume)
    if STEP_FOLDER.fullmatch(Path(root).name):
        return real == root or _inside(real, root)
    if os.path.dirname(real) == root and _written_name("--checkpoint", os.path.basename(real)):
        return True
    return _inside(real, root) and STEP_FOLDER.fullmatch(Path(real).relative_to(root).parts[0]) is not None


def check_snapshot_folder(folder: Path) -> None:
    """``--snapshot-every``'s folder in node memory (``$HETERO_SHM_DIR`` or /dev/shm) can be made and written: one
    line before anything starts, not at the first snapshot after a step. (The folder in it, which another user may
    have planted, is checked where it is made: checkpoint/trust.py.)"""
    problem = _unwritable(folder.parent)
    if problem:
        raise LayoutError(
            ENVIRONMENT,
            "HETERO_SHM_DIR",
            f"'{folder.parent}': --snapshot-every cannot write its snapshots there: {problem[0]} (give a writable "
            "folder, or unset it for /dev/shm)",
        )


def _check_kind(flag: str, path: str, folder: bool) -> None:
    p = Path(path)
    if folder and p.exists() and not p.is_dir():
        raise LayoutError(path, flag, "is a file, not a folder (give a folder to write into)")
    if not folder and p.is_dir():
        example = f", e.g. {p / 'metrics.jsonl'}" if flag == "--metrics-jsonl" else ""
        raise LayoutError(path, flag, f"is a folder, not a file (give a file path{example})")


def _check_links(flag: str, path: str, folder: bool) -> None:
    """Writes never follow a symbolic link they did not make: not the output itself, nor any file it writes in
    its folder (a planted DIR/rank0.jsonl, a step folder DIR/step-000005 or DIR/latest that is a link)."""
    if os.path.islink(path):
        raise LayoutError(
            path,
            flag,
            f"is a symbolic link to '{os.readlink(path)}' (writes never follow one: give "
            "the path it points to, or remove the link)",
        )
    if not folder or not os.path.isdir(path):
        return
    written = [entry for entry in sorted(Path(path).iterdir()) if _written_name(flag, entry.name)]
    if flag == "--checkpoint":  # and the files of its step folders
        written += [
            file
            for entry in written
            if STEP_FOLDER.fullmatch(entry.name) and not entry.is_symlink() and entry.is_dir()
            for file in sorted(entry.iterdir())
            if SAVE_FILE.fullmatch(file.name)
        ]
    for entry in written:
        if entry.is_symlink():
            raise LayoutError(
                str(entry),
                flag,
                f"is a symbolic link to '{os.readlink(entry)}' in the folder {flag} "
                "writes into (writes never follow one: remove the link, or give another folder)",
            )


def _written_name(flag: str, name: str) -> bool:
    """Whether the output folder of ``flag`` writes an entry ``name`` directly in it."""
    if flag == "--checkpoint":
        return (
            name in (checkpoint_mod.LATEST, checkpoint_mod.LATEST + checkpoint_mod.TMP)
            or STEP_FOLDER.fullmatch(name) is not None
        )
    return FOLDER_FILES[flag].fullmatch(name) is not None


def _check_writable(flag: str, path: str, folder: bool) -> None:
    p = Path(path).absolute()
    if not folder and p.exists():
        try:
            # appends nothing: the file is kept as it is; a named pipe without a reader is refused, not waited on
            os.close(os.open(p, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK))
        except OSError as e:
            if e.errno == errno.ENXIO:  # (O_NONBLOCK on a FIFO that no process has open for reading)
                raise LayoutError(path, flag, "is a named pipe (FIFO) that nothing reads (give a file path)") from None
            raise LayoutError(path, flag, f"cannot write it: {e.strerror} (give a writable path)") from None
        return
    problem = _unwritable(p if folder and p.is_dir() else p.parent)
    if problem:
        raise LayoutError(path, flag, f"{problem[0]} ({problem[1]})")


def _unwritable(p: Path) -> tuple[str, str] | None:
    """Why no file can be made in folder ``p``, or under it once its missing folders are made (the nearest
    existing one is probed), and the fix; None when one can."""
    existing = p
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"'{existing}' is a file, so no folder can be made under it", "give another path"
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".hetero_llm_probe_")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"cannot write in '{existing}': {e.strerror}", "give a writable path"
    return None
