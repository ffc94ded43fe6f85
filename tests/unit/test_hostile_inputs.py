"""Inputs that would hang a command, spin it, or end it in a traceback, each refused in one line (exit code 2)
before any work: a named pipe where a save's file should be, counts in meta.json that nothing on disk backs,
JSON or TOML nested deeper than Python parses, a cluster larger than the stated limit, two outputs on one path,
an output inside the save being resumed, a truncated init_from weights file, options that do nothing."""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path

import pytest

from harness import LAYOUTS, assert_one_error_line, free_port, hf_folder, invoke_cli
from hetero_llm.checkpoint import folders
from hetero_llm.layout import reader

QUICKSTART = LAYOUTS / "quickstart.toml"
SMALL = LAYOUTS / "clusters" / "small_cpu.toml"
FIX = folders.FIX
DAMAGED = folders.DAMAGED


def _refused(layout: Path, args: list, message: str) -> None:
    """``hetero-launch layout args``, with --dry-run and without: exactly ``error: message``, exit code 2."""
    for dry in (["--dry-run"], ["--quiet"]):
        assert_one_error_line(invoke_cli(layout, *dry, *args), message)


def _save(root: Path, step: int = 2, world_size: int = 1, meta: str | None = None) -> Path:
    """A step folder ``root/step-NNNNNN`` with ``world_size`` (empty) rank files and a meta.json."""
    folder = folders.step_folder(root, step)
    folder.mkdir(parents=True)
    for r in range(min(world_size, 4)):
        folders.rank_file(folder, r).write_bytes(b"")
    text = json.dumps({"step": step, "world_size": world_size, "layout": "l.toml", "params": {}})
    (folder / folders.META).write_text(text if meta is None else meta)
    return folder


# ------------------------------------------------------------------------------ files of a save: regular, bounded


def test_a_named_pipe_as_latest_is_refused_not_waited_on(tmp_path):
    root = tmp_path / "ckpt"
    _save(root)
    os.mkfifo(root / folders.LATEST)
    _refused(
        QUICKSTART,
        ["--resume", root],
        f"{root / folders.LATEST}: --resume: is a named pipe (FIFO), not a regular file (delete it to resume from "
        f"the highest-numbered complete save of {root})",
    )


def test_a_named_pipe_as_meta_json_is_refused_not_waited_on(tmp_path):
    folder = folders.step_folder(tmp_path / "ckpt", 2)
    folder.mkdir(parents=True)
    os.mkfifo(folder / folders.META)
    for resume in (folder, folder.parent):  # the step folder, and the root whose newest save it is
        _refused(
            QUICKSTART,
            ["--resume", resume],
            f"{folder / folders.META}: --resume: is a named pipe (FIFO), not a regular file ({FIX})",
        )


def test_a_named_pipe_as_a_rank_file_is_refused(tmp_path):
    folder = _save(tmp_path / "ckpt", world_size=2)
    os.unlink(folders.rank_file(folder, 1))
    os.mkfifo(folders.rank_file(folder, 1))
    _refused(
        QUICKSTART,
        ["--resume", folder],
        f"{folders.rank_file(folder, 1)}: --resume: is a named pipe (FIFO), not a regular file: the save is "
        f"damaged; {DAMAGED}",
    )


def test_a_world_size_no_file_backs_is_not_counted_up_to(tmp_path):
    """meta.json's world_size of 10^12 finds the first missing rank file among those on disk, at once."""
    folder = _save(tmp_path / "ckpt", world_size=10**12)
    start = time.process_time()
    _refused(
        QUICKSTART,
        ["--resume", folder],
        f"{folder}: --resume: rank4.pt is missing (the layout that saved it had {10**12} ranks); {FIX}",
    )
    assert time.process_time() - start < 30  # a loop to 10^12 would take hours


@pytest.mark.parametrize("step, world_size", [(2, 0), (-1, 1)])
def test_a_step_or_world_size_below_its_least_is_refused(tmp_path, step, world_size):
    folder = _save(
        tmp_path / "ckpt", meta=json.dumps({"step": step, "world_size": world_size, "params": {}, "layout": ""})
    )
    _refused(
        QUICKSTART,
        ["--resume", folder],
        f"{folder}: --resume: meta.json is not a hetero_llm checkpoint's (step {step}, world_size {world_size}); {FIX}",
    )


def test_meta_json_nested_too_deep_is_one_line(tmp_path):
    folder = _save(tmp_path / "ckpt", meta="[" * 100_000 + "]" * 100_000)
    _refused(
        QUICKSTART,
        ["--resume", folder],
        f"{folder}: --resume: meta.json is not a hetero_llm checkpoint's (JSONDecodeError: nested too deeply to "
        f"read: line 1 column 1 (char 0)); {FIX}",
    )


