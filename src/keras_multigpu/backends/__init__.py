"""The backend seam: one module per Keras backend, the same names in each.

`current()` picks the module once, from `keras.backend.backend()`. Nothing
outside this package branches on the backend's name.

Every backend module defines the names in `API`, each with one meaning:

- `list_devices()`: the engine's devices as `keras_multigpu.Device` records
  (this starts the framework).
- `make_distribution(devices)`: the engine object that replicates variables
  and splits each batch over `devices`.
- `scope(distribution)`: a context manager in which the engine's steps run
  and new variables are created replicated.
- `replicate(variables, distribution, optimizers=())`: place existing
  variables on every device of `distribution` (models are usually built
  before it exists), and point the model's `optimizers` at the engine.
- `tag(batch, rows, replicas)`: on the host, a padded batch (its real rows
  first) as handed to Keras, marked with its real row count `rows`.
- `untag(data)`: inside the compiled step, the real rows of a tagged batch
  (any other data unchanged), so that the model's own step sees exactly the
  rows one device would.
- `run_step(step, data, rows_out=False)`: inside the compiled step, call
  the model's own `step` on the real rows of `data`, with whatever the
  engine needs around it to make the result one device's (the TensorFlow
  and torch engines weigh each replica's reductions there). `rows_out`
  (predict): the result has a row per input row, and must hold all of them.
- `process_index()`, `process_count()`: this process's rank and the process
  count (the torch engine runs one process per device; the others, one per
  host).

What an engine does beyond those is data: its `CAPABILITIES` names each
capability it has, and it defines the functions of those (`CAPABILITY_NAMES`)
and of no other. Where an engine lacks one, the caller does what one device
would (the `check` test in tests/test_backends.py holds every engine to this):

- "cpu_devices": `configure_cpu_devices(count)` asks for `count` virtual CPU
  devices; it must run before the framework starts, and returns False when it
  is too late (JAX, TensorFlow; torch runs a process per CPU device instead).
- "check_model": `check_model(model)` refuses a model the engine cannot take
  over (one that another tf.distribute strategy owns).
- "jit": the steps are compiled as the model asks (`jit_compile`); without
  it they are not (TensorFlow: replicas see batches of varying size, and Keras
  turns XLA off under tf.distribute; torch: the rules are Python, which
  `torch.compile` would trace away).
- "xla_draws": `jit_compile(distribution, wanted)`, the `jit_compile` the engine's steps
  take for a model that asks for `wanted` (one device's choice), where "jit" is missing:
  TensorFlow's replica steps run without XLA and make Keras's draws inside them with XLA
  where `wanted`, as one device's XLA step draws them; without either, no XLA (torch).
- "release": `release(variables, distribution, optimizers=(), failed=False)`
  leaves the variables usable by the model alone at the end of a call
  (`failed`: ended by an exception); without it they serve it as they are
  (JAX's replicated arrays).
- "copies": `copies(variable)`, the variable's value on each of this process's replicas
  (TensorFlow keeps one per replica of a variable its replicas assign apart; the layer state
  check, `_replica_state`, compares them); elsewhere a process holds one value.
- "recompile": `recompiled(variables, distribution)`, after the model is compiled again:
  drops per-variable state that only a new trace may replace (TensorFlow's twins of
  variables frozen or unfrozen since); elsewhere nothing outlives a compile.
- "resident": `resident(arrays, distribution)` places a dataset on the
  devices once and returns `take(index)`, which gathers a batch there,
  already split (JAX); without it each batch travels from the host.
- "shard": `shard(arrays, distribution)` places one host batch on the
  devices, split along the batch axis, without waiting for the copy (JAX);
  without it Keras's trainer takes the host batch (TensorFlow's distributed
  dataset splits it; each torch process takes its share in `run_step`).
- "free_memory": `free_memory(devices)`, bytes free on each device (CPU
  devices: an equal share of the host's available memory), None where
  unknown; without it the memory is unknown.
- "watch": `watch(function, distribution, what)` ends one of Keras's
  compiled steps (`what` names it) with a clear message where a collective
  in it could otherwise wait for ever (JAX; torch's collectives end in an
  error of their own, and TensorFlow's between one process's replicas cannot
  be timed).
- "collective_errors": `collective_error(error)`, the `processes.CollectiveError` that
  says what the engine's own error from a step's collective means (a process that
  stopped, or one that did not join within KERAS_MULTIGPU_TIMEOUT), or None for any other
  error (TensorFlow's workers); elsewhere a call's error is raised as it is (torch's
  collectives raise a `CollectiveError` of their own; JAX's steps are watched).
- "kept": `kept(function, model)`, one of Keras's compiled steps for `model`
  that puts the state it was given back into the model's variables when it
  raises, and `put_back(model)`, which puts the state the last step left back
  after a call raised between steps (JAX: Keras's trainer takes them out for a
  call's loop, and left them empty after a failed step, or an interruption or a
  failed callback in `evaluate` or `predict`); elsewhere the variables hold the
  state.
- "generator": `random_state()`, `set_random_state(state)`, the framework's
  own global generator, which Keras's adapters draw orders from (torch's), as
  plain data; elsewhere they draw from Python's and NumPy's (or tf.data's op
  seeds), which `batching` keeps.
- "to_backend": `to_backend(batch)`, a served batch as the backend's trainer
  takes it from a `DataLoader` (torch tensors); elsewhere the batch itself.
- "batch_spec": `batch_spec(iterator)`, for trainers that build before
  tracing (TensorFlow's), the batch structure as KerasTensors, without
  reading a batch or making an iterator (which draws a reshuffling
  dataset's next order); elsewhere Keras's trainer reads its build batch itself.
- "process_per_device": one process per device (torch): a script started
  with `python` on several devices is relaunched by the launcher
  (`keras_multigpu.launch.relaunch`).
- "multi_step": Keras's `steps_per_execution` above 1 runs as Keras runs it;
  without it (TensorFlow: Keras's multi-step loop fails under tf.distribute,
  keras-team/keras#19246) the steps run one per execution, with a warning, unless
  the engine has "lone_multi_step": `steps_per_execution(distribution, wanted)`, the
  steps per execution it runs (TensorFlow: `wanted` on one device without a strategy,
  as plain Keras; else 1).
- "whole_batch": the model's own step sees the whole global batch (JAX's one SPMD
  program), so state shaped by a fixed batch (a stateful RNN's) is one device's; without it
  each replica's step sees its share, and a model with such state is refused on several
  devices.
- "text": the model can take text (string tensors: TensorFlow's, for a
  TextVectorization or StringLookup inside the model); elsewhere arrays of
  strings are refused before Keras reads them.
- "metric_shares": `global_metric_state(variables)`, the metrics' global
  values from every process's share, and `local_metric_state(variables,
  values)`, this process's share of saved global values (torch, whose
  processes each hold a share); elsewhere the metric variables hold the
  global values (a `Checkpoint` saves and restores them as they are).

With several processes, each engine hands `keras_multigpu.processes` its
key-value store when they join: the process rules (saves, random state,
the stop agreement, `all_gather_object`) are written there once.
"""

