"""``python -m hetero_llm.timeline``: the timeline command (cli/timeline.py), kept at this name for ``-m``."""

from hetero_llm.cli.timeline import main

if __name__ == "__main__":
    main()
