#!/usr/bin/env bash
# The test command: sets itself up, then runs the suite on virtual CPU devices
# (no GPU needed), one pytest process per engine, since KERAS_BACKEND is fixed
# per process: the whole suite on JAX (the launcher's tests start their own
# torch processes), then the engine contract and the real Keras programs
# (tests/test_engines.py, tests/test_programs.py) on TensorFlow and on PyTorch
# (whose multi-device tests fork one gloo process per device). pytest exits
# non-zero when a test fails and 5 when no test ran; either fails this script.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh jax,test,peers
# torch's CPU build: a bare `pip install torch` would pull gigabytes of CUDA.
.venv/bin/python -m pip install -q torch==2.13.0
KERAS_BACKEND=jax .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
for backend in tensorflow torch; do
  KERAS_BACKEND=$backend .venv/bin/python -m pytest -q -p no:cacheprovider \
      tests/test_engines.py tests/test_programs.py
done
