#!/usr/bin/env bash
# The main job: the MiniGoogLeNet CIFAR-10 experiment on every device.
#
# With GPUs: the post's full experiment (70 epochs, full width, 64 images per
# GPU per step) on all of them, on the CIFAR-10 found by the loader.
# Without: a CPU run sized to finish in minutes, on 2 virtual CPU devices and
# the shared 5,085-image subset. Extra arguments are passed to `train`. The
# run folder is this job's own: running it again replaces its files
# (--overwrite), which a plain `keras-multigpu train` refuses to do.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
export KERAS_BACKEND=jax
if [ -z "${KERAS_MULTIGPU_DATA:-}" ] && [ -d ../shared/data/cifar-10-batches-py ]; then
  export KERAS_MULTIGPU_DATA="$(cd ../shared/data && pwd)"
fi
if .venv/bin/keras-multigpu devices --json | grep -q '"kind": "gpu"'; then
  exec .venv/bin/keras-multigpu train --output runs/minigooglenet --overwrite "$@"
fi
exec .venv/bin/keras-multigpu train --gpus 2 --width 0.25 --epochs 40 --lr 0.02 \
  --output runs/minigooglenet-cpu --overwrite --target-acc 0.45 "$@"
