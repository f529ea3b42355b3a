"""torch's own layers inside a Keras model (a `TorchModuleWrapper`'s module, or a torch
module a model's `call` runs): torch's dropout and batch normalization, as one device runs
them on the whole batch; and torch's own draws in a step of the user's (`torch.randn`), as
one device draws them. Rules of the torch engine's table (`torch._rules_table`), in force
inside its steps; Keras's own layers have theirs in `rules`."""

import math
import sys

import torch

from keras_multigpu import rules
from keras_multigpu._keras.torch import random as keras_random
from keras_multigpu.rules_random import batch_draw

# torch's draws from its global generator that a step of the user's may make for its rows
# (a GAN's `torch.randn(rows, latent)`), and those shaped like a tensor of them.
DRAWS, DRAWS_LIKE = ("randn", "rand", "randint"), ("randn_like", "rand_like")


def dropout(replica, original, input, p=0.5, training=True, inplace=False):
    """torch's `dropout` draws its mask from torch's generator, whose state every process
    shares: each process runs torch's dropout on ones for the batch's n rows, drawing one
    device's mask (and moving the generators alike), and keeps its own rows'. A tensor
    whose first dimension is not the process's rows is left to torch."""
    n, k, start = int(replica.n), int(replica.k), int(replica.start)
    if not training or not 0 < p < 1 or input.ndim == 0 or input.shape[0] != k or n == k:
        return original(input, p, training, inplace)
    noise = original(_ones(input, n), p, True, False)[start:start + k]  # the mask, scaled
    return input.mul_(noise) if inplace else input * noise


def _ones(input, n):
    """Ones for n rows, laid out in memory as `input` is where it is dense: torch draws a
    dropout mask in the memory order of its input (a mask like it, `empty_like`), and a
    strided convolution's output is a permuted view (Keras's torch `Conv1D(strides=2)`
    hands one laid out as (rows, channels, steps)). The order is by stride, where a dim of
    one element (rows of one, or none) shares its stride with the dim just outside it."""
    shape = (n, *input.shape[1:])
    order = sorted(range(input.ndim),
                   key=lambda d: (-input.stride(d), -input.shape[d], d))
    permuted = [input.shape[d] for d in order]
    dense = [1] * input.ndim
    for i in range(input.ndim - 2, -1, -1):
        dense[i] = dense[i + 1] * permuted[i + 1]
    if any(input.shape[d] > 1 and input.stride(d) != dense[i] for i, d in enumerate(order)):
        order = list(range(input.ndim))  # not dense: torch's mask is contiguous
    ones = torch.ones([shape[d] for d in order], dtype=input.dtype, device=input.device)
    return ones.permute([order.index(d) for d in range(input.ndim)])


class _Axes:
    """What `rules.moments` reads of a Keras BatchNormalization: the axes it reduces."""

    def __init__(self, ndim):
        self._reduction_axes = [0, *range(2, ndim)]


def batch_norm(replica, original, input, running_mean, running_var, weight=None, bias=None,
               training=False, momentum=0.1, eps=1e-5):
    """torch's `batch_norm` in training normalizes by the moments of the whole batch
    (`rules.moments`: one all-reduce forward and one backward, as for Keras's layer) and
    moves the running statistics by them, the variance unbiased over the batch's values
    per channel, as torch does."""
    if not training or input.ndim < 2:
        return original(input, running_mean, running_var, weight, bias, training, momentum,
                        eps)
    mean, variance = rules.moments(replica, None, _Axes(input.ndim), input, None)
    if running_mean is not None and running_var is not None:
        count = int(replica.n) * math.prod(input.shape[2:])
        with torch.no_grad():
            running_mean.mul_(1 - momentum).add_(momentum * mean.detach())
            running_var.mul_(1 - momentum).add_(
                momentum * variance.detach() * count / max(count - 1, 1))
    shape = [1, -1] + [1] * (input.ndim - 2)
    out = (input - mean.reshape(shape)) * torch.rsqrt(variance.reshape(shape) + eps)
    if weight is not None:
        out = out * weight.reshape(shape)
    return out if bias is None else out + bias.reshape(shape)


def draws(step):
    """The draw rules, as the engine's table takes them."""
    return [*((torch, name, global_draw, step) for name in DRAWS),
            *((torch, name, global_draw_like, step) for name in DRAWS_LIKE)]


def _own(kwargs):
    """Whether a draw is left to torch: from a generator of its own (not the global one,
    which every process shares), into `out`, a leaf that requires a gradient, or made by
    Keras's own draws (`keras.random.uniform` calls `torch.rand`), which the rules in
    `rules_random` draw for the batch already. The caller is two frames up: the rule, then
    the wrapper `rules.installed` put in torch's place."""
    return (kwargs.get("generator") is not None or kwargs.get("out") is not None
            or kwargs.get("requires_grad")
            or sys._getframe(3).f_globals.get("__name__") == keras_random.__name__)


def global_draw(replica, original, *args, **kwargs):
    """`torch.randn(rows, ...)`, `torch.rand` or `torch.randint(low, high, (rows, ...))`
    from torch's global generator, whose state every process shares: each process would
    draw the same numbers for its own rows, the same noise for different rows. A draw whose
    first dimension is whole multiples of this process's rows is drawn for the batch's n
    rows on every process (`rules_random.batch_draw`), and this process's rows are kept:
    one device's numbers, and the generator moved as one device moves it."""
    if _own(kwargs):
        return original(*args, **kwargs)
    if "size" in kwargs:
        bounds, size = args, kwargs.pop("size")
    elif original.__name__ == "randint":  # randint(high, size) or randint(low, high, size)
        bounds, size = args[:-1], args[-1]
    else:
        bounds, size = (), args[0] if len(args) == 1 and not isinstance(args[0], int) else args
    shape = [int(d) for d in size]

    def draw(drawn_shape, _):
        return original(*bounds, size=tuple(int(d) for d in drawn_shape), **kwargs)

    return batch_draw(replica, draw, shape, None)


def global_draw_like(replica, original, input, **kwargs):
    """`torch.randn_like(x)` or `torch.rand_like(x)` of a tensor of this process's rows, as
    `global_draw` draws: like a tensor of the batch's rows, in `input`'s memory layout (torch
    draws in memory order)."""
    if _own(kwargs) or input.ndim == 0:
        return original(input, **kwargs)

    def draw(drawn_shape, _):
        rows = int(drawn_shape[0])
        return original(input if rows == input.shape[0] else _ones(input, rows), **kwargs)

    return batch_draw(replica, draw, list(input.shape), None)
