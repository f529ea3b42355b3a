"""PyTorch engine: one process per device, joined by torch.distributed.

Keras's own torch trainer runs in every process (`keras-multigpu launch`
or `torchrun` starts them; `python script.py` relaunches itself under the
launcher). NCCL joins GPUs, gloo joins CPU processes. Every process reads
the whole global batch (the same data, in the same order: the random
generators are rank 0's) and its step runs on its own contiguous share of
the real rows, k_r of n. Exactness comes from `keras_multigpu.rules`, the rules
the TensorFlow engine keeps too, installed for the length of a call with torch's
collectives as their all-reduce:

    one device's value = sum over ranks r of (k_r / n) * value_r

Gradients are weighed by k_r / n (`rules.weigh_gradient`) and all-reduced before the optimizer
clips, accumulates or applies them, so a custom `train_step` with its own mean loss is
exact: in DDP's buckets during the backward pass (`_torch_reducer`), or, for a step that
hands `apply` other gradients than the backward pass left, at `apply`. The rules module
holds the rest: loss reductions, `Mean` updates, BatchNorm moments (one all-reduce
forward, one backward, whose gradients flow back through every rank's rows), batch-shaped
draws and dropout, and the logs (every metric's result from one all-reduce, which also
carries the ranks' Ctrl-C flags to the next step boundary). `predict` all-gathers the rows:
every rank returns every row, in order. The process rules (rank 0 alone writes Keras files,
every rank takes rank 0's random state and stops at the same step after a Ctrl-C):
`keras_multigpu.processes`, over the group's store.
"""

import contextlib
import dataclasses
import os
import threading
import warnings

import keras
import numpy as np
import torch
import torch.distributed as dist
from keras import tree

from keras_multigpu import interrupt, launch, rules
from keras_multigpu._keras.torch import DRAWS, cycle_free_tree, keras_alone_in_each_process
from keras_multigpu._keras.torch import image as torch_image
from keras_multigpu._keras.torch import numpy as torch_numpy
from keras_multigpu._keras.torch import random as torch_random
from keras_multigpu.backends import _torch_grads, _torch_native, _torch_rows
from keras_multigpu.backends._marker import tag, untag  # noqa: F401 (the seam's names)
from keras_multigpu.backends._torch_group import (
    _broadcast,
    _collective,
    _device,
    _flat_all_reduce,
    _join,
)
from keras_multigpu.backends._torch_reducer import Reducer
from keras_multigpu.devices import Device, cpu_device_count

# What this engine does beyond the seam's common names (see `keras_multigpu.backends`).
CAPABILITIES = frozenset({"release", "generator", "to_backend", "process_per_device",
                          "metric_shares", "multi_step"})

# Inside a step run by `run_step`: `state`, its `rules.Replica` (k, n, start as ints).
_replica = threading.local()

if "LOCAL_RANK" in os.environ and torch.cuda.is_available():
    # Before the user's model exists: Keras creates variables on "cuda", the current device.
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())


def _kind():
    return ("gpu", torch.cuda.get_device_name()) if torch.cuda.is_available() else ("cpu", "CPU")


def list_devices():
    """One device per process when launched; else this machine's GPUs (or CPU devices).

    Outside the launcher, more than one device means `multi_gpu_model`
    relaunches the script, unless KERAS_MULTIGPU_RELAUNCH=0 asks for one
    device.
    """
    kind, name = _kind()
    if launch.launched():
        world = int(os.environ["WORLD_SIZE"])
        return [Device(r, kind, name) for r in range(world)]
    count = torch.cuda.device_count() if kind == "gpu" else (cpu_device_count() or 1)
    if count > 1 and not launch.relaunch_allowed():
        warnings.warn(
            f"{launch.RELAUNCH_ENV}=0: training on one of this machine's {count} devices. The "
            "torch engine runs one process per device: start the script with "
            f"`keras-multigpu launch -n {count} ...` to use them all.",
            stacklevel=3,
        )
        count = 1
    return [Device(i, kind, name if kind == "gpu" or count == 1 else "CPU process")
            for i in range(count)]


class Engine:
    """The process group this process belongs to, and its rank."""

    def __init__(self, devices):
        self.devices = tuple(devices)
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0

    def scope(self):
        return scope(self)


def make_distribution(devices):
    if len(devices) > 1 and not launch.launched():
        raise RuntimeError(
            f"The torch engine runs one process per device: {len(devices)} devices need "
            f"`keras-multigpu launch -n {len(devices)} script.py` (multi_gpu_model relaunches "
            "a script itself)."
        )
    if launch.launched():
        world = int(os.environ["WORLD_SIZE"])
        if len(devices) != world:
            raise ValueError(
                f"multi_gpu_model chose {len(devices)} device(s), but this program runs as "
                f"{world} processes (WORLD_SIZE={world}), one per device. Pass gpus=None, or "
                f"launch it with -n {len(devices)}."
            )
        if world > 1:
            _join(generator=(random_state, set_random_state))
            # Keras's own DDP and metric sum (the next Keras) follow keras.distribution.
            keras_alone_in_each_process(in_call=lambda: _call() is not None,
                                        metrics_result=rules.generic_metrics_result)
    return Engine(devices)


