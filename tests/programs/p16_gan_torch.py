"""A GAN with its own `compile(d_optimizer, g_optimizer, loss_fn)`, two optimizers and a
`train_step` written with `loss.backward()`, trained on a torch `DataLoader` that shuffles.

Source: https://github.com/keras-team/keras-io/blob/master/guides/custom_train_step_in_torch.py
("Wrapping up: an end-to-end GAN example": the discriminator and generator, the GAN class,
its label noise of shape (2 x rows, 1), `DataLoader(..., shuffle=True)`). Adapted to run on
a CPU in a test: every filter count and the latent size are divided by 8; MNIST becomes 107
synthetic 28x28 images; the batch 64 becomes 25; 2 epochs; the step unpacks a list too
(the DataLoader's default collate yields `[x, x]`, which the source's tuple test misses on
Keras 3.15, on one device as on several). The model has no `call`, so nothing is predicted
(PREDICT = False).
"""

import keras
import numpy as np
import torch
from keras import layers

BACKENDS = ("torch",)  # its step is written with loss.backward()
SOURCE = "https://github.com/keras-team/keras-io/blob/master/guides/custom_train_step_in_torch.py"
SAVE = "weights"
PREDICT = False
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
        self.built = True

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn

    def train_step(self, real_images):
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if isinstance(real_images, (tuple, list)):  # the source: tuple only
            real_images = real_images[0]
        batch_size = real_images.shape[0]
        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator)
        generated_images = self.generator(random_latent_vectors)
        real_images = torch.as_tensor(real_images, device=device)
        combined_images = torch.concat([generated_images, real_images], axis=0)
        labels = torch.concat([torch.ones((batch_size, 1), device=device),
                               torch.zeros((batch_size, 1), device=device)], axis=0)
        # Label noise, drawn for the 2 x rows of real and generated images.
        labels += 0.05 * keras.random.uniform(labels.shape, seed=self.seed_generator)

        self.zero_grad()
        predictions = self.discriminator(combined_images)
        d_loss = self.loss_fn(labels, predictions)
        d_loss.backward()
        grads = [v.value.grad for v in self.discriminator.trainable_weights]
        with torch.no_grad():
            self.d_optimizer.apply(grads, self.discriminator.trainable_weights)

        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator)
        misleading_labels = torch.zeros((batch_size, 1), device=device)
        self.zero_grad()
        predictions = self.discriminator(self.generator(random_latent_vectors))
        g_loss = self.loss_fn(misleading_labels, predictions)
        g_loss.backward()
        grads = [v.value.grad for v in self.generator.trainable_weights]
        with torch.no_grad():
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


def compile(model):
    model.compile(
        d_optimizer=keras.optimizers.Adam(learning_rate=0.0003),
        g_optimizer=keras.optimizers.Adam(learning_rate=0.0003),
        loss_fn=keras.losses.BinaryCrossentropy(from_logits=True),
    )


def _digits():
    rng = np.random.default_rng(16)
    return (rng.random((SAMPLES, 28, 28, 1)) ** 3).astype("float32")


def fit_kwargs(workdir):
    digits = torch.from_numpy(_digits())
    dataset = torch.utils.data.TensorDataset(digits, digits)
    dataloader = torch.utils.data.DataLoader(dataset, batch_size=25, shuffle=True)
    return {"x": dataloader, "epochs": 2, "verbose": 0}
