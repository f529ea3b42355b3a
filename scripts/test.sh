#!/usr/bin/env bash
# The test command: sets itself up, then runs the suite on virtual CPU devices
# (no GPU needed), one pytest process per engine, since KERAS_BACKEND is fixed
# per process. Two streams share the cores; each run's output is printed when it ends.
# - Stream 1: the whole suite on JAX but the rule units (JAX's engine installs no rule);
#   the exactness tests (the engine contract, the batch order and shuffling) again on the
#   next Keras (../shared/keras-next,
#   Keras's main branch as a wheel, laid over the environment's Keras through PYTHONPATH,
#   so nothing else changes; each case at its largest device count there); then torch's
#   launcher tests across machines (tests/test_multihost.py) and the benchmark harness's
#   (tests/test_bench.py), and the
#   next Keras's exactness tests on torch, with torch's share of the real programs (whose
#   own trainer changed most on the next Keras: DDP and metrics across processes); then
#   TensorFlow's several-worker tests (tests/test_multihost_tf.py) and the launcher's own
#   tests (tests/test_launch.py, on JAX).
# - Stream 2: the behaviour suite on TensorFlow (two pytest processes) and on PyTorch
#   (whose multi-device tests fork one gloo process per device): the rule units, the engine
#   contract, the real Keras programs, semantics, parallel, errors, inputs, saving, callbacks
#   and the checkpoint's in-process tests (its killed runs start each engine in the JAX run),
#   and TensorFlow's exactness tests on the next Keras (whose trainer traces a step on a
#   concrete batch).
# The split keeps the two streams near the same length. The widest sweeps run a rotation:
# each real program on one of the three engines (tests/test_programs.py's `ENGINE`), and each
# case of the device-count sweeps at some of the counts (tests/conftest.py's `rotated`);
# KERAS_MULTIGPU_TEST_FULL=1 runs every pair (run it after a change to an engine).
# pytest exits non-zero when a test fails and 5 when no test ran; either fails
# this script.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh jax,test,peers,experiment
# torch's CPU build: a bare `pip install torch` would pull gigabytes of CUDA.
.venv/bin/python -m pip install -q torch==2.13.0
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
# JAX's persistent compilation cache, for this run only: the suite compiles the same small
# steps again and again (each test builds its models afresh, each subprocess starts cold),
# and on CPU devices compiling is most of a JAX test's time.
export JAX_COMPILATION_CACHE_DIR="$logs/jax-cache" JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
# TensorFlow's graph optimizer (grappler) off in the engine contract's TensorFlow runs
# (tests/conftest.py): rewriting each small step's graph is much of a TensorFlow test's time
# on the CPU; the engine contract on TensorFlow took 356 s instead of 405 s with it on (the
# two side by side). TensorFlow's behaviour suite keeps it on, as users run it.
export KERAS_MULTIGPU_TEST_NO_GRAPPLER=1
next_wheel=$(ls ../shared/keras-next/keras-*.whl 2>/dev/null | head -1 || true)
if [ -n "$next_wheel" ]; then
  .venv/bin/python -m pip install -q --no-deps --target "$logs/keras-next" "$next_wheel"
  # The bench's keras_dp_torch peer (tests/test_bench.py) runs from there.
  export KERAS_MULTIGPU_NEXT_KERAS="$logs/keras-next"
fi
# Of test_semantics, its shuffling tests (the whole of it would add a minute to CI).
next_shuffling="tests/test_semantics.py::test_shuffling_equals_keras_under_a_seed
  tests/test_semantics.py::test_shuffling_moves_the_global_generators_as_keras_does"
# The tests that follow what the next Keras does differently: its TensorFlow trainer's
# per-output loss logs (tests/conftest.py's output_losses_follow_tracing), its torch
# trainer's steps_per_execution.
next_tensorflow="tests/test_semantics.py::test_named_outputs_with_dict_targets_and_loss_weights
  tests/test_semantics.py::test_outputs_with_different_reductions_equal_one_device
  tests/test_parallel.py::test_multi_input_multi_output_equals_one_device"
