"""Keras ops that refuse an empty batch, on a replica dealt no rows (a last batch smaller
than the replica count), where one device never has one. Rules of `rules.table`."""

import keras


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

    rows = output.shape[0]
    if isinstance(rows, int):  # eager, or a trace that knows its rows
        return some() if rows else none()
    return keras.ops.cond(keras.ops.shape(output)[0] > 0, some, none)
