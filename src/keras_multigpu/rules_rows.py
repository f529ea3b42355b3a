"""Keras ops that refuse an empty batch, on a replica dealt no rows (a last batch smaller
than the replica count), where one device never has one. Rules of `rules.table`."""

import keras

from keras_multigpu._keras import backend

# Keras's FFTs and STFTs: torch's refuse a batch of no rows ("MKL FFT error"; keras-io's
# FNet), and TensorFlow's and torch's `stft` pad by reflection, which refuses one too.
TRANSFORMS = ("fft", "fft2", "ifft2", "rfft", "irfft", "stft", "istft")


def table(step):
    """This module's rules, as `rules.table` lists them."""
    return [(backend.nn, "ctc_loss", ctc_loss, step),
            *((backend.math, name, transform, step) for name in TRANSFORMS)]


def ctc_loss(replica, original, target, output, target_length, output_length, mask_index=0):
    """Keras's `ctc_loss` fails on zero rows on TensorFlow (a scatter into an empty shape)
    and torch (an empty `log_probs`). There, the loss of no rows is an empty vector (keras-io's
    OCR model adds it with `add_loss`, which sums it), still tied to `output`, so that the
    step's gradient reaches the model."""
    output = keras.ops.convert_to_tensor(output)
    dtype = keras.backend.result_type(output.dtype, "float32")

    def some():
        return original(target, output, target_length, output_length, mask_index)

    def none():
        return keras.ops.cast(keras.ops.sum(output, axis=(1, 2)), dtype) * 0

    return _some_or_none(output, some, none)


def transform(replica, original, x, *args, **kwargs):
    """One of Keras's `TRANSFORMS` of `x` (a batch of signals, or a (real, imag) pair of
    them): on a batch of no rows, the transform of one row of zeros, of which it keeps no
    row, tied to `x`."""
    x = keras.tree.map_structure(keras.ops.convert_to_tensor, x)
    first = keras.tree.flatten(x)[0]
    if len(first.shape) < 2:  # one signal, not a batch
        return original(x, *args, **kwargs)

    def none():
        row = keras.tree.map_structure(
            lambda t: keras.ops.zeros((1, *keras.ops.shape(t)[1:]), t.dtype), x)
        tie = keras.ops.sum(first)  # 0, from no rows
        return keras.tree.map_structure(lambda y: y[:0] + keras.ops.cast(tie, y.dtype) * 0,
                                        original(row, *args, **kwargs))

    return _some_or_none(first, lambda: original(x, *args, **kwargs), none)


def _some_or_none(x, some, none):
    """`some()` where `x` has rows, else `none()`: decided now where its rows are known (an
    eager step, or a trace that knows them), else in the step."""
    rows = x.shape[0]
    if isinstance(rows, int):
        return some() if rows else none()
    return keras.ops.cond(keras.ops.shape(x)[0] > 0, some, none)
