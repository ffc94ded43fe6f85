"""Run one rank of ``hetero-launch`` under cProfile, steady-state steps only.

    python -m bench.pipeline.profile_rank OUT.prof --after 2 -- LAYOUT.toml --rank 0 --set cluster.port=29600 ...

Everything after ``--`` is ``hetero-launch``'s command line for one rank (start the other ranks
with ``python -m hetero_llm.cli LAYOUT.toml --rank R`` and the same ``--set``). The profiler is
switched on when the rank's pipeline schedule starts its step ``--after`` (0-based), so imports,
rendezvous and warm-up steps stay out, and the stats are written when the rank exits.
"""

from __future__ import annotations

import cProfile
import sys


def main() -> None:
    if "--" not in sys.argv or len(sys.argv) < 3:
        sys.exit(__doc__)
    cut = sys.argv.index("--")
    out = sys.argv[1]
    after = int(sys.argv[sys.argv.index("--after") + 1]) if "--after" in sys.argv[:cut] else 2
    launch_args = sys.argv[cut + 1 :]

    from hetero_llm.cli import launch
    from hetero_llm.runtime import interpreter

    profiler = cProfile.Profile()
    calls = [0]

    def switch_on_at(step_method):
        def wrapper(self, *args, **kwargs):
            if calls[0] == after:
                profiler.enable()
            calls[0] += 1
            return step_method(self, *args, **kwargs)

        return wrapper

    interpreter.StageRunner.run = switch_on_at(interpreter.StageRunner.run)
    interpreter.StageRunner.run_dynamic = switch_on_at(interpreter.StageRunner.run_dynamic)
    try:
        launch.main(launch_args, standalone_mode=False)
    finally:
        profiler.disable()
        profiler.dump_stats(out)


if __name__ == "__main__":
    main()
