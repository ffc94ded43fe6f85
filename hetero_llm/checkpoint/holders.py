"""A restart from snapshots held in several nodes' memory: what each node holds, the step to resume, its copy.

Each node's snapshot folder (``checkpoint.snapshots``: ``ROUND/step-NNNNNN/rankR.pt`` with its ``rankR.json``
record) holds only the files of the ranks that ran on that node. At a restart every node says what it holds
(``held``: the records, with their round and rank); one worker decides over the union of the nodes present
(``choose``: the newest step after the disk's newest save whose rank files, of one round's layout, hold every
parameter block and optimizer slice; a DP replica's copy is as good as a lost rank's) and which node copies each
file; every holder copies its files into the step folder of the shared ``--checkpoint DIR`` (``copy_into``: each
file atomically, its size and sha256 checked against its record while it is copied); once every holder reported
its copy, the chooser writes ``meta.json`` last (``seal``): a complete save, resumed like any other by any layout.
Until then the folder has no ``meta.json`` and is never resumed from. Torch-free.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import attrs

from hetero_llm._fs import write_atomically
from hetero_llm.checkpoint import folders, trust
from hetero_llm.errors import CheckpointError
from hetero_llm.layout import Layout
from hetero_llm.model.params import all_params

CHUNK = 1 << 22  # bytes copied between two progress reports


@attrs.frozen
class Copy:
    """One rank file of a chosen step: which node holds it, where it is there and what it must be."""

    node: str
    round: str  # its round folder in the node's snapshot folder (``<plan fingerprint>-<start step>``)
    step: int
    rank: int  # its rank in the layout that wrote it: ``ROUND/step-NNNNNN/rank{rank}.pt``
    new_rank: int  # its name in the save: ``rank{new_rank}.pt``
    size: int
    sha256: str
    shards: dict[str, list]  # global parameter name -> [shard dim, lo, hi, full shape], as its record says


@attrs.frozen
class Choice:
    """The snapshot step a round resumes from: a subset of its rank files that holds every block."""

    step: int
    files: tuple[Copy, ...]

    @property
    def nodes(self) -> list[str]:
        """The nodes that copy a file, each once, in the order of the files."""
        return list(dict.fromkeys(f.node for f in self.files))

    def to_json(self) -> str:
        return json.dumps({"step": self.step, "files": [attrs.asdict(f) for f in self.files]})

    @staticmethod
    def from_json(text: str) -> Choice:
        value = json.loads(text)
        return Choice(value["step"], tuple(Copy(**f) for f in value["files"]))


def held(base: Path, key: bytes) -> list[dict]:
    """What a node's snapshot folder ``base`` holds: every rank file with a record that the run's ``key`` vouches
    for (``trust.vouched``) and whose ``.pt`` has the size the record says, as the record plus its ``round`` and
    ``rank`` (JSON-ready, for the round's store). A record the key does not vouch for is removed with its file, in
    one line on stderr: this run did not write it."""
    found = []
    for path in sorted(base.glob(f"*/{folders.STEP_PREFIX}*/rank*.json")) if base.is_dir() else ():
        try:
            record = json.loads(path.read_text())
            size = path.with_suffix(".pt").stat().st_size
            rank = int(path.stem[len("rank") :])
        except (OSError, ValueError):
            continue
        if not isinstance(record, dict):
            continue
        if not trust.vouched(key, record, f"{path.parent.parent.name}/{path.parent.name}/{path.stem}"):
            path.unlink(missing_ok=True)
            path.with_suffix(".pt").unlink(missing_ok=True)
            print(
                f"elastic: {path.with_suffix('.pt')}: removed, never resumed: its record is not vouched for by this "
                f"run's key (--checkpoint DIR/{trust.KEY}): another user's file, or another run's",
                file=sys.stderr,
            )
            continue
        if size == record.get("bytes"):
            found.append(
                {**{k: v for k, v in record.items() if k != "mac"}, "round": path.parent.parent.name, "rank": rank}
            )
        else:
            print(
                f"elastic: {path.with_suffix('.pt')}: skipped, incomplete: {size} bytes, its record says "
                f"{record.get('bytes')}",
                file=sys.stderr,
            )
    return found


def skipped(
    held_by_node: Mapping[str, Sequence[dict]], lay: Layout, newer_than: int, choice: Choice | None
) -> list[str]:
    """Why each snapshot step held by the nodes present (``held_by_node``, as ``choose`` takes it) newer than the
    one chosen (``choice``; None: every one) is not resumed, a line each: not newer than the disk's save (step
    ``newer_than``), or incomplete over the nodes present (which ranks no node present holds: their holders lost,
    or which block none of the files holds)."""
    shapes = {p.name: tuple(p.shape) for p in all_params(lay.model)}
    steps: dict[tuple[int, str], dict[int, tuple[str, dict]]] = {}
    for node, records in held_by_node.items():
        for record in records:
            steps.setdefault((record["step"], record["round"]), {}).setdefault(record["rank"], (node, record))
    lines = []
    for (step, round_), files in sorted(steps.items(), reverse=True):
        if choice is not None and step <= choice.step:
            continue
        nodes = ", ".join(dict.fromkeys(node for node, _ in files.values()))
        if step <= newer_than:
            why = f"older: not newer than the disk's save of step {newer_than}"
        else:
            world = max(int(r.get("world_size", 0)) for _, r in files.values())
            lost = sorted(set(range(world)) - set(files))
            held = {n: [_coords(r["shards"][n]) for _, r in files.values() if n in r["shards"]] for n in shapes}
            gap = next((g for n in shapes if (g := folders.uncovered(n, shapes[n], held[n]))), None)
            parts = [f"rank(s) {', '.join(map(str, lost))} of its {world} held by no node present (holder lost)"]
            parts = (parts if lost else []) + ([f"{gap} is in no file held"] if gap else [])
            why = "incomplete: " + ("; ".join(parts) or "not one round's every block")
        lines.append(f"elastic: the snapshot of step {step} (round {round_}) held on {nodes} is skipped: {why}")
    return lines


def choose(held_by_node: Mapping[str, Sequence[dict]], lay: Layout, newer_than: int) -> Choice | None:
    """The newest step after ``newer_than`` whose rank files, over every node of ``held_by_node`` (name -> what
    ``held`` found there, in the cluster file's order), hold every parameter (and so every optimizer slice: the
    moments are saved with the same coordinates) of one round's layout; of those files a subset that still holds
    every block (a replica's copy is left out), each copied by the first node that lists it. None: no such step."""
    shapes = {p.name: tuple(p.shape) for p in all_params(lay.model)}
    by_file: dict[tuple[str, int, int], tuple[str, dict]] = {}
    for node, records in held_by_node.items():
        for record in records:
            by_file.setdefault((record["round"], record["step"], record["rank"]), (node, record))
    for step, round_ in sorted({(step, round_) for round_, step, _ in by_file}, reverse=True):
        if step <= newer_than:
            break
        files = _needed([by_file[key] for key in sorted(by_file) if key[:2] == (round_, step)], shapes)
        if files is None:
            continue
        return Choice(
            step,
            tuple(
                Copy(node, round_, step, r["rank"], i, r["bytes"], r["sha256"], r["shards"])
                for i, (node, r) in enumerate(files)
            ),
        )
    return None


def _needed(files: list[tuple[str, dict]], shapes: dict[str, tuple[int, ...]]) -> list[tuple[str, dict]] | None:
    """Of ``files`` (node, record), a subset that still holds every element of every tensor of ``shapes`` (the last
    files dropped first whenever the others hold all they hold); None when all of them together do not."""
    held: dict[str, dict[int, folders.Coords]] = {name: {} for name in shapes}  # name -> file index -> its shard
    for i, (_, record) in enumerate(files):
        for name, c in record["shards"].items():
            if name in held:
                held[name][i] = _coords(c)
    if any(folders.uncovered(name, shapes[name], list(held[name].values())) for name in shapes):
        return None
    kept = set(range(len(files)))
    for i in reversed(range(len(files))):
        names = [n for n in files[i][1]["shards"] if n in held]
        others = {n: [c for j, c in held[n].items() if j != i and j in kept] for n in names}
        if len(kept) > 1 and not any(folders.uncovered(n, shapes[n], others[n]) for n in names):
            kept.discard(i)
    return [f for i, f in enumerate(files) if i in kept]


def _coords(c: list) -> folders.Coords:
    return (c[0], c[1], c[2], tuple(c[3]))


def begin(folder: Path) -> bool:
    """Make step folder ``folder`` of ``--checkpoint DIR`` ready for a choice's copies: empty (what an interrupted
    save left there goes) and without ``meta.json``. False when it holds a complete save already (then that save
    is at least as new: the choice is not needed)."""
    if (folder / folders.META).exists():
        return False
    folders.begin_save(folder)  # refuses a symbolic link, makes the folder
    for leftover in folder.iterdir():
        leftover.unlink()
    return True


def copy_into(base: Path, folder: Path, files: Sequence[Copy], progress: Callable[[int], object]) -> None:
    """Copy ``files`` (one node's share of a choice) from its snapshot folder ``base`` into step folder ``folder``,
    each through a temporary name and a rename, renamed only once its bytes had the size and sha256 of its record;
    ``progress(bytes)`` after each chunk. Raises ``CheckpointError`` naming the file that is not what was recorded."""
    for f in files:
        source = folders.rank_file(folders.step_folder(base / f.round, f.step), f.rank)
        target = folders.rank_file(folder, f.new_rank)

        def write(out, source: Path = source, f: Copy = f) -> None:
            digest, size = hashlib.sha256(), 0
            with open(source, "rb") as src:
                while chunk := src.read(CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
                    size += len(chunk)
                    progress(len(chunk))
            if (size, digest.hexdigest()) != (f.size, f.sha256):
                raise CheckpointError(
                    str(source),
                    "",
                    f"{size} bytes with sha256 {digest.hexdigest()[:12]}, but its record says {f.size} bytes, "
                    f"sha256 {f.sha256[:12]} (changed since it was written)",
                )

        write_atomically(target, write)


def unsealed(folder: Path, choice: Choice, lay: Layout) -> folders.Checkpoint:
    """The save ``seal`` would make of ``folder`` (every file of ``choice`` copied into it), as ``folders.find``
    would read it once sealed: what the checks ``--resume`` makes are run on before it is sealed."""
    shapes = {p.name: tuple(p.shape) for p in all_params(lay.model)}
    return folders.Checkpoint(folder, choice.step, len(choice.files), shapes, lay.file, _records(choice))


def seal(folder: Path, choice: Choice, lay: Layout) -> None:
    """Mark ``folder`` (every file of ``choice`` copied into it) a complete save: ``meta.json`` with each file's
    size, sha256 and shards, then ``latest``."""
    folders.finish_save(folder, choice.step, len(choice.files), lay, _records(choice))


def _records(choice: Choice) -> dict[str, folders.RankFile]:
    return {
        folders.rank_file(Path(), f.new_rank).name: folders.RankFile(
            f.size, f.sha256, {name: _coords(c) for name, c in f.shards.items()}
        )
        for f in choice.files
    }


def remove_partial(folder: Path) -> None:
    """Remove what an abandoned choice copied into ``folder`` (never a complete save)."""
    if (folder / folders.META).exists() or not folder.is_dir():
        return
    for leftover in folder.iterdir():
        leftover.unlink(missing_ok=True)
    try:
        os.rmdir(folder)
    except OSError:  # a late copy renamed a file into it: no meta.json, never resumed; the next save empties it
        pass
