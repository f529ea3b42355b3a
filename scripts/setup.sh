#!/usr/bin/env bash
# Creates .venv (if missing) and installs the package with the extras named in
# $1 (default "jax,experiment": what the main job needs, JAX and the experiment's
# figures). The test command passes "jax,test,peers,experiment": pytest, ruff, and
# TensorFlow's CPU build for the peers the suite compares against. Run by the other
# scripts; safe to run again.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
EXTRAS=${1:-jax,experiment}
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[${EXTRAS}]"