# ------------------------------------------------------------------------------ layouts and clusters: bounded


def _nodes(count: int, devices: int = 1) -> str:
    listed = ", ".join(['"cpu"'] * devices)
    return "".join(
        f'[[cluster.nodes]]\nname = "n{i}"\nhost = "localhost"\ndevices = [{listed}]\n' for i in range(count)
    )


def _cluster_with(tmp_path: Path, nodes: str) -> Path:
    text = SMALL.read_text()
    head = text[: text.index("[[cluster.nodes]]")]
    path = tmp_path / "big.toml"
    path.write_text(head + nodes)
    return path


@pytest.mark.parametrize(
    "count, devices, what",
    [
        (reader.MAX_NODES + 1, 1, f"{reader.MAX_NODES + 1} nodes"),
        (2, reader.MAX_DEVICES // 2 + 1, "65538 devices in all"),
    ],
)
def test_a_cluster_over_the_limit_is_one_line_at_once(tmp_path, count, devices, what):
    from helpers_plan import run_plan

    path = _cluster_with(tmp_path, _nodes(count, devices))
    message = (
        f"{path}: cluster.nodes: {what}, more than hetero_llm handles (at most {reader.MAX_NODES} nodes and "
        f"{reader.MAX_DEVICES} devices: plan and run a part of the cluster)"
    )
    assert_one_error_line(invoke_cli(path, "--dry-run"), message)
    assert_one_error_line(run_plan(path, "-o", tmp_path / "out.toml"), message)
    assert not (tmp_path / "out.toml").exists()


def test_a_file_larger_than_any_cluster_needs_is_refused_before_parsing(tmp_path):
    path = tmp_path / "huge.toml"
    path.write_text(QUICKSTART.read_text() + "# " + "x" * (reader.MAX_FILE_MB << 20) + "\n")
    assert_one_error_line(
        invoke_cli(path, "--dry-run"),
        f"{path}: 8 MB, larger than any layout hetero_llm reads (8 MB: a cluster of 4096 nodes and 65536 devices, "
        "the most it handles, fits in far less)",
    )


def test_toml_nested_too_deep_is_one_line(tmp_path):
    path = tmp_path / "deep.toml"
    path.write_text(QUICKSTART.read_text() + "deep = " + "[" * 100_000 + "]" * 100_000 + "\n")
    assert_one_error_line(invoke_cli(path, "--dry-run"), f"{path}: TOML nested too deeply to read (fix the TOML there)")


# ------------------------------------------------------------------------------ outputs: before any work


def test_two_outputs_on_one_path_are_refused(tmp_path):
    same = tmp_path / "out"
    _refused(
        QUICKSTART,
        ["--metrics-jsonl", same, "--trace", same],
        f"{same}: --trace: is also the path of --metrics-jsonl (give each output its own path)",
    )
    _refused(
        QUICKSTART,
        ["--checkpoint", same, "--tensorboard", tmp_path / "x" / ".." / "out"],
        f"{tmp_path / 'x' / '..' / 'out'}: --tensorboard: is also the path of --checkpoint (give each output its "
        "own path)",
    )
    assert sorted(os.listdir(tmp_path)) == []


@pytest.mark.parametrize("flag", ["--trace", "--tensorboard", "--checkpoint"])
def test_no_output_writes_into_the_save_being_resumed(tmp_path, flag):
    folder = _save(tmp_path / "ckpt")
    for resume, out in ((folder, folder), (folder, folder / "t"), (folder.parent, folder / "t")):
        _refused(
            QUICKSTART,
            ["--resume", resume, flag, out],
            f"{out}: {flag}: would write into the --resume checkpoint '{resume}' (an input of this run; give another "
            "path)",
        )
    assert sorted(p.name for p in folder.iterdir()) == ["meta.json", "rank0.pt"]


def test_checks_that_name_the_command_line_come_before_the_port(tmp_path):
    """A bad output is named even while another program holds the rendezvous port (the port is checked last)."""
    import socket

    port = free_port()
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        held.listen()
        same = tmp_path / "same"
        args = ["--set", f"cluster.port={port}", "--quiet"]
        assert_one_error_line(
            invoke_cli(QUICKSTART, *args, "--metrics-jsonl", same, "--trace", same),
            f"{same}: --trace: is also the path of --metrics-jsonl (give each output its own path)",
        )
        assert_one_error_line(
            invoke_cli(QUICKSTART, *args),
            f"{QUICKSTART}: cluster.port: port {port} on 127.0.0.1 is in use by another program, so rank 0 cannot "
            "serve the rendezvous there (stop it, or choose another cluster.port)",
        )


def test_timeline_refuses_one_path_for_both_outputs(tmp_path):
    from click.testing import CliRunner

    from hetero_llm.cli.timeline import main

    out = tmp_path / "t.json"
    result = CliRunner().invoke(main, ["--simulate", "--out", str(out), "--chrome", str(out)])
    assert result.output == f"error: {out}: --chrome: is also the path of --out (give each output its own path)\n"
    assert result.exit_code == 2 and not out.exists()


@pytest.mark.parametrize("option, value", [("--max-spread", "0.5"), ("--kind", "cpu"), ("--device", "cpu")])
def test_plan_refuses_profile_options_without_profile(tmp_path, option, value):
    from helpers_plan import run_plan

    result = run_plan(SMALL, "--explain", option, value)
    assert result.stdout == ""
    assert result.stderr == f"error: {SMALL}: {option}: only applies with --profile FILE (drop it, or measure)\n"
    assert result.exit_code == 2


# ------------------------------------------------------------------------------ init_from: a truncated weights file


def test_a_truncated_init_from_is_refused_when_the_layout_is_checked(tmp_path):
    pytest.importorskip("safetensors")
    from hetero_llm import layout as layout_mod
    from hetero_llm.interop import hf_names

    text = (LAYOUTS / "reference" / "reference.toml").read_text()
    hf_folder(tmp_path / "hf", layout_mod.loads(text, base_dir=tmp_path).model)
    layout = tmp_path / "run.toml"
    layout.write_text(text.replace("[model]\n", '[model]\ninit_from = "hf"\n', 1))
    weights = tmp_path / "hf" / hf_names.WEIGHTS
    data = weights.read_bytes()
    header_size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + header_size])
    end = max(e["data_offsets"][1] for k, e in header.items() if k != "__metadata__")
    weights.write_bytes(data[:-100])
    _refused(
        layout,
        [],
        f"{layout}: model.init_from: {weights} is not a safetensors model (ValueError: truncated: its header places "
        f"tensor data up to byte {end}, but it holds {end - 100}) (save the model again with save_pretrained)",
    )


