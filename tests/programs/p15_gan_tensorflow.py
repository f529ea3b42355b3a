"""A GAN with its own `compile(d_optimizer, g_optimizer, loss_fn)`, two optimizers and a
`train_step` written with `tf.GradientTape`, trained on a shuffled `tf.data` dataset.

Source: https://github.com/keras-team/keras-io/blob/master/guides/
custom_train_step_in_tensorflow.py ("Wrapping up: an end-to-end GAN example": the
discriminator and generator, the GAN class, its label noise of shape (2 x rows, 1)).
Adapted to run on a CPU in a test: every filter count and the latent size are divided by 8;
MNIST becomes 107 synthetic 28x28 images; the batch 64 becomes 25; 2 epochs. The model has
no `call`, so nothing is predicted (PREDICT = False).

Adam amplifies rounding here: the discriminator's gradients, summed over 13 + 12 rows instead
of 25, differ in their last bits, and Adam's division by their running root mean square
turns that into weights 5e-4 apart (relative) within two epochs. Its step builds float32
labels (`tf.ones`), so the control is SGD in float32 (EXACT_OPTIMIZER), under which the
weights agree to 1e-5; a copy whose labels follow the data's dtype, run in float64, agrees
to 5e-13 on 2 and 3 devices (measured by hand, not a test). Keras refuses to save the
weights of a model it never built (no `call`: on one device too), so nothing is saved
(SAVE = None).
"""

import keras
import numpy as np
import tensorflow as tf
from keras import layers

BACKENDS = ("tensorflow",)  # its step is written with tf.GradientTape
SOURCE = (
    "https://github.com/keras-team/keras-io/blob/master/guides/custom_train_step_in_tensorflow.py"
)
SAVE = None
PREDICT = False
AMPLIFIED = "Adam normalises the rounding of discriminator gradients summed per replica"
FLOAT64 = False  # its step makes float32 labels
SAMPLES, LATENT_DIM = 107, 16


class GAN(keras.Model):
    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")
        self.seed_generator = keras.random.SeedGenerator(1337)

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn

    def train_step(self, real_images):
        if isinstance(real_images, tuple):
            real_images = real_images[0]
        batch_size = tf.shape(real_images)[0]
        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator)
        generated_images = self.generator(random_latent_vectors)
        combined_images = tf.concat([generated_images, real_images], axis=0)
        labels = tf.concat([tf.ones((batch_size, 1)), tf.zeros((batch_size, 1))], axis=0)
        # Label noise, drawn for the 2 x rows of real and generated images.
        labels += 0.05 * keras.random.uniform(tf.shape(labels), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            predictions = self.discriminator(combined_images)
            d_loss = self.loss_fn(labels, predictions)
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply(grads, self.discriminator.trainable_weights)

        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator)
        misleading_labels = tf.zeros((batch_size, 1))
        with tf.GradientTape() as tape:
            predictions = self.discriminator(self.generator(random_latent_vectors))
            g_loss = self.loss_fn(misleading_labels, predictions)
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply(grads, self.generator.trainable_weights)

        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}


def _discriminator():
    return keras.Sequential([
        keras.Input(shape=(28, 28, 1)),
        layers.Conv2D(8, (3, 3), strides=(2, 2), padding="same"),
        layers.LeakyReLU(negative_slope=0.2),
        layers.Conv2D(16, (3, 3), strides=(2, 2), padding="same"),
        layers.LeakyReLU(negative_slope=0.2),
        layers.GlobalMaxPooling2D(),
        layers.Dense(1),
    ], name="discriminator")


def _generator():
    return keras.Sequential([
        keras.Input(shape=(LATENT_DIM,)),
        layers.Dense(7 * 7 * 16),
        layers.LeakyReLU(negative_slope=0.2),
        layers.Reshape((7, 7, 16)),
        layers.Conv2DTranspose(16, (4, 4), strides=(2, 2), padding="same"),
        layers.LeakyReLU(negative_slope=0.2),
        layers.Conv2DTranspose(16, (4, 4), strides=(2, 2), padding="same"),
        layers.LeakyReLU(negative_slope=0.2),
        layers.Conv2D(1, (7, 7), padding="same", activation="sigmoid"),
    ], name="generator")


def build():
    return GAN(discriminator=_discriminator(), generator=_generator(), latent_dim=LATENT_DIM)


def EXACT_OPTIMIZER():  # noqa: N802 (a constant-like factory)
    return keras.optimizers.SGD(0.01)


def compile(model, optimizer=None):
    """The source's compile; with `optimizer` (the control), one like it for each network."""
    make = (lambda: keras.optimizers.Adam(learning_rate=0.0003)) if optimizer is None else (
        lambda: type(optimizer).from_config(optimizer.get_config()))
    model.compile(
        d_optimizer=make(),
        g_optimizer=make(),
        loss_fn=keras.losses.BinaryCrossentropy(from_logits=True),
    )


def _digits():
    rng = np.random.default_rng(15)
    return (rng.random((SAMPLES, 28, 28, 1)) ** 3).astype("float32")


def fit_kwargs(workdir):
    dataset = tf.data.Dataset.from_tensor_slices(_digits())
    dataset = dataset.shuffle(buffer_size=1024).batch(25)
    return {"x": dataset, "epochs": 2, "verbose": 0}

