#!/usr/bin/env bash
# The test command: sets itself up, then runs the whole suite on virtual CPU
# devices (no GPU needed). pytest exits non-zero when a test fails and 5 when
# no test ran; both fail this script.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh jax,test,peers
export KERAS_BACKEND=jax
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
