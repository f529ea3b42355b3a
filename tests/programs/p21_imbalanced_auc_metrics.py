"""Imbalanced binary classification with every stateful confusion metric Keras has: true and
false positives and negatives, precision, recall, ROC AUC and PR AUC, EarlyStopping on the
validation PR AUC (mode "max", restoring the best weights), and an output bias set from the
class balance.

Source: https://www.tensorflow.org/tutorials/structured_data/imbalanced_data (METRICS,
make_model with its output bias, Adam 1e-3, binary cross-entropy, early_stopping on
val_prc). Adapted to run in a test: the credit-card data become 107 synthetic rows of 29
features (about 1 in 6 positive; labels of shape (rows, 1), which Keras 3's metrics need
where tf.keras broadcast) and 40 validation rows; the batch 2048 becomes 25; 3 epochs
with a patience of 1.
"""

import keras
import numpy as np

SOURCE = "https://www.tensorflow.org/tutorials/structured_data/imbalanced_data"
SAVE = "keras"
SAMPLES, FEATURES = 107, 29

METRICS = [
    ("cross entropy", lambda: keras.metrics.BinaryCrossentropy(name="cross entropy")),
    ("Brier score", lambda: keras.metrics.MeanSquaredError(name="Brier score")),
    ("tp", lambda: keras.metrics.TruePositives(name="tp")),
    ("fp", lambda: keras.metrics.FalsePositives(name="fp")),
    ("tn", lambda: keras.metrics.TrueNegatives(name="tn")),
    ("fn", lambda: keras.metrics.FalseNegatives(name="fn")),
    ("accuracy", lambda: keras.metrics.BinaryAccuracy(name="accuracy")),
    ("precision", lambda: keras.metrics.Precision(name="precision")),
    ("recall", lambda: keras.metrics.Recall(name="recall")),
    ("auc", lambda: keras.metrics.AUC(name="auc")),
    ("prc", lambda: keras.metrics.AUC(name="prc", curve="PR")),
]


def _data(rows, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, FEATURES)).astype("float32")
    y = (x[:, 0] + 0.5 * rng.normal(size=rows) > 1.0).astype("float32")
    return x, y[:, None]


def build():
    _, y = _data(SAMPLES, 21)
    pos = float(y.sum())
    neg = len(y) - pos
    output_bias = keras.initializers.Constant(np.log([pos / neg]))
    return keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dropout(0.5),
        keras.layers.Dense(1, activation="sigmoid", bias_initializer=output_bias),
    ])


def compile(model):
    model.compile(optimizer=keras.optimizers.Adam(learning_rate=1e-3),
                  loss=keras.losses.BinaryCrossentropy(),
                  metrics=[make() for _, make in METRICS])


def fit_kwargs(workdir):
    x, y = _data(SAMPLES, 21)
    early_stopping = keras.callbacks.EarlyStopping(monitor="val_prc", verbose=0, patience=1,
                                                   mode="max", restore_best_weights=True)
    return {"x": x, "y": y, "batch_size": 25, "epochs": 3, "callbacks": [early_stopping],
            "validation_data": _data(40, 22), "verbose": 0}


def predict_x():
    return _data(31, 23)[0]
