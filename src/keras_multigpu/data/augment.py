"""Random shifts and horizontal flips, inside the compiled training step.

The recipe's augmentation (ImageDataGenerator's `width_shift_range=0.1,
height_shift_range=0.1, horizontal_flip=True`, edge pixels repeated) as a
layer, so it runs on the device with the step instead of on the host.

Each output pixel is *selected* from the input with one-hot matrices,

    out[b, i, j] = sum_k sum_l rows[b, i, k] * image[b, k, l] * cols[b, j, l]

two batched matrix products whose batch axis is the data-parallel axis, so
every replica transforms its own images with no communication. (Keras's
`RandomTranslation` gathers with `map_coordinates`; on JAX with several
virtual CPU devices that program deadlocked in an XLA all-reduce.) Pixels
are copied exactly, shifts are whole pixels: up to 10 % of the side, 3 px on
CIFAR-10's 32 × 32.
"""

import keras
from keras import ops


@keras.saving.register_keras_serializable(package="keras_multigpu")
class RandomShiftFlip(keras.layers.Layer):
    """Shifts each image by up to `max_shift` of its size and flips half of them.

    Active with `training=True` only; an identity otherwise.

    Args:
        max_shift: largest shift, as a fraction of height and width.
        flip: whether to flip images horizontally with probability 1/2.
        seed: seed of the layer's random draws.

    Example:

    >>> import numpy as np
    >>> layer = RandomShiftFlip(0.1, seed=0)
    >>> images = np.random.rand(4, 32, 32, 3).astype("float32")
    >>> out = layer(images, training=True)
    >>> tuple(out.shape), bool(np.isin(np.asarray(out), images).all())
    ((4, 32, 32, 3), True)
    """

    def __init__(self, max_shift=0.1, flip=True, seed=None, **kwargs):
        # Exact copies need exact arithmetic: never run in bfloat16.
        kwargs.setdefault("dtype", "float32")
        super().__init__(**kwargs)
        if not 0.0 <= max_shift < 1.0:
            raise ValueError(f"max_shift must be in [0, 1). Received: max_shift={max_shift}.")
        self.max_shift = max_shift
        self.flip = flip
        self.seed = seed
        self.seed_generator = keras.random.SeedGenerator(seed)

    def _selection(self, batch, size, flip=None):
        """One-hot (batch, size, size) matrices: output index -> source index."""
        limit = int(self.max_shift * size)
        shift = keras.random.randint((batch, 1), -limit, limit + 1, seed=self.seed_generator)
        position = ops.arange(size)[None, :]
        if flip is not None:
            position = ops.where(flip[:, None], size - 1 - position, position)
        source = ops.clip(position + shift, 0, size - 1)
        return ops.one_hot(source, size, dtype=self.compute_dtype)

    def call(self, images, training=None):
        if not training:
            return images
        images = ops.cast(images, self.compute_dtype)
        batch, height, width = ops.shape(images)[0], images.shape[1], images.shape[2]
        flip = None
        if self.flip:
            flip = keras.random.uniform((batch,), seed=self.seed_generator) < 0.5
        rows = self._selection(batch, height)
        cols = self._selection(batch, width, flip)
        shifted = ops.einsum("bik,bklc->bilc", rows, images)
        return ops.einsum("bjl,bilc->bijc", cols, shifted)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "max_shift": self.max_shift, "flip": self.flip,
                "seed": self.seed}
