#!/usr/bin/env bash
# Every GPU measurement of benchmarks/gpu, one section after another, results in $OUT (default ./gpu-results):
#   real_nccl.json  `real` on NCCL at one rank: every collective, returns on the CPU, error paths, python -m real
#   compute.json    CUDA-event times of the ops simdist's cost model prices
#   memory.json     max_memory_allocated() through a transformer block's training step
#   memory_trace.json  the blocks live at the backward's peak, each with the op that allocated it
#   program.json    the GPU-style training program run through `real` at one rank
#   log.txt         everything printed
# Needs torch and the standard library only. `bash benchmarks/gpu/run_all.sh --dry-run` runs it all with tiny
# sizes on a CPU. Each section has its own time limit and writes its JSON as it goes: one that fails or runs out
# of time keeps what it measured, and the next one runs. Then compare on a machine with simdist:
# `python benchmarks/gpu/compare.py $OUT`.
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
OUT="${OUT:-$PWD/gpu-results}"
mkdir -p "$OUT"
export PYTHONPATH="$REPO:$HERE${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
DRY=()
SCALE=1  # the limits guard a lent GPU's minutes; a dry run on a busy CPU machine gets three times as long
if [ "${1:-}" = "--dry-run" ]; then DRY=(--dry-run); SCALE=3; fi

section() {  # section NAME SECONDS SCRIPT [ARGS...]
    local name="$1" limit=$(($2 * SCALE))
    shift 2
    echo "=== $name (limit ${limit}s) ==="
    local start=$SECONDS
    timeout --signal=INT --kill-after=15 "$limit" "$PY" "$@" --out "$OUT" ${DRY[@]+"${DRY[@]}"}
    local status=$?
    echo "=== $name: exit $status after $((SECONDS - start))s ==="
}

{
    echo "run_all.sh ${DRY[*]:-} at $(date -u +%FT%TZ) on $(hostname); OUT=$OUT"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    # versions without importing torch (seconds of CPU; each section and the summary record what torch sees)
    "$PY" -c 'import sys; from importlib.metadata import version; print("python", sys.version.split()[0], "torch", version("torch"))'
    section real_nccl 150 "$HERE/real_nccl.py"
    section compute 120 "$HERE/compute.py"
    section memory 45 "$HERE/memory.py"
    section memory_trace 60 "$HERE/memory_trace.py"
    section program 90 "$HERE/program.py"
    echo "=== summary ==="
    "$PY" "$HERE/summary.py" "$OUT"
} 2>&1 | tee "$OUT/log.txt"
