"""MiniGoogLeNet on CIFAR-10, the experiment of the post this project started from: conv
modules (Conv2D, BatchNormalization, ReLU), inception and downsample modules, SGD with
momentum 0.9 and a learning rate decaying linearly to 0, mean subtraction, one-hot labels.

Source: https://pyimagesearch.com/2017/10/30/how-to-multi-gpu-training-with-keras-python-
and-deep-learning/ (MiniGoogLeNet of Zhang et al. 2017, trained with multi_gpu_model).
Adapted to run on a CPU in a test: every filter count is divided by 8 and the network keeps
the first three inception modules and one downsample module; CIFAR-10 becomes 107 synthetic
32x32x3 images; the batch 64 per GPU becomes a global batch of 25; 2 epochs.

On TensorFlow, training amplifies rounding here: convolution gradients summed over 13 + 12
rows instead of 25 differ by about 2e-6 of their size (oneDNN's convolutions), and with
momentum through eight BatchNormalization layers the weights leave 1e-4 within the run. In
float64 the runs agree to 1e-13, which the test checks, with a control that needs no
padding (CONTROL).
"""

import keras
import numpy as np
from keras import layers

SOURCE = (
    "https://pyimagesearch.com/2017/10/30/"
    "how-to-multi-gpu-training-with-keras-python-and-deep-learning/"
)
SAVE = "keras"
AMPLIFIED = {"tensorflow": "SGD with momentum through BatchNorm grows the rounding of "
                           "TensorFlow's convolution gradients, which changes with the rows "
                           "per device"}
SAMPLES, EPOCHS, LR = 107, 2, 5e-3


def conv_module(x, k, kx, ky, stride, padding="same"):
    x = layers.Conv2D(k, (kx, ky), strides=stride, padding=padding)(x)
    x = layers.BatchNormalization(axis=-1)(x)
    return layers.Activation("relu")(x)


def inception_module(x, num_k1x1, num_k3x3):
    conv_1x1 = conv_module(x, num_k1x1, 1, 1, (1, 1))
    conv_3x3 = conv_module(x, num_k3x3, 3, 3, (1, 1))
    return layers.concatenate([conv_1x1, conv_3x3], axis=-1)


def downsample_module(x, k):
    conv_3x3 = conv_module(x, k, 3, 3, (2, 2), padding="valid")
    pool = layers.MaxPooling2D((3, 3), strides=(2, 2))(x)
    return layers.concatenate([conv_3x3, pool], axis=-1)


def build():
    inputs = keras.Input(shape=(32, 32, 3))
    x = conv_module(inputs, 96 // 8, 3, 3, (1, 1))
    x = inception_module(x, 32 // 8, 32 // 8)
    x = inception_module(x, 32 // 8, 48 // 8)
    x = downsample_module(x, 80 // 8)
    x = inception_module(x, 112 // 8, 48 // 8)
    x = layers.AveragePooling2D((15, 15))(x)
    x = layers.Dropout(0.5)(x)
    x = layers.Flatten()(x)
    x = layers.Dense(10)(x)
    outputs = layers.Activation("softmax")(x)
    return keras.Model(inputs, outputs, name="googlenet")


def compile(model):
    steps = EPOCHS * -(-int(SAMPLES * 0.9) // 25)
    schedule = keras.optimizers.schedules.PolynomialDecay(LR, steps, 0.0, power=1.0)
    model.compile(loss="categorical_crossentropy",
                  optimizer=keras.optimizers.SGD(learning_rate=schedule, momentum=0.9),
                  metrics=["accuracy"])


def _data():
    rng = np.random.default_rng(14)
    x = rng.uniform(0, 255, (SAMPLES, 32, 32, 3)).astype("float32")
    x = x - x.mean(axis=0)
    y = keras.utils.to_categorical(rng.integers(0, 10, SAMPLES), 10)
    return x, y


def fit_kwargs(workdir):
    x, y = _data()
    return {"x": x, "y": y, "batch_size": 25, "epochs": EPOCHS, "validation_split": 0.1,
            "verbose": 0}


def CONTROL(workdir):  # noqa: N802
    """No padding anywhere: 96 samples in batches of 24, on 1, 2 or 3 devices."""
    x, y = _data()
    return {"x": x[:96], "y": y[:96], "batch_size": 24, "epochs": 2, "shuffle": False,
            "verbose": 0}


def predict_x():
    return _data()[0]
