"""Launch helpers to copy or run beside a cluster: ``run_node.sh``, ``slurm_example.sbatch`` and
``gen_rank_scripts.py`` (run as ``python launch/gen_rank_scripts.py ...``; importable as
``launch.gen_rank_scripts`` from the repository root, as the tests do). Not part of the installed library.
"""
