#!/usr/bin/env bash
# What a session records when it is lent a GPU machine (README "GPU tests"): the CUDA tests, the GPU
# benchmark against a plain PyTorch loop, and per-layer profiles of the published single-GPU rows' shapes.
# One script, each part under its own time limit, so that a part that runs long costs only itself; after
# every part the results so far are packed into $OUT/gpu_check.tgz (what comes back even when a later part
# is cut short).
#
#     OUT=/some/folder bash bench/gpu/gpu_check.sh         # on the GPU machine, from the repository root
#     ONLY="bench_eager pytest_cupy" bash bench/gpu/gpu_check.sh   # only the parts named
#
# Budget: about 10 minutes of a fresh machine (the limits below add up to 760 s; the parts took ~430 s before the two
# hot-switching parts, pytest_gpu_buckets and bench_switch, were added: not yet run on a GPU). Seen on an H200 (26 Nov 2026):
# the GPU tests 60 s, the eager benchmark with its two multi-rank layouts ~190 s (the TP-2 layout on one GPU
# over gloo alone ~40 s), each profile ~7 s, the compiled 124M pair 46 s, the compiled 1.3B pair ~90 s; a
# fresh machine takes 30-60 s to start.
set -u
OUT=${OUT:-bench/results/gpu_check}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$OUT" "$WORK/results"
export PYTHONUNBUFFERED=1
LOG="$WORK/results/log.txt"

pack() { tar czf "$OUT/gpu_check.tgz" -C "$WORK" results; }
part() {  # part NAME SECONDS COMMAND...: run one part under `timeout`, log it, pack the results
    local name=$1 limit=$2 t0
    shift 2
    if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
    t0=$(date +%s)
    echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG" "$WORK/results/$name.log" >/dev/null
    echo "=== $name: exit ${PIPESTATUS[0]} after $(($(date +%s) - t0))s" | tee -a "$LOG"
    pack
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    python3 -c "import sys, torch; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
    nproc
} 2>&1 | tee -a "$LOG"
# The package itself, without its dependencies (the machine is offline; torch, attrs, click, numpy, sympy
# are in its image): the console scripts, or the source tree on PYTHONPATH if pip cannot.
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >>"$LOG" 2>&1 || export PYTHONPATH=$PWD
R="$WORK/results"

part pytest_gpu 100 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/integration/test_gpu.py tests/unit/test_domains.py
part pytest_gpu_buckets 60 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/integration/test_gpu_buckets.py
part pytest_cupy 40 python3 -m pytest -q -p no:cacheprovider -rs tests/unit/test_domains.py -k cupy
part bench_eager 200 python3 -m bench.gpu.gpu_bench --models 124m,1.3b --seqs 1024,2048 --modes eager \
    --steps 14 --warmup 4 --no-switch --out "$R/eager"
part bench_switch 80 python3 -m bench.gpu.gpu_bench --models 124m --seqs 1024 --modes eager --no-multi-rank --switch \
    --steps 8 --warmup 3 --out "$R/switch"
for m in 124m 1.3b; do
    part "profile_$m" 25 python3 -m hetero_llm.cli.plan "layouts/clusters/published/h100_gpt_${m}_eager.toml" \
        --profile "$R/profile_$m.json" --kind h100-sxm --device cuda
done
part bench_compiled_124m 80 python3 -m bench.gpu.gpu_bench --models 124m --seqs 1024 --modes compiled \
    --no-multi-rank --steps 14 --warmup 5 --out "$R/compiled_124m"
part bench_compiled_13b 150 python3 -m bench.gpu.gpu_bench --models 1.3b --seqs 2048 --modes compiled \
    --no-multi-rank --steps 12 --warmup 5 --out "$R/compiled_13b"
echo "=== done" | tee -a "$LOG"
pack
