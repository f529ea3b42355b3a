"""A model with its own stateless `train_step` and `test_step` that use the compiled loss
and metrics and pass `sample_weight` on; fitted with sample weights and validation data.

Source: https://github.com/keras-team/keras-io/blob/master/guides/custom_train_step_in_jax.py
("A first simple example" and "Providing your own evaluation step"; the guide's sample
weights appear in its TensorFlow twin, customizing_what_happens_in_fit.py). Its random
1,000 x 32 data becomes 107 rows; the default batch 32 becomes 25.
"""

import jax
import keras
import numpy as np

BACKENDS = ("jax",)  # its step is written with jax.value_and_grad
SOURCE = "https://github.com/keras-team/keras-io/blob/master/guides/custom_train_step_in_jax.py"
SAVE = "weights"
SAMPLES = 107


class CustomModel(keras.Model):
    def compute_loss_and_updates(self, trainable_variables, non_trainable_variables,
                                 metrics_variables, x, y, sample_weight, training=False):
        y_pred, non_trainable_variables = self.stateless_call(
            trainable_variables, non_trainable_variables, x, training=training
        )
        loss, (trainable_variables, non_trainable_variables, metrics_variables) = (
            self.stateless_compute_loss(
                trainable_variables, non_trainable_variables, metrics_variables,
                x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training,
            )
        )
        return loss, (y_pred, non_trainable_variables, metrics_variables)

    def _update_metrics(self, metrics_variables, loss, y, y_pred, sample_weight):
        new_metrics_variables, logs = [], {}
        for metric in self.metrics:
            variables = metrics_variables[
                len(new_metrics_variables) : len(new_metrics_variables) + len(metric.variables)
            ]
            if metric.name == "loss":
                variables = metric.stateless_update_state(variables, loss)
            else:
                variables = metric.stateless_update_state(
                    variables, y, y_pred, sample_weight=sample_weight
                )
            logs[metric.name] = metric.stateless_result(variables)
            new_metrics_variables += variables
        return logs, new_metrics_variables

    def train_step(self, state, data):
        trainable_variables, non_trainable_variables, optimizer_variables, metrics_variables = (
            state
        )
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
        (loss, (y_pred, non_trainable_variables, metrics_variables)), grads = grad_fn(
            trainable_variables, non_trainable_variables, metrics_variables,
            x, y, sample_weight, training=True,
        )
        trainable_variables, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable_variables
        )
        logs, metrics_variables = self._update_metrics(
            metrics_variables, loss, y, y_pred, sample_weight
        )
        return logs, (trainable_variables, non_trainable_variables, optimizer_variables,
                      metrics_variables)

    def test_step(self, state, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        trainable_variables, non_trainable_variables, metrics_variables = state
        loss, (y_pred, non_trainable_variables, metrics_variables) = (
            self.compute_loss_and_updates(
                trainable_variables, non_trainable_variables, metrics_variables,
                x, y, sample_weight, training=False,
            )
        )
        logs, metrics_variables = self._update_metrics(
            metrics_variables, loss, y, y_pred, sample_weight
        )
        return logs, (trainable_variables, non_trainable_variables, metrics_variables)


def build():
    inputs = keras.Input(shape=(32,))
    outputs = keras.layers.Dense(1)(inputs)
    return CustomModel(inputs, outputs)


def compile(model):
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])


def _data():
    rng = np.random.default_rng(2)
    x = rng.random((SAMPLES, 32)).astype("float32")
    y = rng.random((SAMPLES, 1)).astype("float32")
    sample_weight = rng.uniform(0.2, 2.0, SAMPLES).astype("float32")
    return x, y, sample_weight


def fit_kwargs(workdir):
    x, y, sample_weight = _data()
    return {
        "x": x, "y": y, "sample_weight": sample_weight, "epochs": 3, "batch_size": 25,
        "validation_data": (x[:40], y[:40], sample_weight[:40]), "verbose": 0,
    }


def predict_x():
    return _data()[0]
