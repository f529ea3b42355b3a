"""Denoising diffusion (DDIM): a model with its own `compile` (its own loss trackers and
`metrics`), a `train_step` that draws unseeded noise and diffusion times for its rows, mixes
them into the images, trains a residual U-Net (BatchNormalization without center or scale,
swish, skip connections, bilinear upsampling) and assigns an exponential moving average of
its weights to a second network; a `test_step` that denoises with that average; an adapted
Normalization; AdamW.

Source: https://github.com/keras-team/keras-io/blob/master/examples/generative/ddim.py
(DiffusionModel: `normalizer`, `network`, `ema_network = clone_model(network)`, compile's
`n_loss` and `i_loss` trackers, the cosine diffusion schedule between signal rates 0.02 and
0.95, `denoise`, train_step's EMA `ema_weight.assign(ema * ema_weight + (1 - ema) *
weight)`, AdamW with weight decay, mean absolute error). Adapted to run on a CPU in a test:
the flowers' 64x64 images become 107 synthetic 8x8 images; the U-Net of widths
[32, 64, 96, 128], depth 2, becomes widths [8, 12], depth 1, with the noise variance
embedded by a Dense layer instead of sinusoids; ema 0.999 becomes 0.9; KID is left out; the
batch 64 becomes 25, with validation_split=0.2, 2 epochs; the model's `compile` keeps its
loss (a MeanAbsoluteError, the mean the source's step takes) rather than passing it on.
The source draws its noise for `batch_size`, a constant, with batches of that size
(drop_remainder): here the rows are
read from the data (`ops.shape(images)[0]`), as a step that each device runs on its share
of the batch must (on TensorFlow and torch the constant fails there, and `fit` says so;
JAX's step sees the whole batch). The step takes its gradients with tf.GradientTape or
`backward()`, as the backend's own guide writes it (BACKENDS). The model has no `call`, so
nothing is predicted (PREDICT = False).

AdamW amplifies rounding here, though less than in p06, p23 or p25: with 97 images, the
last batch of 2 rows left one bias of the variance embedding 1.9 tolerance units from one
device's on the next Keras's TensorFlow at 2 devices (0.56 on Keras 3.15.1; under SGD 0.04,
and a control without padding 0.12 to 0.22). With 107 the last batch has 10 rows: 0.30 and
0.52 units (2026-11-29).
"""

import keras
import numpy as np
from keras import layers, ops

BACKENDS = ("tensorflow", "torch")  # its step is written with tf.GradientTape or backward()
SOURCE = "https://github.com/keras-team/keras-io/blob/master/examples/generative/ddim.py"
SAVE = "weights"
PREDICT = False
SAMPLES, SIZE = 107, 8
EMA, MIN_SIGNAL_RATE, MAX_SIGNAL_RATE = 0.9, 0.02, 0.95


