"""Record the console output the README quotes, so its numbers come from a run rather than from memory.

    python -m bench.launch.readme_samples           # run the quickstart, write docs/samples/quickstart.txt
    python -m bench.launch.readme_samples --check   # run it, and say whether quickstart.txt still holds (exit 1 if not)

The quickstart (``hetero-launch layouts/quickstart.toml``, 400 steps, about a minute on 2 CPU cores) trains on
the embedded grammar, so its losses depend only on the code. ``tests/integration/test_readme_samples.py`` checks that the
README's quickstart block quotes lines of quickstart.txt: rerun this script after a change that moves the
numbers, then put the lines it recorded into the README. Throughput and ETA differ from machine to machine;
they are left out of every comparison (``deterministic``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import benchlib

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "docs" / "samples"
QUICKSTART = SAMPLES / "quickstart.txt"
COMMAND = ["hetero-launch", "layouts/quickstart.toml"]  # as the README runs it, from the repository root

_TIMING = re.compile(r" \| [\d.]+k? tok/s \| ETA [^|]*$")


def deterministic(line: str) -> str:
    """A console line without what depends on the machine: a step line's tok/s and ETA."""
    return _TIMING.sub("", line.rstrip())


def run_quickstart() -> str:
    """The quickstart's console output (stdout), run from this tree, on a free port (another run may hold the
    layout's), stdout only: the progress bars and warnings of stderr are no part of the sample."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = benchlib.launch_command(COMMAND[1], quiet=False, port=benchlib.free_port())
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(COMMAND)} failed ({proc.returncode}):\n{proc.stderr}")
    return proc.stdout


def write(path: Path, text: str) -> None:
    """``path`` replaced whole: written beside it, then renamed over it."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def main(argv: list[str]) -> int:
    check = argv == ["--check"]
    if argv and not check:
        print(f"usage: python {Path(__file__).relative_to(ROOT)} [--check]", file=sys.stderr)
        return 2
    output = run_quickstart()
    if not check:
        write(QUICKSTART, output)
        print(f"wrote {QUICKSTART.relative_to(ROOT)} ({len(output.splitlines())} lines)")
        return 0
    recorded = [deterministic(line) for line in QUICKSTART.read_text().splitlines()]
    now = [deterministic(line) for line in output.splitlines()]
    if recorded == now:
        print(f"{QUICKSTART.relative_to(ROOT)} holds: the quickstart prints the same numbers")
        return 0
    first = next((i for i, (a, b) in enumerate(zip(recorded, now)) if a != b), min(len(recorded), len(now)))
    print(
        f"{QUICKSTART.relative_to(ROOT)} is stale from line {first + 1}: recorded\n  "
        f"{recorded[first] if first < len(recorded) else '(nothing)'}\nbut the quickstart prints\n  "
        f"{now[first] if first < len(now) else '(nothing)'}\n(run python {Path(__file__).relative_to(ROOT)} "
        "to record it again, then update the README's quickstart block)",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
