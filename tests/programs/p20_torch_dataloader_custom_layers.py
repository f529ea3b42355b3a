"""A subclassed convnet with a custom Dense and a custom Dropout (drawing from its own
`SeedGenerator`), trained on torch `DataLoader`s: a training one that shuffles and a
validation one, on whichever backend runs it.

Source: https://github.com/keras-team/keras-io/blob/master/guides/
intro_to_keras_for_engineers.py ("Writing cross-framework custom components": MyDense,
MyDropout, MyModel; "Training models on arbitrary data sources": the `DataLoader`s of
`TensorDataset`s, Adam 1e-3, sparse categorical cross-entropy and accuracy). Adapted to run
on a CPU in a test: every filter count is divided by 16; MNIST becomes 107 synthetic 28x28
images for training and 40 for validation; the batch 128 becomes 25; 2 epochs. MyDropout,
as written, drops in inference too, from a seed state that a weights file does not keep: a
reloaded model's predictions differ, so the reload is checked on its weights
(RANDOM_PREDICT).
"""

import keras
import numpy as np
import torch

SOURCE = (
    "https://github.com/keras-team/keras-io/blob/master/guides/intro_to_keras_for_engineers.py"
)
SAVE = "weights"
RANDOM_PREDICT = True
SAMPLES = 107


class MyDense(keras.layers.Layer):
    def __init__(self, units, activation=None, name=None):
        super().__init__(name=name)
        self.units = units
        self.activation = keras.activations.get(activation)

    def build(self, input_shape):
        input_dim = input_shape[-1]
        self.w = self.add_weight(shape=(input_dim, self.units),
                                 initializer=keras.initializers.GlorotNormal(), name="kernel",
                                 trainable=True)
        self.b = self.add_weight(shape=(self.units,), initializer=keras.initializers.Zeros(),
                                 name="bias", trainable=True)

    def call(self, inputs):
        return self.activation(keras.ops.matmul(inputs, self.w) + self.b)


class MyDropout(keras.layers.Layer):
    def __init__(self, rate, name=None):
        super().__init__(name=name)
        self.rate = rate
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs):
        return keras.random.dropout(inputs, self.rate, seed=self.seed_generator)


class MyModel(keras.Model):
    def __init__(self, num_classes):
        super().__init__()
        self.conv_base = keras.Sequential([
            keras.layers.Conv2D(64 // 16, kernel_size=(3, 3), activation="relu"),
            keras.layers.Conv2D(64 // 16, kernel_size=(3, 3), activation="relu"),
            keras.layers.MaxPooling2D(pool_size=(2, 2)),
            keras.layers.Conv2D(128 // 16, kernel_size=(3, 3), activation="relu"),
            keras.layers.Conv2D(128 // 16, kernel_size=(3, 3), activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
        ])
        self.dp = MyDropout(0.5)
        self.dense = MyDense(num_classes, activation="softmax")

    def call(self, x):
        x = self.conv_base(x)
        x = self.dp(x)
        return self.dense(x)


def build():
    return MyModel(num_classes=10)


def compile(model):
    model.compile(
        loss=keras.losses.SparseCategoricalCrossentropy(),
        optimizer=keras.optimizers.Adam(learning_rate=1e-3),
        metrics=[keras.metrics.SparseCategoricalAccuracy(name="acc")],
    )


def _data(rows, seed):
    rng = np.random.default_rng(seed)
    return rng.random((rows, 28, 28, 1)).astype("float32"), rng.integers(0, 10, rows)


def fit_kwargs(workdir):
    x_train, y_train = _data(SAMPLES, 20)
    x_test, y_test = _data(40, 21)
    train_torch_dataset = torch.utils.data.TensorDataset(
        torch.from_numpy(x_train), torch.from_numpy(y_train))
    val_torch_dataset = torch.utils.data.TensorDataset(
        torch.from_numpy(x_test), torch.from_numpy(y_test))
    train_dataloader = torch.utils.data.DataLoader(train_torch_dataset, batch_size=25,
                                                   shuffle=True)
    val_dataloader = torch.utils.data.DataLoader(val_torch_dataset, batch_size=25,
                                                 shuffle=False)
    return {"x": train_dataloader, "epochs": 2, "validation_data": val_dataloader,
            "verbose": 0}


def predict_x():
    return _data(31, 22)[0]