# ------------------------------------------------------------------------------ store connections: retried, one line


def _client_plan(port: int):
    from hetero_llm import layout as layout_mod
    from hetero_llm.comm import rendezvous
    from hetero_llm.plan import compile_plan

    lay = layout_mod.load(QUICKSTART, [f"cluster.port={port}", "cluster.timeout_s=5"])
    rp = compile_plan(lay).rank_plan(1)
    ep = rendezvous.endpoint(rp, {})
    assert ep.server == 0
    return rp, ep


def test_a_store_connection_waits_for_a_server_that_is_slow_to_come(monkeypatch):
    """The client's first attempts are refused; the server starts only then (an event, not a sleep): the client
    connects within its deadline and the store works."""
    import socket
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from hetero_llm.comm import rendezvous

    port = free_port()
    rp, ep = _client_plan(port)
    refused = threading.Event()
    connect = socket.create_connection

    def watched(*args, **kwargs):
        try:
            return connect(*args, **kwargs)
        except OSError:
            refused.set()
            raise

    monkeypatch.setattr(rendezvous.socket, "create_connection", watched)
    servers = []

    def serve():
        refused.wait(60)
        servers.append(dist.TCPStore("127.0.0.1", port, 2, True, timeout=timedelta(seconds=30), wait_for_workers=False))

    thread = threading.Thread(target=serve)
    thread.start()
    store = rendezvous.connect(rp, ep, time.monotonic() + 60)
    thread.join()
    store.set("k", "v")
    assert refused.is_set() and servers[0].get("k") == b"v"


def test_a_store_that_never_answers_is_one_line_without_torch_output(capfd):
    from hetero_llm.comm import rendezvous
    from hetero_llm.errors import RankFailure

    port = free_port()
    rp, ep = _client_plan(port)
    with pytest.raises(RankFailure) as err:
        rendezvous.connect(rp, ep, time.monotonic() + 1.5)
    assert str(err.value) == (
        f"rank 1: nothing answered at 127.0.0.1:{port} (node {rp.meeting.master}'s host, cluster.port) within 5 s "
        "(last: Connection refused); is rank 0 (node0:0), which serves it, started, and is the address right?"
    )
    assert capfd.readouterr().err == ""


def test_a_named_pipe_as_an_output_file_is_refused_not_waited_on(tmp_path):
    fifo = tmp_path / "metrics.jsonl"
    os.mkfifo(fifo)
    _refused(
        QUICKSTART,
        ["--metrics-jsonl", fifo],
        f"{fifo}: --metrics-jsonl: is a named pipe (FIFO) that nothing reads (give a file path)",
    )