def _active(distribution):
    return distribution is not None and distribution.world > 1


def replicate(variables, distribution, optimizers=()):
    """Gives every process rank 0's values (the template's, the optimizer's, the metrics')."""
    if _active(distribution):
        _broadcast([v for v in variables if v._value is not None])


def release(variables, distribution, optimizers=(), failed=False):
    """Ends the call at a barrier, so files rank 0 wrote during it are there for every rank.

    Not after a failure: the other processes may never reach it.
    """
    if _active(distribution) and not failed:
        _collective("barrier at the end of the call", dist.barrier)


# -- data -----------------------------------------------------------------


def random_state():
    """torch's global generator, which Keras's torch adapters draw orders from (a
    `DataLoader`'s seeds, a `RandomSampler`'s), as plain data. Every process holds rank
    0's (see `_join`), so each draws the same orders."""
    state = {"cpu": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def set_random_state(state):
    torch.set_rng_state(torch.tensor(state["cpu"], dtype=torch.uint8))
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))


def to_backend(batch):
    """A served batch (NumPy) as torch tensors on the current device, as Keras's own
    `DataLoader` wrapper converts them."""
    return tree.map_structure(keras.ops.convert_to_tensor, batch, none_is_leaf=False)


def process_index():
    return dist.get_rank() if dist.is_initialized() else 0


def process_count():
    return dist.get_world_size() if dist.is_initialized() else 1


# -- the step ---------------------------------------------------------------


