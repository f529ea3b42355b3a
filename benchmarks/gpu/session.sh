#!/usr/bin/env bash
# Issue 26 in one device call: the library's checks on the GPU (library.py), the plan's
# core records (run.sh), then the reference run (run.sh --reference), each under its own
# time limit, each packed into OUT as it ends (so a call cut short still brings back what
# finished). About 8 minutes on a GPU; `bash benchmarks/gpu/session.sh DIR --toy` here.
#
#   bash benchmarks/gpu/wheels.sh                          # here; carry .whl
#   bash benchmarks/gpu/session.sh $OUT                    # there, timeout_s 600
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
out=${1:-${OUT:-runs/gpu-session}}
toy=()
[ "${2:-}" = "--toy" ] && toy=(--toy)
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d /tmp/gpu-session-XXXX)
python=${PYTHON:-}
if [ -z "$python" ]; then
    if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi
fi
export PYTHON=$python
exec > >(tee "$out/session.txt") 2>&1
echo "[session] $(date -u +%FT%TZ) python $python"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || echo "no nvidia-smi" > "$out/nvidia-smi.txt"
if ! "$python" -c "import keras" >/dev/null 2>&1; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

pack() {  # pack NAME: the stage's folder into OUT/NAME.tar.gz
    tar -C "$work" -czf "$out/$1.tar.gz" "$1" && echo "[session] packed $1 ($(date -u +%T))"
}

SECONDS=0
timeout 110 "$python" benchmarks/gpu/library.py "$work/library" "${toy[@]}"
echo "[session] library: exit $? after $SECONDS s"; pack library

# The post's base and plain Keras, the fast end (bf16, batch 1024, 8 steps per call) plain
# and ours, and ours there without BatchNormalization and without augmentation (where its
# time goes), the bf16 ceiling, and torch's fp32 pair.
only="jax/matmul,jax/ours/fp32/b64/spe1/resident/aug,jax/plain/fp32/b64/spe1,"
only+="jax/ours/bf16/b1024,jax/plain/bf16/b1024,torch/ours/fp32,torch/plain/fp32"
SECONDS=0
timeout 315 bash benchmarks/gpu/run.sh "$work/plan" "${toy[@]}" --budget 270 --only "$only"
echo "[session] plan: exit $? after $SECONDS s"; pack plan

SECONDS=0
timeout 140 bash benchmarks/gpu/run.sh "$work/reference" "${toy[@]}" --reference --budget 120
echo "[session] reference: exit $? after $SECONDS s"; pack reference
