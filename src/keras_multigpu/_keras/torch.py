"""Keras's torch internals the torch engine uses (see `keras_multigpu._keras`).

Patched for a call: `random.{normal, uniform, truncated_normal, randint, dropout}`,
`numpy.{max, min}`, `image.affine_transform`, `_compute_loss` on keras.Model (`COMPUTE_LOSS`,
Trainer's); where
Keras's torch trainer wraps a model in DDP itself (the next Keras), `KERAS_DDP`; and, where
Keras's torch tree keeps what it flattens in reference cycles (Keras 3.15), torch's
`torch.utils._pytree.tree_flatten`, which that tree calls (`cycle_free_tree`).
"""

import contextlib
import gc
import inspect
import weakref

import keras
from torch.utils import _pytree

from keras_multigpu._keras import load

DRAWS = ("normal", "uniform", "truncated_normal", "randint", "gamma", "binomial", "beta")
# Keras's own steps call a model's `compute_loss` through it: patched on keras.Model for a call
# (`_torch_grads.compute_loss`).
COMPUTE_LOSS = "_compute_loss"

TABLE = {
    "keras.src.backend.torch.random": (*DRAWS, "dropout", "categorical",
                                       "_get_concrete_noise_shape"),
    "keras.src.backend.torch.numpy": ("max", "min"),
    "keras.src.backend.torch.image": ("affine_transform",),
    "keras.src.trainers.trainer": (f"Trainer.{COMPUTE_LOSS}",),
}

random, numpy, image, _ = load(TABLE, "the torch engine")

# The next Keras's torch trainer wraps the model in DistributedDataParallel as it makes its
# step functions, wherever torch.distributed is initialized (Keras 3.15 has no such method;
# where Keras has it, `keras_alone_in_each_process` makes it follow `keras.distribution`).
KERAS_DDP = "_initialize_ddp"


def keras_alone_in_each_process(in_call, metrics_result):
    """Where Keras's torch trainer runs DDP itself wherever torch.distributed is initialized
    (the next Keras: `KERAS_DDP`), it does not in the torch engine's processes, unless a
    `keras.distribution` is set (called once the engine has joined them).

    The process group is the engine's. Inside a call (`in_call()`) the engine all-reduces
    the gradients itself, weighed by rows: a DDP wrapper would never run a step, yet it
    would broadcast the weights again and hold a buffer as large as the gradients. Outside
    one, a Keras model (the template among them) runs in each process alone, as on Keras
    3.15, its metrics read by `metrics_result` (Keras's generic `get_metrics_result`): its
    `predict` or `evaluate` on one process must not wait for the others (Keras's DDP setup
    and its metrics' sum across processes are collectives).
    """
    owner = next((c for c in keras.Model.__mro__ if KERAS_DDP in vars(c)), None)
    if owner is None or hasattr(getattr(owner, KERAS_DDP), "_keras_multigpu_original"):
        return
    initialize_ddp, own_result = getattr(owner, KERAS_DDP), owner.get_metrics_result

    def follow_ddp(model):
        if keras.distribution.distribution() is not None and not in_call():
            return initialize_ddp(model)
        return None

    def follow_metrics_result(model):
        if keras.distribution.distribution() is not None:
            return own_result(model)
        return metrics_result(model)

    follow_ddp._keras_multigpu_original = initialize_ddp
    follow_metrics_result._keras_multigpu_original = own_result
    setattr(owner, KERAS_DDP, follow_ddp)
    owner.get_metrics_result = follow_metrics_result

_TREE_FLATTEN = _pytree.tree_flatten


def _tree_flatten(tree, is_leaf=None):
    """torch's `tree_flatten`, letting go of `is_leaf` as it returns.

    torch's `tree_flatten` recurses through a closure that refers to itself, and so to the
    `is_leaf` it is given: a reference cycle, which only the garbage collector frees. Keras
    3.15's torch tree passes an `is_leaf` that refers to the structure it flattens, and
    every layer call flattens its inputs: each step's activations stayed alive until a
    collection. On 2 CPU processes (MiniGoogLeNet without BatchNorm) that was about 23 MB
    a step per process, and epochs of 0.7 s took up to 1.2 s. Keras's main branch no
    longer refers to the structure there.
    """
    if is_leaf is None:
        return _TREE_FLATTEN(tree)
    held = [is_leaf]  # emptied on return: the cycle torch leaves holds nothing of the caller's
    try:
        return _TREE_FLATTEN(tree, is_leaf=lambda node: held[0](node))
    finally:
        held.clear()


def _keeps_leaves_in_cycles():
    """Whether Keras's tree (`keras.tree`: torch's pytree on the torch backend) leaves a
    structure's leaves to the garbage collector."""

    class Leaf:
        pass

    leaf = Leaf()
    alive = weakref.ref(leaf)
    enabled = gc.isenabled()
    gc.disable()  # a collection between the call and the check would hide the cycle
    try:
        keras.tree.traverse(lambda _: None, [leaf])
        del leaf
        return alive() is not None
    finally:
        if enabled:
            gc.enable()


# Patched only where it helps and where torch's function is the one `_tree_flatten` stands in
# for (same parameters); elsewhere calls run as they are.
PATCH_TREE = (_keeps_leaves_in_cycles()
              and list(inspect.signature(_TREE_FLATTEN).parameters) == ["tree", "is_leaf"])


@contextlib.contextmanager
def cycle_free_tree():
    """For the duration, torch's `tree_flatten` frees what it flattened as soon as it
    returns, where Keras's tree keeps it in cycles (nested scopes patch once)."""
    if not PATCH_TREE or _pytree.tree_flatten is _tree_flatten:
        yield
        return
    _pytree.tree_flatten = _tree_flatten
    try:
        yield
    finally:
        _pytree.tree_flatten = _TREE_FLATTEN
