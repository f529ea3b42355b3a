"""The backend seam: one module per Keras backend, the same names in each.

`current()` picks the module once, from `keras.backend.backend()`. Nothing
outside this package branches on the backend's name.

Every backend module defines the names in `API`:

- `configure_cpu_devices(count)`: ask for `count` virtual CPU devices; must
  run before the framework starts. Returns False when it is too late.
- `list_devices()`: the engine's devices as `keras_multigpu.Device` records
  (this starts the framework).
- `make_distribution(devices)`: the engine object that replicates variables
  and splits each batch over `devices`.
- `check_model(model)`: refuse a model the engine cannot take over (one
  that another engine's scope owns).
- `scope(distribution)`: a context manager in which the engine's steps run
  and new variables are created replicated.
- `jit_compile(value)`: the `jit_compile` the engine's steps can take.
- `replicate(variables, distribution, optimizers=())`: place existing
  variables on every device of `distribution` (models are usually built
  before it exists), and point the model's `optimizers` at the engine.
- `release(variables, distribution, optimizers=(), failed=False)`: at the
  end of a call (`failed`: ended by an exception), leave the variables
  usable by the model alone (outside the engine).
- `resident(arrays, distribution)`: place a dataset on the devices once and
  return `take(index)`, which gathers a batch there, already split.
- `shard(arrays, distribution)`: place one host batch on the devices, split
  along the batch axis, without waiting for the copy.
- `random_state()`, `set_random_state(state)`: the framework's own global
  generator, which Keras's adapters may draw orders from (torch's), as plain
  data; None where Keras's adapters draw from none (Python's and NumPy's are
  kept by `batching`).
- `to_backend(batch)`: a served batch as the backend's trainer takes it from
  a `DataLoader` (torch tensors); the batch itself elsewhere.
- `free_memory(devices)`: bytes free on each device (CPU devices: an equal
  share of the host's available memory), None where unknown.
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
- `watch(function, distribution, what)`: one of Keras's compiled steps
  (`what` names it), ended with a clear message where a collective in it could
  otherwise wait for ever.
- `batch_spec(iterator)`: for trainers that build before tracing
  (TensorFlow's), the batch structure as KerasTensors, without reading a
  batch (None where the engine reads one itself).
- `process_index()`, `process_count()`: this process's rank and the process
  count (the torch engine runs one process per device; the others, one per
  host).

With several processes, each engine hands `keras_multigpu.processes` its
key-value store when they join: the process rules (saves, random state,
the stop agreement, `all_gather_object`) are written there once.
"""

import functools
import importlib

API = (
    "configure_cpu_devices",
    "list_devices",
    "make_distribution",
    "check_model",
    "scope",
    "jit_compile",
    "replicate",
    "release",
    "resident",
    "shard",
    "random_state",
    "set_random_state",
    "to_backend",
    "free_memory",
    "tag",
    "untag",
    "run_step",
    "watch",
    "batch_spec",
    "process_index",
    "process_count",
)

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
