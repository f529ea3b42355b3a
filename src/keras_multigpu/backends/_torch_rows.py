"""Keras's torch ops on a process dealt no rows (a last batch smaller than the process
count): some refuse a tensor with an empty dimension, where one device never has one.
Rules of the torch engine's table (`torch._rules_table`), in force inside its steps."""

import math

import keras
import torch


def max_or_min(reduce, lowest):
    """Keras's torch `max` or `min` refuses a tensor with an empty dimension: on a process
    dealt no rows, a reduction over the other axes (GlobalMaxPooling2D's) is torch's
    `reduce`, as empty as the rows; one over the rows (a step's `ops.max(y_pred)`) is the
    reduction's identity (`lowest`: -inf for `max`, +inf for `min`), as a TensorFlow
    replica dealt no rows gets it. The rules weigh whatever it feeds by the process's
    rows, none. Elsewhere an empty tensor stays Keras's error, as on one device."""

    def rule(replica, original, x, axis=None, keepdims=False, initial=None):
        x = keras.ops.convert_to_tensor(x)
        if initial is None and 0 in x.shape:
            axes = range(x.ndim) if axis is None else [
                a % x.ndim for a in (axis if isinstance(axis, (list, tuple)) else [axis])]
            axes = sorted(set(axes))
            if getattr(replica, "k", None) == 0:
                for a in axes:
                    if x.shape[a] == 0:  # one entry of the identity along it
                        shape = list(x.shape)
                        shape[a] = 1
                        x = torch.cat([x, torch.full(shape, _identity(x.dtype, lowest),
                                                     dtype=x.dtype, device=x.device)], dim=a)
            if all(x.shape[a] for a in axes):
                return reduce(x, dim=axes, keepdim=keepdims)
        return original(x, axis=axis, keepdims=keepdims, initial=initial)

    return rule


def _identity(dtype, lowest):
    """The identity of `max` (`lowest`) or `min` for `dtype`."""
    if dtype == torch.bool:
        return not lowest
    if dtype.is_floating_point:
        return -math.inf if lowest else math.inf
    info = torch.iinfo(dtype)
    return info.min if lowest else info.max


def no_images(replica, original, images, *args, **kwargs):
    """Keras's torch `affine_transform` (RandomZoom, RandomRotation, RandomTranslation,
    RandomShear) stacks its images one by one, and torch cannot stack none: a batch of no
    images is transformed into itself."""
    images = keras.ops.convert_to_tensor(images)
    if images.ndim == 4 and images.shape[0] == 0:
        return images
    return original(images, *args, **kwargs)


def reshape_rows(replica, original, x, newshape):
    """Keras's torch `reshape` to `(rows, -1, ...)` (`ops.reshape(x, (ops.shape(x)[0], -1,
    d))`, a ViT's patches): torch cannot size the -1 of a tensor with no rows. There it is
    what it is for any number of rows: each row's size over the other sizes given."""
    x = keras.ops.convert_to_tensor(x)
    shape = list(newshape) if isinstance(newshape, (list, tuple)) else None
    if shape and x.ndim and x.shape[0] == 0 and shape[0] == 0 and shape.count(-1) == 1:
        per_row = math.prod(x.shape[1:])
        known = math.prod(int(s) for s in shape[1:] if s != -1)
        if known and per_row % known == 0:
            shape[shape.index(-1)] = per_row // known
            return original(x, tuple(shape))
    return original(x, newshape)