import functools
import importlib

API = (
    "list_devices",
    "make_distribution",
    "scope",
    "replicate",
    "tag",
    "untag",
    "run_step",
    "process_index",
    "process_count",
)

# Each capability, and the functions an engine that has it defines.
CAPABILITY_NAMES = {
    "cpu_devices": ("configure_cpu_devices",),
    "check_model": ("check_model",),
    "jit": (),
    "xla_draws": ("jit_compile",),
    "release": ("release",),
    "copies": ("copies",),
    "recompile": ("recompiled",),
    "resident": ("resident",),
    "shard": ("shard",),
    "free_memory": ("free_memory",),
    "watch": ("watch",),
    "collective_errors": ("collective_error",),
    "kept": ("kept", "put_back"),
    "generator": ("random_state", "set_random_state"),
    "to_backend": ("to_backend",),
    "batch_spec": ("batch_spec",),
    "process_per_device": (),
    "multi_step": (),
    "lone_multi_step": ("steps_per_execution",),
    "metric_shares": ("global_metric_state", "local_metric_state"),
    "whole_batch": (),
    "text": (),
}


def has(backend, capability):
    """Whether the engine `backend` (a module of this package) has `capability`."""
    if capability not in CAPABILITY_NAMES:
        raise KeyError(f"No capability {capability!r}: one of {sorted(CAPABILITY_NAMES)}.")
    return capability in backend.CAPABILITIES


BACKENDS = ("jax", "tensorflow", "torch")


@functools.cache
def current():
    """Returns the module for the Keras backend in use."""
    import keras  # here, not at import: the CLI's `devices` and `launch` need no framework

    name = keras.backend.backend()
    if name not in BACKENDS:
        raise ValueError(
            f"keras_multigpu supports the Keras backends {BACKENDS}. "
            f"Received: KERAS_BACKEND={name!r}."
        )
    return importlib.import_module(f"{__name__}.{name}")
