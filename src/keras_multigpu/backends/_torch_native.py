"""torch's own layers inside a Keras model (a `TorchModuleWrapper`'s module, or a torch
module a model's `call` runs): torch's dropout and batch normalization, as one device runs
them on the whole batch. Rules of the torch engine's table (`torch._rules_table`), in force
inside its steps; Keras's own layers have theirs in `rules`."""

import math

import torch

from keras_multigpu import rules


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
