"""A convolutional VAE on MNIST whose own `train_step` computes its loss; `compile` gets
only an optimizer.

Source: https://github.com/keras-team/keras-io/blob/master/examples/generative/vae.py
(encoder, sampling layer, decoder and losses), with the step written the stateless JAX way
of https://github.com/keras-team/keras-io/blob/master/guides/custom_train_step_in_jax.py,
as the JAX backend requires. MNIST becomes 107 synthetic 28x28 images; the batch 128
becomes 25; `call` (absent from the source) decodes z_mean, so predict is deterministic.
"""

import jax
import keras
import numpy as np
from keras import layers, ops

BACKENDS = ("jax",)  # its step is written with jax.value_and_grad
SOURCE = "https://github.com/keras-team/keras-io/blob/master/examples/generative/vae.py"
SAVE = "weights"
LATENT_DIM = 2
SAMPLES = 107


class Sampling(layers.Layer):
    """Draws z from N(z_mean, exp(z_log_var)), as the source's layer does."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs):
        z_mean, z_log_var = inputs
        epsilon = keras.random.normal(shape=ops.shape(z_mean), seed=self.seed_generator)
        return z_mean + ops.exp(0.5 * z_log_var) * epsilon


def _encoder():
    inputs = keras.Input(shape=(28, 28, 1))
    x = layers.Conv2D(32, 3, activation="relu", strides=2, padding="same")(inputs)
    x = layers.Conv2D(64, 3, activation="relu", strides=2, padding="same")(x)
    x = layers.Flatten()(x)
    x = layers.Dense(16, activation="relu")(x)
    z_mean = layers.Dense(LATENT_DIM, name="z_mean")(x)
    z_log_var = layers.Dense(LATENT_DIM, name="z_log_var")(x)
    z = Sampling()([z_mean, z_log_var])
    return keras.Model(inputs, [z_mean, z_log_var, z], name="encoder")


def _decoder():
    latent_inputs = keras.Input(shape=(LATENT_DIM,))
    x = layers.Dense(7 * 7 * 64, activation="relu")(latent_inputs)
    x = layers.Reshape((7, 7, 64))(x)
    x = layers.Conv2DTranspose(64, 3, activation="relu", strides=2, padding="same")(x)
    x = layers.Conv2DTranspose(32, 3, activation="relu", strides=2, padding="same")(x)
    outputs = layers.Conv2DTranspose(1, 3, activation="sigmoid", padding="same")(x)
    return keras.Model(latent_inputs, outputs, name="decoder")


class VAE(keras.Model):
    def __init__(self, encoder, decoder, **kwargs):
        super().__init__(**kwargs)
        self.encoder = encoder
        self.decoder = decoder
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
        self.reconstruction_loss_tracker = keras.metrics.Mean(name="reconstruction_loss")
        self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

    @property
    def metrics(self):
        return [self.total_loss_tracker, self.reconstruction_loss_tracker, self.kl_loss_tracker]

    def call(self, inputs):
        z_mean, _, _ = self.encoder(inputs)
        return self.decoder(z_mean)  # the reconstruction of the mean: no sampling noise

    def vae_losses(self, trainable_variables, non_trainable_variables, data):
        mapping = list(zip(self.trainable_variables, trainable_variables))
        mapping += list(zip(self.non_trainable_variables, non_trainable_variables))
        with keras.StatelessScope(state_mapping=mapping) as scope:
            z_mean, z_log_var, z = self.encoder(data)
            reconstruction = self.decoder(z)
        non_trainable_variables = [
            scope.get_current_value(v) for v in self.non_trainable_variables
        ]
        reconstruction_loss = ops.mean(
            ops.sum(keras.losses.binary_crossentropy(data, reconstruction), axis=(1, 2))
        )
        kl_loss = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
        kl_loss = ops.mean(ops.sum(kl_loss, axis=1))
        total_loss = reconstruction_loss + kl_loss
        return total_loss, (reconstruction_loss, kl_loss, non_trainable_variables)

    def train_step(self, state, data):
        trainable_variables, non_trainable_variables, optimizer_variables, metrics_variables = (
            state
        )
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        grad_fn = jax.value_and_grad(self.vae_losses, has_aux=True)
        (total_loss, (reconstruction_loss, kl_loss, non_trainable_variables)), grads = grad_fn(
            trainable_variables, non_trainable_variables, x
        )
        trainable_variables, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable_variables
        )
        logs, new_metrics_variables, start = {}, [], 0
        for metric, value in zip(self.metrics, (total_loss, reconstruction_loss, kl_loss)):
            variables = metrics_variables[start : start + len(metric.variables)]
            start += len(metric.variables)
            variables = metric.stateless_update_state(variables, value)
            logs[metric.name] = metric.stateless_result(variables)
            new_metrics_variables += variables
        state = (trainable_variables, non_trainable_variables, optimizer_variables,
                 new_metrics_variables)
        return logs, state


def build():
    return VAE(_encoder(), _decoder())


def compile(model):
    model.compile(optimizer=keras.optimizers.Adam())


def _digits():
    rng = np.random.default_rng(1)
    return (rng.random((SAMPLES, 28, 28, 1)) ** 3).astype("float32")


def fit_kwargs(workdir):
    return {"x": _digits(), "epochs": 2, "batch_size": 25, "verbose": 0}


def predict_x():
    return _digits()