def _share(n, world, rank):
    """(k, start): this rank's contiguous run of the n real rows (runs differ by at most 1)."""
    k = n // world + (rank < n % world)
    return k, rank * (n // world) + min(rank, n % world)


def _rows_of(data):
    first = next((leaf for leaf in tree.flatten(data) if leaf is not None), None)
    return None if first is None else int(first.shape[0])


def _gather_rows(outputs, k, n):
    """Every rank's k rows of `outputs`, joined in rank order (one device's rows, in order)."""
    world = dist.get_world_size()
    per = -(-n // world)
    counts = [_share(n, world, r)[0] for r in range(world)]

    def gather(t):
        if not isinstance(t, torch.Tensor) or t.ndim == 0:
            return t
        padded = torch.zeros((per, *t.shape[1:]), dtype=t.dtype, device=t.device)
        padded[:k] = t
        parts = [torch.empty_like(padded) for _ in range(world)]
        _collective("gather of the predictions", dist.all_gather, parts, padded)
        return torch.cat([p[:c] for p, c in zip(parts, counts)])

    return tree.map_structure(gather, outputs)


def run_step(step, data, rows_out=False):
    """Runs `step` (the model's own) on this process's share of the real rows.

    With `rows_out` (predict), the step's rows from every process are
    gathered, so each returns one output row per input row, in order.
    """
    rows = untag(data)
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return step(rows)
    n = _rows_of(rows)
    if n is None:
        return step(rows)
    k, start = _share(n, dist.get_world_size(), dist.get_rank())
    mine = tree.map_structure(lambda a: None if a is None else a[start:start + k], rows)
    previous = getattr(_replica, "state", None)
    _replica.state = replica = rules.Replica(k, n, start, dist.get_world_size(), _sum,
                                             index=dist.get_rank(),
                                             summed=_torch_grads.sums_rows,
                                             sums=_torch_grads.sums_scalar)
    reducers = list(getattr(_installed, "reducers", {}).values())
    for reducer in reducers:
        reducer.begin(replica)
    try:
        with _torch_grads._few_rows(replica):
            result = step(mine)
    except BaseException:
        for reducer in reducers:
            reducer.finish(failed=True)
        raise
    finally:
        _replica.state = previous
    with contextlib.ExitStack() as finishing:  # each one finishes, whatever the others raise
        for reducer in reducers:
            finishing.callback(reducer.finish)
    return _gather_rows(result, k, n) if rows_out else rules.own_logs(replica, result)


# -- the rules, in force inside `scope` (keras_multigpu.rules) ------------


def _sum(values, what):
    """Sums `values` (tensors no gradient flows through) across processes."""
    return _flat_all_reduce([torch.as_tensor(v).detach().clone().to(_device()) for v in values],
                            what)


def _step():
    """This process's `rules.Replica` inside a step run by `run_step`, else None."""
    return getattr(_replica, "state", None)


def _call():
    """A `rules.Replica` for the call (a metric's result is read outside the step too)."""
    if getattr(_installed, "engine", None) is None:
        return None
    return _step() or rules.Replica(None, None, None, dist.get_world_size(), _sum)


def _logs():
    """`_call()`'s `Replica` for a step's logs: the metrics' one all-reduce also sums every
    process's stop flag (a Ctrl-C), which the next step boundary takes (`interrupt.agreed`)
    instead of a store exchange of its own."""
    replica = _call()
    if replica is None:
        return None

    def all_reduce(values, what):
        flag = torch.tensor(float(interrupt.requested()), dtype=values[0].dtype)
        *summed, stop = _sum([*values, flag], what)
        interrupt.agreed(stop > 0)
        return summed

    return dataclasses.replace(replica, all_reduce=all_reduce)


def _apply(replica, original, self, grads, trainable_variables=None):
    """The gradients weighed by k / n (`rules.weigh_gradient`) and all-reduced, then the optimizer's
    own apply. The optimizer's first step all-reduces them here, and sets up a `Reducer`
    whose buckets later steps all-reduce during their backward pass (Keras's own step).
    A user's step has all-reduced them at its backward pass (`_torch_grads`)."""
    reducers = _installed.reducers
    reducer = reducers.get(id(self))
    if rules.held(replica, grads):
        reduced = grads
    else:
        reduced = None if reducer is None else reducer.take(grads, trainable_variables)
    if reduced is None:
        reduced = _torch_grads.weighed_sums(replica, grads, trainable_variables)
        if reducer is None and trainable_variables is not None and replica.own_step:
            reducers[id(self)] = Reducer(trainable_variables, _collective)
    grads = reduced
    # The optimizer's own step then runs outside the rules (it may call `apply` again).
    state, _replica.state = _replica.state, None
    try:
        return original(self, grads, trainable_variables)
    finally:
        _replica.state = state


def global_metric_state(variables):
    """The metrics' state over every process (their `sum` variables summed, `mean` ones
    averaged), as one device would hold it: what a checkpoint keeps (every process calls it).
    """
    values = [np.asarray(v.numpy()) for v in variables]
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return values
    summed = [i for i, v in enumerate(variables)
              if getattr(v, "aggregation", None) in ("sum", "mean")]
    if summed:
        reduced = _flat_all_reduce([torch.as_tensor(values[i]).to(_device()) for i in summed],
                                   "all-reduce of the metrics for a checkpoint")
        for i, value in zip(summed, reduced):
            value = value.cpu().numpy()
            values[i] = value / dist.get_world_size() if (
                variables[i].aggregation == "mean") else value
    return values


def local_metric_state(variables, values):
    """This process's part of the metrics' state `values` (one device's): the first process
    holds the sums, the others none of them (means and the rest: every process alike)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1) or dist.get_rank() == 0:
        return values
    return [None if value is None else np.zeros_like(value)
            if getattr(variable, "aggregation", None) == "sum" else value
            for variable, value in zip(variables, values)]


def _rules_table():
    return [
        (torch_numpy, "max", _torch_rows.max_or_min(torch.amax, lowest=True), _step),
        (torch_numpy, "min", _torch_rows.max_or_min(torch.amin, lowest=False), _step),
        (torch_numpy, "reshape", _torch_rows.reshape_rows, _step),
        (torch_image, "affine_transform", _torch_rows.no_images, _step),
        (torch.nn.functional, "dropout", _torch_native.dropout, _step),
        (torch.nn.functional, "batch_norm", _torch_native.batch_norm, _step),
        *_torch_native.draws(_step),
        *((owner, name, rule, _step) for owner, name, rule in _torch_grads.on_keras_steps()),
        (torch.autograd, "backward", _torch_grads.backward, _step),
        (torch.autograd, "grad", _torch_grads.grad, _step),
        (keras.optimizers.Optimizer, "apply", _apply, _step),
        # Its own `apply` checks the gradients are finite before the inner optimizer's:
        # on the sums, as one device checks its gradients, so every rank decides alike.
        (keras.optimizers.LossScaleOptimizer, "apply", _apply, _step),
        *((owner, name, _TORCH_RULES.get(rule, rule), guard) for owner, name, rule, guard
          in rules.table(_step, _call, torch_random, DRAWS, logs=_logs)),
    ]


# Rules of `rules.table` that this engine takes with more in front (`_torch_grads`).
_TORCH_RULES = {rules.mean_update: _torch_grads.mean_update}


_installed = threading.local()


@contextlib.contextmanager
def scope(distribution):
    """Installs the rules for the duration (nested scopes install them once).

    With one process there are no rules to install. The rules act only inside a
    step run by `run_step` (metrics: inside the call) and defer to Keras's
    own code everywhere else. With any count, Keras's torch tree frees each step's
    activations as the step ends (`cycle_free_tree`).
    """
    with cycle_free_tree():
        with _rules_scope(distribution):
            yield


@contextlib.contextmanager
def _rules_scope(distribution):
    if not _active(distribution) or getattr(_installed, "engine", None) is not None:
        yield
        return
    _installed.engine, _installed.reducers = distribution, {}
    try:
        with rules.installed(_rules_table()):
            yield
    finally:
        reducers, _installed.reducers, _installed.engine = _installed.reducers, {}, None
        with contextlib.ExitStack() as ending:
            for reducer in reducers.values():
                ending.callback(reducer.end)
