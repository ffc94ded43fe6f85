#!/usr/bin/env bash
# Start one node's ranks of a layout: the same command on every node, only NODE differs.
#
#   launch/run_node.sh LAYOUT.toml NODE [hetero-launch args...]
#   MASTER_ADDR=10.0.0.1 MASTER_PORT=29600 launch/run_node.sh layouts/examples/two_pipelines.toml node1 --quiet
#
# Environment (all optional):
#   MASTER_ADDR, MASTER_PORT   rendezvous address; default: the layout's master node host and cluster.port
#   OMP_NUM_THREADS            CPU threads per rank; default: this process's usable cores / the node's ranks
#   HETERO_LAUNCH              the launcher command; default: hetero-launch
#   PYTHON                     interpreter used to count the node's ranks; default: python3
#
# Exit status: hetero-launch's (0 ok, 1 a rank failed, 2 bad layout or arguments); 2 for a usage error here.
set -euo pipefail

prog=${0##*/}

usage() {
    cat <<EOF
usage: $prog LAYOUT.toml NODE [hetero-launch args...]

Start the ranks of node NODE of LAYOUT.toml on this machine (hetero-launch LAYOUT.toml --node NODE).
Run the same command on every node, each with its own NODE.
Set MASTER_ADDR / MASTER_PORT to override the layout's rendezvous address.
EOF
}

if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    usage
    exit 0
fi
if (($# < 2)) || [[ -z $1 || -z $2 || $2 == -* ]]; then
    usage >&2
    exit 2
fi
layout=$1
node=$2
shift 2
if [[ ! -f $layout ]]; then
    echo "$prog: no such layout file: $layout" >&2
    exit 2
fi

# Rendezvous: passed through to every rank only when given; hetero-launch falls back to the layout.
if [[ -n ${MASTER_ADDR:-} ]]; then
    export MASTER_ADDR
fi
if [[ -n ${MASTER_PORT:-} ]]; then
    if ! [[ $MASTER_PORT =~ ^[0-9]+$ ]] || ((MASTER_PORT < 1 || MASTER_PORT > 65535)); then
        echo "$prog: MASTER_PORT must be a TCP port 1..65535, got '$MASTER_PORT'" >&2
        exit 2
    fi
    export MASTER_PORT
fi

# One rank's share of the cores this process may use (nproc honours SLURM's and taskset's CPU sets,
# which os.cpu_count() inside hetero-launch does not). Several ranks on a node each running
# as many OpenMP threads as the machine has cores would oversubscribe it many times over.
if [[ -z ${OMP_NUM_THREADS:-} ]]; then
    ranks=$("${PYTHON:-python3}" - "$layout" "$node" 2>/dev/null <<'PY' || true
import sys
from hetero_llm.layout import load
lay = load(sys.argv[1])
print(sum(dev.split(":")[0] == sys.argv[2] for pipe in lay.pipelines for st in pipe.stages for dev in st.devices))
PY
)
    # A layout that does not load, or a node without ranks, is hetero-launch's to report.
    if [[ $ranks =~ ^[1-9][0-9]*$ ]]; then
        cores=$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)
        OMP_NUM_THREADS=$((cores / ranks > 0 ? cores / ranks : 1))
        export OMP_NUM_THREADS
    fi
fi

# A rank blocked in an NCCL collective whose peer died raises instead of hanging forever, so the
# launcher sees the failure and takes the job down. (The old name, NCCL_ASYNC_ERROR_HANDLING, is
# honoured if set; torch warns that it is deprecated, so we do not set it ourselves.)
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-${NCCL_ASYNC_ERROR_HANDLING:-1}}
export PYTHONUNBUFFERED=1

echo "$prog: node $node of $layout; rendezvous ${MASTER_ADDR:-<layout master>}:${MASTER_PORT:-<cluster.port>};" \
    "OMP_NUM_THREADS=${OMP_NUM_THREADS:-<hetero-launch default>}" >&2

# HETERO_LAUNCH may hold a command with arguments (e.g. "python -m hetero_llm.cli"): split it on purpose.
read -r -a launcher <<<"${HETERO_LAUNCH:-hetero-launch}"
exec "${launcher[@]}" "$layout" --node "$node" "$@"
