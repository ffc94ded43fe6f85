"""Where an elastic round resumes, agreed over the round's store: the disk's newest save, or a snapshot step held
in the memory of the nodes present (``checkpoint.holders``), copied by its holders into ``--checkpoint DIR``.

Keys of the round's store (fresh every round), in the order they are written:

    held/NODE       one worker per node (local rank 0): what its node's snapshot folder holds (``holders.held``)
    copy            torchrun's rank 0 (the chooser): the chosen step and which node copies which file, or null
    copying/NODE    bytes a holder copied so far (its progress: the chooser waits while it grows)
    copied/NODE     a holder's outcome: empty when its files are in the save folder, verified; else why not
    resume          the chooser: [save folder or null, words for the round line, whether the nodes keep their
                    snapshots]; the chooser writes the save's meta.json before it, after every holder's copy
    cleaned         a count: one per node, once its snapshot folder is emptied; the last sets all-cleaned, which
                    every worker waits for (no rank writes this round's snapshots before every node cleaned)
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from hetero_llm.checkpoint import folders, holders
from hetero_llm.errors import RankFailure
from hetero_llm.launch import external
from hetero_llm.layout import Layout

POLL_S = 0.2
MEMORY = " from a snapshot in memory"  # what the round line adds when it resumes from one


def agree(
    store,
    rank: int,
    members: Sequence[tuple[str, int]],
    lay: Layout,
    checkpoint: str,
    snapshots: Path | None,
    key: bytes | None,
    timeout_s: float,
) -> tuple[str | None, str]:
    """This worker's part (``rank``: torchrun's; ``members``: every worker's (node, local rank)) in choosing the
    save the round resumes from; that save's folder (None: start at step 0) and the words the round line adds.
    ``snapshots``: this node's snapshot folder (None: no snapshots), ``key``: the run's snapshot key, which vouches
    for the snapshots it wrote (``checkpoint.trust``). ``timeout_s``: how long a holder may copy
    nothing before the chooser gives up on it (the round then resumes from the disk save)."""
    node, local = members[rank]
    if snapshots is None or key is None:  # disk saves only: the chooser's word
        if rank == 0:
            store.set("resume", json.dumps([external.resume_auto(checkpoint, lay), "", False]))
        resume, source, _ = json.loads(store.get("resume"))
        return resume, source
    nodes = list(dict.fromkeys(n for n, _ in members))
    if local == 0:
        store.set(f"held/{node}", json.dumps(holders.held(snapshots, key)))
    if rank == 0:
        disk = external.resume_auto(checkpoint, lay)
        held = {n: json.loads(store.get(f"held/{n}")) for n in nodes}
        disk_step = folders.find(disk).step if disk else -1
        choice = holders.choose(held, lay, disk_step)
        for line in holders.skipped(held, lay, disk_step, choice):  # every snapshot passed over says why
            sys.stderr.write(f"{line}; resuming from {_where(choice, disk)}\n")
        if choice is not None and not holders.begin(folders.step_folder(checkpoint, choice.step)):
            choice = None
        store.set("copy", choice.to_json() if choice else "null")
    text = store.get("copy").decode()  # the chooser's look at what is held takes no time to speak of
    choice = None if text == "null" else holders.Choice.from_json(text)
    folder = folders.step_folder(checkpoint, choice.step) if choice else None
    if choice and folder and node in choice.nodes and local == 0:
        _copy_share(store, node, snapshots, folder, choice)
    if rank == 0:
        store.set("resume", json.dumps(_decide(store, lay, checkpoint, choice, disk, timeout_s)))
    progress = [f"copying/{n}" for n in choice.nodes] if choice else []
    reply = _wait_key(store, "resume", progress, 2 * timeout_s + 10)
    if reply is None:
        raise RankFailure(f"elastic: worker 0 (node {members[0][0]}) chose no save to resume within {timeout_s:g} s")
    resume, source, keep = json.loads(reply)
    if local == 0:
        if not keep:  # the choice is on disk (or nothing held was newer): nothing in memory is needed any more
            for snapshot in snapshots.iterdir():  # emptied, not removed: the folder's name stays this user's
                shutil.rmtree(snapshot, ignore_errors=True)
        if store.add("cleaned", 1) == len(nodes):
            store.set("all-cleaned", "")
    if _wait_key(store, "all-cleaned", [], timeout_s) is None:  # no rank writes snapshots before every node cleaned
        raise RankFailure(f"elastic: not every node emptied its snapshot folder within {timeout_s:g} s")
    return resume, source


def _where(choice: holders.Choice | None, disk: str | None) -> str:
    """Where a round resumes from, in words (for the lines of what it skipped)."""
    return f"the snapshot of step {choice.step} instead" if choice else f"{disk or 'step 0'} instead"


def _copy_share(store, node: str, snapshots: Path, folder: Path, choice: holders.Choice) -> None:
    """A holder's part: copy the files of ``choice`` that ``node`` holds into ``folder``, then say how it went."""
    try:
        holders.copy_into(
            snapshots, folder, [f for f in choice.files if f.node == node], lambda n: store.add(f"copying/{node}", n)
        )
        outcome = ""
    except Exception as e:  # a file gone, changed, or the disk full: the chooser falls back to the disk save
        outcome = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    store.set(f"copied/{node}", outcome)


