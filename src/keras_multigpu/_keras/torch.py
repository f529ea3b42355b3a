"""Keras's torch internals the torch engine uses (see `keras_multigpu._keras`).

Patched for a call: `random.{normal, uniform, truncated_normal, randint, dropout}`; and,
where Keras's torch tree keeps what it flattens in reference cycles, `tree_impl.torch_tree`
(`cycle_free_tree`).
"""

import contextlib
import gc
import types
import weakref

from keras_multigpu._keras import load

DRAWS = ("normal", "uniform", "truncated_normal", "randint")

TABLE = {
    "keras.src.backend.torch.random": (*DRAWS, "dropout", "_get_concrete_noise_shape"),
    "keras.src.tree.torchtree_impl": ("torch_tree", "traverse"),
}

(random, tree_impl) = load(TABLE, "the torch engine")


class _CycleFreeTree(types.ModuleType):
    """torch's pytree module, whose `tree_flatten` lets go of its `is_leaf` as it returns.

    torch's `tree_flatten` recurses through a closure that refers to itself, and so to the
    `is_leaf` it is given: a reference cycle, which only the garbage collector frees. Keras
    3.15's torch tree passes an `is_leaf` that refers to the structure it flattens, and
    every layer call flattens its inputs: each step's activations stayed alive until a
    collection. On 2 CPU processes (MiniGoogLeNet without BatchNorm) that was about 23 MB
    a step per process, and epochs of 0.7 s took up to 1.2 s. Keras's main branch no
    longer refers to the structure there.
    """

    def __init__(self, original):
        super().__init__(original.__name__)
        # torch's own names (functions, and the registry dict itself, shared), looked up as
        # fast as in torch's module: Keras's tree reads several of them for every node.
        vars(self).update({k: v for k, v in vars(original).items() if not k.startswith("__")})
        self._original = original
        self.tree_flatten = self._tree_flatten

    def _tree_flatten(self, tree, is_leaf=None):
        if is_leaf is None:
            return self._original.tree_flatten(tree)
        held = [is_leaf]  # emptied on return: the cycle torch leaves holds nothing of ours
        try:
            return self._original.tree_flatten(tree, is_leaf=lambda node: held[0](node))
        finally:
            held.clear()


def _keeps_leaves_in_cycles():
    """Whether Keras's torch tree leaves a structure's leaves to the garbage collector."""

    class Leaf:
        pass

    leaf = Leaf()
    alive = weakref.ref(leaf)
    enabled = gc.isenabled()
    gc.disable()  # a collection between the call and the check would hide the cycle
    try:
        tree_impl.traverse(lambda _: None, [leaf])
        del leaf
        return alive() is not None
    finally:
        if enabled:
            gc.enable()


KEEPS_LEAVES_IN_CYCLES = _keeps_leaves_in_cycles()


@contextlib.contextmanager
def cycle_free_tree():
    """For the duration, Keras's torch tree frees what it flattens as soon as it is done
    (where the installed Keras keeps it in cycles; nested scopes patch once)."""
    original = tree_impl.torch_tree
    if not KEEPS_LEAVES_IN_CYCLES or isinstance(original, _CycleFreeTree):
        yield
        return
    tree_impl.torch_tree = _CycleFreeTree(original)
    try:
        yield
    finally:
        tree_impl.torch_tree = original
