"""``python -m hetero_llm.cli``: the same as ``hetero-launch`` (rank scripts and tests start ranks this way)."""

from hetero_llm.cli.launch import main

main()
