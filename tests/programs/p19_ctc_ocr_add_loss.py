"""An OCR model whose loss is added by an endpoint layer: `CTCLayer.call` computes the CTC
loss of every sample, `self.add_loss` of that per-sample vector (which Keras sums over the
batch), and returns the predictions; `compile` gets only an optimizer.

Source: https://github.com/keras-team/keras-io/blob/master/examples/vision/captcha_ocr.py
(the CTCLayer endpoint, the conv + BiLSTM model with its "image" and "label" inputs, Adam,
EarlyStopping on validation loss). Adapted to run on a CPU in a test and on every backend:
`ctc_batch_cost` keeps its shape (a (batch, 1) loss per sample) but computes it with
`keras.ops.ctc_loss` (the source's is `tf.compat.v1.nn.ctc_loss`, TensorFlow only), its
blank the last class as there, and the lengths are filled from the shapes with `ops.full`
(the source casts the batch size to a tensor first, which JAX cannot shape an array by);
the 200x50 captchas become 107 synthetic 40x16 images with
4-character labels over 9 characters; every filter and unit count is divided by 8; the
tf.data pipeline becomes dict arrays with a batch of 25; 2 epochs.
"""

import keras
import numpy as np
from keras import layers, ops

SOURCE = "https://github.com/keras-team/keras-io/blob/master/examples/vision/captcha_ocr.py"
SAVE = "weights"  # the CTCLayer has no get_config
SAMPLES, IMG_WIDTH, IMG_HEIGHT, LABEL_LENGTH, CHARACTERS = 107, 40, 16, 4, 9


def ctc_batch_cost(y_true, y_pred, input_length, label_length):
    label_length = ops.cast(ops.squeeze(label_length, axis=-1), dtype="int32")
    input_length = ops.cast(ops.squeeze(input_length, axis=-1), dtype="int32")
    log_probabilities = ops.log(y_pred + keras.backend.epsilon())
    loss = ops.ctc_loss(ops.cast(y_true, "int32"), log_probabilities, label_length,
                        input_length, mask_index=CHARACTERS)
    return ops.expand_dims(loss, 1)


class CTCLayer(layers.Layer):
    def __init__(self, name=None):
        super().__init__(name=name)
        self.loss_fn = ctc_batch_cost

    def call(self, y_true, y_pred):
        batch_len = ops.shape(y_true)[0]
        input_length = ops.full((batch_len, 1), ops.shape(y_pred)[1], dtype="int64")
        label_length = ops.full((batch_len, 1), ops.shape(y_true)[1], dtype="int64")
        loss = self.loss_fn(y_true, y_pred, input_length, label_length)
        self.add_loss(loss)
        return y_pred


def build():
    input_img = layers.Input(shape=(IMG_WIDTH, IMG_HEIGHT, 1), name="image", dtype="float32")
    labels = layers.Input(name="label", shape=(None,), dtype="float32")
    x = layers.Conv2D(32 // 8, (3, 3), activation="relu", kernel_initializer="he_normal",
                      padding="same", name="Conv1")(input_img)
    x = layers.MaxPooling2D((2, 2), name="pool1")(x)
    x = layers.Conv2D(64 // 8, (3, 3), activation="relu", kernel_initializer="he_normal",
                      padding="same", name="Conv2")(x)
    x = layers.MaxPooling2D((2, 2), name="pool2")(x)
    new_shape = ((IMG_WIDTH // 4), (IMG_HEIGHT // 4) * (64 // 8))
    x = layers.Reshape(target_shape=new_shape, name="reshape")(x)
    x = layers.Dense(64 // 8, activation="relu", name="dense1")(x)
    x = layers.Dropout(0.2)(x)
    x = layers.Bidirectional(layers.LSTM(128 // 8, return_sequences=True, dropout=0.25))(x)
    x = layers.Bidirectional(layers.LSTM(64 // 8, return_sequences=True, dropout=0.25))(x)
    x = layers.Dense(CHARACTERS + 1, activation="softmax", name="dense2")(x)
    output = CTCLayer(name="ctc_loss")(labels, x)
    return keras.models.Model(inputs=[input_img, labels], outputs=output, name="ocr_model_v1")


def compile(model):
    model.compile(optimizer=keras.optimizers.Adam())


def _data(rows=SAMPLES, seed=19):
    rng = np.random.default_rng(seed)
    images = rng.random((rows, IMG_WIDTH, IMG_HEIGHT, 1)).astype("float32")
    labels = rng.integers(0, CHARACTERS, (rows, LABEL_LENGTH)).astype("float32")
    return {"image": images, "label": labels}


def fit_kwargs(workdir):
    early_stopping = keras.callbacks.EarlyStopping(monitor="val_loss", patience=10,
                                                   restore_best_weights=True)
    return {"x": _data(), "batch_size": 25, "epochs": 2, "verbose": 0,
            "validation_data": (_data(40, seed=20),), "callbacks": [early_stopping]}


def predict_x():
    return _data(31, seed=21)
