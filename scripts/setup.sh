#!/usr/bin/env bash
# Creates .venv (if missing) and installs the package with its JAX, test and
# peers (TensorFlow, CPU build) extras. Run by the other scripts; safe to run again.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[jax,test,peers]"