def _decide(
    store, lay: Layout, checkpoint: str, choice: holders.Choice | None, disk: str | None, timeout_s: float
) -> list:
    """The chooser's last word, once every holder copied (``meta.json`` written last) or one failed or went
    silent for ``timeout_s`` (the partial copy removed, the disk save taken, the snapshots kept)."""
    if choice is None:
        return [disk, "", False]
    folder = folders.step_folder(checkpoint, choice.step)
    for node in choice.nodes:
        outcome = _wait_key(store, f"copied/{node}", [f"copying/{node}"], timeout_s)
        why = f"node {node} copied nothing for {timeout_s:g} s" if outcome is None else outcome.decode()
        if why:
            holders.remove_partial(folder)
            sys.stderr.write(
                f"elastic: the snapshot of step {choice.step} could not be copied into {folder} ({why}); "
                f"resuming from {disk or 'step 0'} instead\n"
            )
            return [disk, "", True]
    refused = _refusal(folder, choice, lay)
    if refused:  # never sealed: it would fail every later resume; dropped from memory too, or chosen again
        holders.remove_partial(folder)
        sys.stderr.write(
            f"elastic: the snapshot of step {choice.step} is refused ({refused}); removed from {folder} and from "
            f"the nodes' memory, resuming from {disk or 'step 0'} instead\n"
        )
        return [disk, "", False]
    holders.seal(folder, choice, lay)
    return [str(folder), f"{MEMORY} held on {', '.join(choice.nodes)}", False]


def _refusal(folder: Path, choice: holders.Choice, lay: Layout) -> str:
    """Why the save ``choice`` copied into ``folder`` would be refused by ``--resume`` (every check it makes: the
    steps left, shapes, tensors only, finite values), or ""."""
    from hetero_llm.checkpoint import shards  # torch: this module is torch-free

    try:
        unsealed = holders.unsealed(folder, choice, lay)
        folders.check_fits(unsealed, lay)
        shards.check_resumable(unsealed)
    except Exception as e:  # CheckpointError, or a file a record vouched for that is not a rank file at all
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return ""


def _wait_key(store, key: str, progress: Sequence[str], silence_s: float | None) -> bytes | None:
    """The value of ``key`` once it is set; None once the counters ``progress`` did not grow for ``silence_s``
    (None: wait as long as the store lives). The store gone (its worker ended) is one line. (Polled: the store's
    own ``wait`` with a timeout logs a warning each time it times out.)"""
    last, deadline, pause = -1, None if silence_s is None else time.monotonic() + silence_s, POLL_S / 64
    while True:
        try:
            if store.check([key]):
                return store.get(key)
            done = sum(store.add(k, 0) for k in progress)
        except Exception:  # the store's process (torchrun's rank 0) ended: its round failed
            raise RankFailure(f"elastic: this round's store went away while waiting for '{key}'") from None
        if done != last and silence_s is not None:
            last, deadline = done, time.monotonic() + silence_s
        elif deadline is not None and time.monotonic() > deadline:
            return None
        time.sleep(pause)
        pause = min(POLL_S, 2 * pause)  # a quick answer is seen quickly, a long copy polled at POLL_S
