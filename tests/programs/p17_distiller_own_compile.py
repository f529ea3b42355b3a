"""Knowledge distillation: a `Distiller` model with its own `compile(optimizer, metrics,
student_loss_fn, distillation_loss_fn, alpha, temperature)` and its own `compute_loss`
(the teacher's softened predictions against the student's).

Source: https://github.com/keras-team/keras-io/blob/master/examples/vision/
knowledge_distillation.py (the Keras 3 version: `compute_loss` and `call` on the
Distiller; the teacher and student convnets). Adapted to run on a CPU in a test: every
filter count is divided by 8; MNIST becomes 107 synthetic 28x28 images with 10 classes; the
teacher trains for one epoch on one device first, as in the source; the distillation runs 2
epochs with a global batch of 25 and validation data.
"""

import keras
import numpy as np
from keras import layers, ops

SOURCE = (
    "https://github.com/keras-team/keras-io/blob/master/examples/vision/knowledge_distillation.py"
)
SAVE = "weights"
SAMPLES = 107


class Distiller(keras.Model):
    def __init__(self, student, teacher):
        super().__init__()
        self.teacher = teacher
        self.student = student

    def compile(self, optimizer, metrics, student_loss_fn, distillation_loss_fn, alpha=0.1,
                temperature=3):
        super().compile(optimizer=optimizer, metrics=metrics)
        self.student_loss_fn = student_loss_fn
        self.distillation_loss_fn = distillation_loss_fn
        self.alpha = alpha
        self.temperature = temperature

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, allow_empty=False):
        teacher_pred = self.teacher(x, training=False)
        student_loss = self.student_loss_fn(y, y_pred)
        distillation_loss = self.distillation_loss_fn(
            ops.softmax(teacher_pred / self.temperature, axis=1),
            ops.softmax(y_pred / self.temperature, axis=1),
        ) * (self.temperature**2)
        return self.alpha * student_loss + (1 - self.alpha) * distillation_loss

    def call(self, x):
        return self.student(x)


def _convnet(name, filters):
    return keras.Sequential([
        keras.Input(shape=(28, 28, 1)),
        layers.Conv2D(filters[0], (3, 3), strides=(2, 2), padding="same"),
        layers.LeakyReLU(negative_slope=0.2),
        layers.MaxPooling2D(pool_size=(2, 2), strides=(1, 1), padding="same"),
        layers.Conv2D(filters[1], (3, 3), strides=(2, 2), padding="same"),
        layers.Flatten(),
        layers.Dense(10),
    ], name=name)


def _data():
    rng = np.random.default_rng(17)
    return rng.random((SAMPLES, 28, 28, 1)).astype("float32"), rng.integers(0, 10, SAMPLES)


def build():
    teacher = _convnet("teacher", (256 // 8, 512 // 8))
    student = _convnet("student", (16 // 8, 32 // 8))
    x, y = _data()
    teacher.compile(optimizer=keras.optimizers.Adam(),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    metrics=[keras.metrics.SparseCategoricalAccuracy()])
    teacher.fit(x, y, epochs=1, batch_size=25, verbose=0)
    return Distiller(student=student, teacher=teacher)


def compile(model):
    model.compile(
        optimizer=keras.optimizers.Adam(),
        metrics=[keras.metrics.SparseCategoricalAccuracy()],
        student_loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        distillation_loss_fn=keras.losses.KLDivergence(),
        alpha=0.1,
        temperature=10,
    )


def fit_kwargs(workdir):
    x, y = _data()
    return {"x": x, "y": y, "epochs": 2, "batch_size": 25, "verbose": 0,
            "validation_data": (x[:40], y[:40])}


def predict_x():
    return _data()[0]
