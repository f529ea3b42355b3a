#!/usr/bin/env bash
# The GPU measurement plan of issue 14 in one command (see benchmarks/gpu/README.md).
#
#   bash benchmarks/gpu/run.sh [OUT_DIR] [--toy] [--backends jax,torch] [--budget S]
#   bash benchmarks/gpu/run.sh [OUT_DIR] --reference [--epochs N] [--tile 50000]
#
# Installs the carried wheels (.whl/, made here by wheels.sh) when keras is not
# importable; else uses the current environment (this checkout's .venv when there is
# one). The code measured is always this working tree's src/. OUT_DIR defaults to
# $OUT, else runs/gpu-plan. Without a GPU (or with --toy / GPU_PLAN_TOY=1) everything
# runs at CPU toy sizes.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
repo=$PWD

python=${PYTHON:-}
if [ -z "$python" ]; then
    if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi
fi

if ! "$python" -c "import keras" >/dev/null 2>&1; then
    if ! ls .whl/*.whl >/dev/null 2>&1; then
        echo "run.sh: keras is not importable by $python and .whl/ holds no wheels;" \
             "run 'bash benchmarks/gpu/wheels.sh' first (and carry .whl)" >&2
        exit 2
    fi
    site=${GPU_PLAN_SITE:-/tmp/site}
    echo "[run.sh] installing $(ls .whl/*.whl | wc -l) carried wheel(s) into $site"
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" .whl/*.whl
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
# This tree's code, ahead of any installed copy (the project's wheel included).
export PYTHONPATH="$repo/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec "$python" benchmarks/gpu/plan.py "$@"
