"""A layer's or a model's own state, kept apart by the replicas: a warning that names it.

Where each replica runs the model's step on its share of the rows (TensorFlow, torch), a
layer that updates a non-trainable variable from its rows (a row count, a running maximum:
`self.seen.assign_add(...)` in `call`) updates it from its replica's rows, where one device
updates it from the whole batch. No rule can make that one device's, and the replicas end
up holding different values. `StateCheck` compares them after the first training step of
each `fit` and at each epoch's end, and names each such variable once, with the fix: mark
the layer with `keras_multigpu.mixes_rows`, and it runs on the whole batch as on one device
(a variable of the model's own, updated in its `call` or its step: mark the function that
updates it). Keras's own layers (BatchNormalization's statistics, seed states) agree, by the
rules.
"""

import warnings
import weakref

import keras
import numpy as np

from keras_multigpu import backends, processes

_WARNED = weakref.WeakKeyDictionary()  # template -> the paths of variables named already


class ReplicaStateWarning(UserWarning):
    """A layer's or a model's non-trainable variable holds different values on the
    replicas."""


def _digest(value):
    """Two sums that tell apart two values of one variable: a sum, and one weighed by
    position (so that rows swapped or moved are told apart too), and their scale."""
    value = np.asarray(value, dtype=np.float64).reshape(-1)
    if not value.size:
        return [0.0, 0.0, 0.0]
    position = np.linspace(1.0, 2.0, value.size)
    return [float(value.sum()), float((value * position).sum()), float(np.abs(value).sum())]


def _owner(model, variable):
    """The layer of `model` whose variables hold `variable` (one it tracks, in its graph or
    not), or None where the variable is the model's own (an attribute of a subclassed
    model, such as a queue of past rows its step keeps)."""
    for layer in model._flatten_layers(include_self=False, recursive=False):
        if any(variable is v for v in layer.variables):
            return layer
    return None


def disagreeing(variables, copies, rtol=1e-5):
    """The variables among `variables` whose copies differ.

    `copies(variable)` gives its copies on this process's replicas; with several
    processes, every process calls this at the same point, and all get the same answer.

    >>> import numpy as np
    >>> class V:
    ...     def __init__(self, *copies): self.copies = [np.array(c) for c in copies]
    >>> same, apart = V([1.0, 2.0], [1.0, 2.0]), V([2.0], [1.0])
    >>> [v is apart for v in disagreeing([same, apart], lambda v: v.copies)]
    [True]
    """
    digests = [[_digest(c) for c in copies(v)] for v in variables]
    if processes.count() > 1:
        gathered = processes.all_gather_object(
            digests, "the comparison of the layers' state across processes")
        digests = [[d for rank in gathered for d in rank[i]] for i in range(len(variables))]
    found = []
    for variable, per_replica in zip(variables, digests):
        first = np.array(per_replica[0])
        gap = max(float(np.max(np.abs(np.array(d[:2]) - first[:2]))) for d in per_replica)
        scale = max(d[2] for d in per_replica)
        if gap > rtol * scale + 1e-6:
            found.append(variable)
    return found


class StateCheck(keras.callbacks.Callback):
    """Names, once per model, each non-trainable variable that the replicas hold apart (see
    the module). Every process runs it: with several, it gathers once per check."""

    def __init__(self, template, backend, distribution, replicas):
        super().__init__()
        self._template, self._backend, self._replicas = template, backend, replicas
        self._distribution = distribution
        self._first = True

    def _copies(self, variable):
        if backends.has(self._backend, "copies"):
            return self._backend.copies(variable)
        return [keras.ops.convert_to_numpy(variable)]

    def _check(self):
        variables = [v for v in self._template.non_trainable_variables
                     if keras.backend.standardize_dtype(v.dtype).startswith(("float", "int"))]
        warned = _WARNED.setdefault(self._template, set())
        found = disagreeing(variables, self._copies)
        if found:  # every process goes on from the first's (torch's: one per replica)
            self._backend.replicate(found, self._distribution)
        for variable in found:
            if variable.path in warned or processes.rank() != 0:
                continue
            warned.add(variable.path)
            layer = _owner(self._template, variable)
            if layer is None:
                who, fix = ("the model updates it itself (in its `call` or its own step)",
                            "make the update in a function of the batch's rows marked "
                            "@keras_multigpu.mixes_rows: called with the replica's rows, it "
                            "runs on the whole batch")
            else:
                who, fix = (f"its layer {layer.name!r} updates it", "mark the layer so that "
                            "it runs on the whole batch: @keras_multigpu.mixes_rows on its "
                            "class, or keras_multigpu.mixes_rows(layer)")
            warnings.warn(
                f"The variable {variable.path!r} of model {self._template.name!r} holds "
                f"different values on its {self._replicas} replicas after training: {who} "
                "from its replica's rows, where one device updates it from the whole batch. "
                f"The first replica's value is the one kept. To update it as one device "
                f"does, {fix}.", ReplicaStateWarning, stacklevel=2)

    def on_train_batch_end(self, batch, logs=None):
        if self._first:
            self._first = False
            self._check()

    def on_epoch_end(self, epoch, logs=None):
        self._check()
