"""A model that does everything in its own `train_step`: its own loss function, a loss
tracker and a MAE metric listed in its `metrics` property; `compile` gets only the
optimizer. Its step passes `sample_weight` (None here, as in the guide) to the loss and the
metrics.

Source: https://github.com/keras-team/keras-io/blob/master/guides/custom_train_step_in_jax.py
("Going lower-level"). The random 1,000 x 32 data becomes 107 rows; the default batch 32
becomes 25. (Its loss tracker cannot take per-sample weights for a scalar loss, on one device
either, so the data carries none.)
"""

import jax
import keras
import numpy as np

BACKENDS = ("jax",)  # its step is written with jax.value_and_grad
SOURCE = "https://github.com/keras-team/keras-io/blob/master/guides/custom_train_step_in_jax.py"
SAVE = "weights"
SAMPLES = 107


class CustomModel(keras.Model):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")
        self.loss_fn = keras.losses.MeanSquaredError()

    def compute_loss_and_updates(self, trainable_variables, non_trainable_variables, x, y,
                                 sample_weight, training=False):
        y_pred, non_trainable_variables = self.stateless_call(
            trainable_variables, non_trainable_variables, x, training=training
        )
        loss = self.loss_fn(y, y_pred, sample_weight=sample_weight)
        return loss, (y_pred, non_trainable_variables)

    def train_step(self, state, data):
        trainable_variables, non_trainable_variables, optimizer_variables, metrics_variables = (
            state
        )
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
        (loss, (y_pred, non_trainable_variables)), grads = grad_fn(
            trainable_variables, non_trainable_variables, x, y, sample_weight, training=True
        )
        trainable_variables, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable_variables
        )
        loss_tracker_vars = metrics_variables[: len(self.loss_tracker.variables)]
        mae_metric_vars = metrics_variables[len(self.loss_tracker.variables) :]
        loss_tracker_vars = self.loss_tracker.stateless_update_state(
            loss_tracker_vars, loss, sample_weight=sample_weight
        )
        mae_metric_vars = self.mae_metric.stateless_update_state(
            mae_metric_vars, y, y_pred, sample_weight=sample_weight
        )
        logs = {
            self.loss_tracker.name: self.loss_tracker.stateless_result(loss_tracker_vars),
            self.mae_metric.name: self.mae_metric.stateless_result(mae_metric_vars),
        }
        state = (trainable_variables, non_trainable_variables, optimizer_variables,
                 loss_tracker_vars + mae_metric_vars)
        return logs, state

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae_metric]


def build():
    inputs = keras.Input(shape=(32,))
    outputs = keras.layers.Dense(1)(inputs)
    return CustomModel(inputs, outputs)


def compile(model):
    model.compile(optimizer="adam")


def _data():
    rng = np.random.default_rng(11)
    x = rng.random((SAMPLES, 32)).astype("float32")
    y = rng.random((SAMPLES, 1)).astype("float32")
    return x, y


def fit_kwargs(workdir):
    x, y = _data()
    return {"x": x, "y": y, "batch_size": 25, "epochs": 3, "verbose": 0}


def predict_x():
    return _data()[0]
