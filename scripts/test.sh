#!/usr/bin/env bash
# The test command: sets itself up, then runs the suite on virtual CPU devices
# (no GPU needed), one pytest process per engine, since KERAS_BACKEND is fixed
# per process: the suite on JAX, and meanwhile the engine contract and the real Keras
# programs (tests/test_engines.py, tests/test_programs.py) on TensorFlow (with
# its several-worker tests, tests/test_multihost_tf.py), then on PyTorch (whose
# multi-device tests fork one gloo process per device) with the tests that start
# processes of their own: the launcher's across machines (tests/test_multihost.py) and
# the benchmark harness's (tests/test_bench.py). The two streams share the cores; each
# one's output is printed when it ends.
# When the JAX stream ends, the exactness tests (the rules, the engine contract and
# shuffling) run again on the next Keras (../shared/keras-next, Keras's
# main branch as a wheel), on JAX and then on torch: the wheel is laid over the
# environment's Keras through PYTHONPATH, so nothing else changes.
# pytest exits non-zero when a test fails and 5 when no test ran; either fails
# this script.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh jax,test,peers,experiment
# torch's CPU build: a bare `pip install torch` would pull gigabytes of CUDA.
.venv/bin/python -m pip install -q torch==2.13.0
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
# The launcher's tests across machines and the benchmark harness's start their own
# processes (each with its own backend): they run after torch's engine tests, which
# balances the two streams. --durations: the slowest tests, to keep the whole under 30 min.
launcher="tests/test_multihost.py tests/test_bench.py"
next_wheel=$(ls ../shared/keras-next/keras-*.whl 2>/dev/null | head -1 || true)
# Of test_semantics, its shuffling tests (the whole of it would add a minute to CI).
next_shuffling="tests/test_semantics.py::test_shuffling_equals_keras_under_a_seed
  tests/test_semantics.py::test_shuffling_moves_the_global_generators_as_keras_does"
jax_stream() {
  local status=0 backend
  KERAS_BACKEND=jax .venv/bin/python -m pytest -q -p no:cacheprovider \
      --ignore=tests/test_multihost.py --ignore=tests/test_multihost_tf.py \
      --ignore=tests/test_bench.py --durations=15 "$@" || status=1
  if [ -z "$next_wheel" ]; then
    echo "== the next Keras: no wheel at ../shared/keras-next; its exactness tests did not run"
    return $status
  fi
  .venv/bin/python -m pip install -q --no-deps --target "$logs/keras-next" "$next_wheel"
  for backend in jax torch; do
    echo "== the next Keras ($(basename "$next_wheel")), KERAS_BACKEND=$backend"
    PYTHONPATH="$logs/keras-next" KERAS_BACKEND=$backend .venv/bin/python -m pytest -q \
        -p no:cacheprovider tests/test_rules.py tests/test_engines.py \
        $([ "$backend" = jax ] && echo tests/test_batching.py $next_shuffling) || status=1
  done
  return $status
}
jax_stream "$@" > "$logs/jax" 2>&1 &
jax=$!
status=0
for backend in tensorflow torch; do
  # TensorFlow's workers join at import, before its runtime starts: their test runs there.
  extra=$([ "$backend" = tensorflow ] && echo tests/test_multihost_tf.py || echo "$launcher")
  KERAS_BACKEND=$backend .venv/bin/python -m pytest -q -p no:cacheprovider --durations=10 \
      tests/test_rules.py tests/test_engines.py tests/test_programs.py $extra \
      > "$logs/$backend" 2>&1 || status=1
  echo "== KERAS_BACKEND=$backend: tests/test_rules.py tests/test_engines.py tests/test_programs.py $extra"
  cat "$logs/$backend"
done
wait "$jax" || status=1
echo "== KERAS_BACKEND=jax: the rest of the suite, then the next Keras"
cat "$logs/jax"
exit "$status"