def _data():
    rng = np.random.default_rng(26)
    x = rng.uniform(0, 1, (SAMPLES, SIZE, SIZE, 3)).astype("float32")
    x[:, : SIZE // 2] *= 0.5  # something to learn: a darker top half
    return x


def ResidualBlock(width):  # noqa: N802 (the source's name)
    def apply(x):
        residual = x if x.shape[3] == width else layers.Conv2D(width, kernel_size=1)(x)
        x = layers.BatchNormalization(center=False, scale=False)(x)
        x = layers.Conv2D(width, kernel_size=3, padding="same",
                          activation=keras.activations.swish)(x)
        x = layers.Conv2D(width, kernel_size=3, padding="same")(x)
        return layers.Add()([x, residual])

    return apply


def get_network(widths=(8, 12)):
    noisy_images = keras.Input(shape=(SIZE, SIZE, 3))
    noise_variances = keras.Input(shape=(1, 1, 1))
    e = layers.Dense(4)(noise_variances)
    e = layers.UpSampling2D(size=SIZE, interpolation="nearest")(e)
    x = layers.Conv2D(widths[0], kernel_size=1)(noisy_images)
    x = layers.Concatenate()([x, e])
    skip = ResidualBlock(widths[0])(x)
    x = layers.AveragePooling2D(pool_size=2)(skip)
    x = ResidualBlock(widths[1])(x)
    x = layers.UpSampling2D(size=2, interpolation="bilinear")(x)
    x = layers.Concatenate()([x, skip])
    x = ResidualBlock(widths[0])(x)
    x = layers.Conv2D(3, kernel_size=1, kernel_initializer="zeros")(x)
    return keras.Model([noisy_images, noise_variances], x, name="residual_unet")


class DiffusionModel(keras.Model):
    def __init__(self):
        super().__init__()
        self.normalizer = layers.Normalization()
        self.network = get_network()
        self.ema_network = keras.models.clone_model(self.network)

    def compile(self, loss=None, **kwargs):
        # The source passes `loss` on to Keras's compile and calls `self.loss`; torch's
        # trainer would call a compiled loss without targets when it builds the model (on
        # one device too), so the model keeps its loss itself.
        super().compile(**kwargs)
        self.loss_fn = loss
        self.noise_loss_tracker = keras.metrics.Mean(name="n_loss")
        self.image_loss_tracker = keras.metrics.Mean(name="i_loss")

    @property
    def metrics(self):
        return [self.noise_loss_tracker, self.image_loss_tracker]

    def diffusion_schedule(self, diffusion_times):
        start_angle = ops.cast(ops.arccos(MAX_SIGNAL_RATE), "float32")
        end_angle = ops.cast(ops.arccos(MIN_SIGNAL_RATE), "float32")
        diffusion_angles = start_angle + diffusion_times * (end_angle - start_angle)
        return ops.sin(diffusion_angles), ops.cos(diffusion_angles)

    def denoise(self, noisy_images, noise_rates, signal_rates, training):
        network = self.network if training else self.ema_network
        pred_noises = network([noisy_images, noise_rates**2], training=training)
        pred_images = (noisy_images - noise_rates * pred_noises) / signal_rates
        return pred_noises, pred_images

    def _noisy(self, images, training):
        images = self.normalizer(images, training=training)
        rows = ops.shape(images)[0]
        noises = keras.random.normal(shape=(rows, SIZE, SIZE, 3))
        diffusion_times = keras.random.uniform(shape=(rows, 1, 1, 1), minval=0.0, maxval=1.0)
        noise_rates, signal_rates = self.diffusion_schedule(diffusion_times)
        return images, noises, signal_rates * images + noise_rates * noises, noise_rates, \
            signal_rates

    def train_step(self, images):
        images, noises, noisy_images, noise_rates, signal_rates = self._noisy(images, True)
        if keras.backend.backend() == "tensorflow":
            import tensorflow as tf

            with tf.GradientTape() as tape:
                pred_noises, pred_images = self.denoise(noisy_images, noise_rates,
                                                        signal_rates, training=True)
                noise_loss = self.loss_fn(noises, pred_noises)
                image_loss = self.loss_fn(images, pred_images)
            gradients = tape.gradient(noise_loss, self.network.trainable_weights)
        else:
            self.zero_grad()
            pred_noises, pred_images = self.denoise(noisy_images, noise_rates, signal_rates,
                                                    training=True)
            noise_loss = self.loss_fn(noises, pred_noises)
            image_loss = self.loss_fn(images, pred_images)
            noise_loss.backward()
            gradients = [v.value.grad for v in self.network.trainable_weights]
        self.optimizer.apply_gradients(zip(gradients, self.network.trainable_weights))
        self.noise_loss_tracker.update_state(noise_loss)
        self.image_loss_tracker.update_state(image_loss)
        for weight, ema_weight in zip(self.network.weights, self.ema_network.weights):
            ema_weight.assign(EMA * ema_weight + (1 - EMA) * weight)
        return {m.name: m.result() for m in self.metrics}

    def test_step(self, images):
        images, noises, noisy_images, noise_rates, signal_rates = self._noisy(images, False)
        pred_noises, pred_images = self.denoise(noisy_images, noise_rates, signal_rates,
                                                training=False)
        self.noise_loss_tracker.update_state(self.loss_fn(noises, pred_noises))
        self.image_loss_tracker.update_state(self.loss_fn(images, pred_images))
        return {m.name: m.result() for m in self.metrics}


def build():
    model = DiffusionModel()
    model.normalizer.adapt(_data())
    model.built = True
    return model



def compile(model, optimizer=None):
    model.compile(optimizer=optimizer or keras.optimizers.AdamW(1e-3, weight_decay=1e-4),
                  loss=keras.losses.MeanAbsoluteError())


def fit_kwargs(workdir):
    return {"x": _data(), "batch_size": 25, "epochs": 2, "validation_split": 0.2,
            "verbose": 0}