next_torch="tests/test_parallel.py::test_steps_per_execution_equals_one_device"
next_keras() {  # the exactness tests on the next Keras, on backend $1
  if [ -z "$next_wheel" ]; then
    echo "== the next Keras: no wheel at ../shared/keras-next; its exactness tests did not run"
    return 0
  fi
  echo "== the next Keras ($(basename "$next_wheel")), KERAS_BACKEND=$1"
  # Each case at its largest device count alone (tests/conftest.py's ONE_COUNT): this Keras
  # runs every count.
  PYTHONPATH="$logs/keras-next" KERAS_BACKEND=$1 KERAS_MULTIGPU_TEST_ONE_COUNT=1 \
      .venv/bin/python -m pytest -q \
      -p no:cacheprovider $([ "$1" != jax ] && echo tests/test_rules.py) tests/test_engines.py \
      $([ "$1" = jax ] && echo tests/test_batching.py $next_shuffling) \
      $([ "$1" = tensorflow ] && echo $next_tensorflow) \
      $([ "$1" = torch ] && echo tests/test_programs.py $next_torch)
}
run() {  # a log name, a backend, then pytest's arguments: runs them, then prints the log
  local log=$1 backend=$2
  shift 2
  local status=0
  # --durations: the slowest tests, to keep the whole under 30 min; a test still running after
  # 120 s prints every thread's stack (TensorFlow's runs stall a test now and then).
  KERAS_BACKEND=$backend .venv/bin/python -m pytest -q -p no:cacheprovider --durations=10 \
      -o faulthandler_timeout=120 "$@" > "$logs/$log" 2>&1 || status=1
  echo "== KERAS_BACKEND=$backend: $*"
  cat "$logs/$log"
  return $status
}
# For the JAX runs: XLA:CPU's LLVM code generation at a lower level (the HLO passes, fusion
# and the collectives' schedule, are unchanged): most of a JAX test's time is compiling small
# steps, and these cut test_parallel's CPU time by 23 % (130 to 100 s). Every comparison in
# the suite runs both sides under the same flags; the training processes a test starts get
# them too (tests/conftest.py's child_env), but for the few that test XLA_FLAGS themselves.
jax_flags="--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
stream1() {
  local status=0
  export XLA_FLAGS=$jax_flags
  # The rule units (tests/test_rules.py) run on TensorFlow and torch, the engines that
  # install the rules: the JAX engine has a global view of the batch and installs none, and
  # JAX's eager ops, compiled one by one, made the units 93 s there (16 s on TensorFlow, 4 on
  # torch).
  run jax jax --ignore=tests/test_multihost.py --ignore=tests/test_multihost_tf.py \
      --ignore=tests/test_bench.py --ignore=tests/test_launch.py --ignore=tests/test_rules.py \
      "$@" || status=1
  next_keras jax || status=1
  run torch-hosts torch tests/test_multihost.py tests/test_bench.py || status=1
  next_keras torch || status=1
  # TensorFlow's several-worker tests (their workers join at import, before TensorFlow's
  # runtime starts, so they run in processes of their own) and the launcher's: here, where
  # they even the streams out (2170 s against 2580 s without them, at 2b77898).
  (unset XLA_FLAGS; KERAS_MULTIGPU_TEST_NO_GRAPPLER=0 run tensorflow-hosts tensorflow \
      tests/test_multihost_tf.py) || status=1
  run launch jax tests/test_launch.py || status=1
  return $status
}
stream1 "$@" > "$logs/stream1" 2>&1 &
first=$!
status=0
# The checkpoint's in-process tests: its killed runs start every engine from the JAX run.
checkpoint="tests/test_checkpoint.py --deselect tests/test_checkpoint.py::test_a_run_killed
  --deselect tests/test_checkpoint.py::test_a_ctrl_c"
contract="tests/test_rules.py tests/test_engines.py tests/test_programs.py"
behaviour="tests/test_semantics.py tests/test_parallel.py tests/test_errors.py
  tests/test_inputs.py tests/test_saving.py tests/test_callbacks.py $checkpoint"
# TensorFlow's in two processes: late in one long process, one test of test_callbacks took
# 134 to 281 s (6 s alone; its stack: tf.function tracing a dataset iterator) in three of
# the last runs.
run tensorflow tensorflow $contract || status=1
KERAS_MULTIGPU_TEST_NO_GRAPPLER=0 run tensorflow-behaviour tensorflow $behaviour || status=1
next_keras tensorflow > "$logs/next-tensorflow" 2>&1 || status=1
cat "$logs/next-tensorflow"
run torch torch $contract $behaviour || status=1
wait "$first" || status=1
echo "== stream 1: JAX, the next Keras, torch across machines, TensorFlow's workers, the launcher"
cat "$logs/stream1"
exit "$status"
