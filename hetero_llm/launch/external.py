"""Processes that another launcher started: torchrun (``torch.distributed.run``) or SLURM's ``srun``.

Both start one process per rank and tell it which one in the environment: torchrun sets ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``; ``srun`` sets ``SLURM_PROCID`` and
``SLURM_NTASKS`` (inside a job step, ``SLURM_STEP_ID``). ``hetero-launch LAYOUT`` started that way runs
exactly that rank in its own process, as ``--rank R`` would, after checking that the launcher started
as many processes as the layout has ranks and that this machine is the host of the rank's node.
An explicit ``--rank`` or ``--node`` wins over the environment, and a one-task ``srun`` step (an
interactive shell inside an allocation) is not taken for a launcher of ranks.

Also here: ``--resume auto``, which makes one command line right for the first start and for every
restart (torchrun ``--max-restarts``, a requeued SLURM job): resume from the newest complete save in the
``--checkpoint`` folder when there is one, else start fresh. Torch-free.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from pathlib import Path

import attrs

from hetero_llm.checkpoint import folders
from hetero_llm.errors import ENVIRONMENT, LayoutError
from hetero_llm.launch.hosts import is_local_host
from hetero_llm.plan import Plan
from hetero_llm.runtime import emulation

AUTO = "auto"


def check_environment(environ: Mapping[str, str], world_size: int) -> None:
    """Every environment variable ``hetero-launch`` reads, checked before anything starts: a bad one is one
    ``LayoutError`` naming it, its value and what it expects (``environment: VAR: 'value' is not ...``).
    RANK / WORLD_SIZE / SLURM_* are checked by ``assigned`` when they are used, MASTER_PORT by
    ``rendezvous.endpoint``; the variables of emulated devices against the layout's ``world_size`` ranks.
    (LOCAL_RANK is not read: a rank's device is the layout's.)"""
    from hetero_llm.layout.fields import host_address

    def refuse(var: str, expected: str) -> None:
        raise LayoutError(ENVIRONMENT, var, f"'{environ[var]}' is not {expected}")

    threads = environ.get("OMP_NUM_THREADS", "")
    if threads and not (threads.strip().isdigit() and int(threads) >= 1):
        refuse(
            "OMP_NUM_THREADS",
            "a whole number of CPU threads >= 1 (e.g. 4; unset it to share this host's cores among its ranks)",
        )
    if environ.get("HETERO_DEBUG", "") not in ("", "0", "1"):
        refuse("HETERO_DEBUG", "0 or 1 (1: a rank's unexpected error is raised with its traceback)")
    meter = environ.get("HETERO_TENSOR_METER", "")
    if meter and not os.path.isdir(meter):
        refuse("HETERO_TENSOR_METER", "an existing folder (for each rank's tensor peak; create it, or unset it)")
    for var, what in (
        ("HETERO_SHM_DIR", "shared memory, e.g. /dev/shm"),
        ("HETERO_LLM_CACHE", "token caches"),
        ("XDG_CACHE_HOME", "user caches, e.g. ~/.cache, as the XDG spec asks"),
    ):
        value = environ.get(var)
        if value is None or not value and var != "HETERO_SHM_DIR":  # unset, or empty: the default (not for shm)
            continue
        if not os.path.isabs(value) or os.path.isfile(value):
            refuse(var, f"the absolute path of a folder (for {what}; give one, or unset it)")
    if environ.get("TORCHELASTIC_USE_AGENT_STORE", "True") not in ("True", "False"):
        refuse("TORCHELASTIC_USE_AGENT_STORE", "True or False (torchrun sets it; unset it outside torchrun)")
    restarts = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if not restarts.strip().isdigit():
        refuse("TORCHELASTIC_RESTART_COUNT", "a number of restarts (torchrun sets it; unset it outside torchrun)")
    address = environ.get("MASTER_ADDR", "")
    if address and host_address(address) is not None:
        refuse(
            "MASTER_ADDR",
            "a host name or an IP address (e.g. 10.0.0.1, without a port: that is MASTER_PORT; "
            "or unset it to meet at the master node's host)",
        )
    emulation.check_environment(environ, world_size)  # HETERO_EMULATE_*: the module that reads them checks them


@attrs.frozen
class Assigned:
    """The rank an outside launcher gave this process."""

    rank: int
    world_size: int
    launcher: str  # "torchrun" or "srun", for messages
    rank_var: str  # the variables it came from: "RANK", "SLURM_PROCID"
    world_var: str


_SOURCES = (  # (launcher, rank variable, world size variable, variables that must also be set)
    ("torchrun", "RANK", "WORLD_SIZE", ()),
    ("srun", "SLURM_PROCID", "SLURM_NTASKS", ("SLURM_STEP_ID",)),  # in a job step, not the batch script itself
)


def assigned(environ: Mapping[str, str]) -> Assigned | None:
    """The rank the environment gives this process (torchrun first, then srun), or None."""
    for launcher, rank_var, world_var, also in _SOURCES:
        if rank_var in environ and world_var in environ and all(v in environ for v in also):
            values = []
            for var in (rank_var, world_var):
                text = environ[var]
                if not text.strip().isdigit():
                    raise LayoutError(
                        ENVIRONMENT,
                        var,
                        f"'{text}' is not a number ({launcher} sets it; unset it, "
                        "or pass --rank R / --node NAME to choose what to start)",
                    )
                values.append(int(text))
            if launcher == "srun" and values[1] == 1:
                return None  # a one-task step (an interactive shell in an allocation): start the node's ranks as usual
            return Assigned(values[0], values[1], launcher, rank_var, world_var)
    return None


def check(plan: Plan, given: Assigned) -> None:
    """The launcher's world size is the layout's, and this machine is the host of the rank's node."""
    lay = plan.layout
    if given.world_size != plan.world_size:
        raise LayoutError(
            lay.file,
            "pipelines",
            f"{given.launcher} started {given.world_size} processes "
            f"({given.world_var}={given.world_size}) but the layout has {plan.world_size} ranks; start "
            f"{plan.world_size} (--dry-run lists them by node)",
        )
    if not 0 <= given.rank < plan.world_size:
        raise LayoutError(
            lay.file,
            "pipelines",
            f"{given.launcher} gave this process rank {given.rank} "
            f"({given.rank_var}), not one of the layout's ranks 0..{plan.world_size - 1}",
        )
    info = plan.ranks[given.rank]
    names = [n.name for n in lay.cluster.nodes]
    node = lay.cluster.node(info.node)
    if not is_local_host(node.host):
        raise LayoutError(
            lay.file,
            f"cluster.nodes[{names.index(node.name)}].host",
            f"{given.launcher} started rank "
            f"{given.rank} ({given.rank_var}) on {socket.gethostname()}, but the layout puts it "
            f"({info.device_id}) on node {node.name}, host '{node.host}', which is not this machine; "
            f"give each node its machine's host, and start ranks so that each machine gets its nodes' "
            f"ranks (--dry-run lists them)",
        )


def resume_auto(checkpoint_dir: str | None, lay) -> str | None:
    """``--resume auto``: the newest complete save in ``--checkpoint DIR``, or None (start fresh)."""
    if not checkpoint_dir:
        raise LayoutError(
            lay.file, "--resume", "auto needs --checkpoint DIR (the folder it resumes from and saves into)"
        )
    root = Path(checkpoint_dir)
    saves = root.glob(f"{folders.STEP_PREFIX}*/{folders.META}") if root.is_dir() else ()
    if not any(saves):  # no complete save yet (none, or only interrupted ones): a fresh start
        return None
    return str(folders.find(root).path)  # a damaged newest save is refused, never silently trained over
