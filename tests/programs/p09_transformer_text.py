"""Text classification with a Transformer block: token and position embeddings,
multi-head attention, LayerNormalization, Dropout inside custom layers whose `call` takes
no `training` argument.

Source: https://github.com/keras-team/keras-io/blob/master/examples/nlp/
text_classification_with_transformer.py (vocab 20,000, maxlen 200, embedding 32, 2 heads,
feed-forward 32, adam, sparse categorical crossentropy). IMDB becomes 107 synthetic reviews
of 200 tokens; the batch 32 becomes 25.

On JAX, Adam normalises the token embeddings' gradients where a token's uses across the
batch nearly cancel, and the rounding of those sums follows XLA's code generation: on 3
devices, 0.37 % of the embedding's entries left the tolerance (up to 5.6e-3) on Keras 3.15.1
with XLA's default flags and 0.7 % on the next Keras with the test suite's, and none in the
other two pairings. In float64 (x64 on) the same Adam run is within 9.4e-8, and in float32
under SGD within 4e-9 (2026-11-28). On JAX it is held to one device under SGD
(EXACT_OPTIMIZER).
"""

import keras
import numpy as np
from keras import layers, ops

SOURCE = (
    "https://github.com/keras-team/keras-io/blob/master/examples/nlp/"
    "text_classification_with_transformer.py"
)
SAVE = "weights"
VOCAB_SIZE, MAXLEN, SAMPLES = 20000, 200, 107
AMPLIFIED = {"jax": "Adam normalises the rounding of token-embedding gradients that nearly "
                    "cancel, which XLA's code generation changes"}


class TransformerBlock(layers.Layer):
    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1):
        super().__init__()
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential(
            [layers.Dense(ff_dim, activation="relu"), layers.Dense(embed_dim)]
        )
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs):
        attn_output = self.att(inputs, inputs)
        attn_output = self.dropout1(attn_output)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.ffn(out1)
        ffn_output = self.dropout2(ffn_output)
        return self.layernorm2(out1 + ffn_output)


class TokenAndPositionEmbedding(layers.Layer):
    def __init__(self, maxlen, vocab_size, embed_dim):
        super().__init__()
        self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        maxlen = ops.shape(x)[-1]
        positions = ops.arange(start=0, stop=maxlen, step=1)
        return self.token_emb(x) + self.pos_emb(positions)


def build():
    embed_dim, num_heads, ff_dim = 32, 2, 32
    inputs = layers.Input(shape=(MAXLEN,))
    x = TokenAndPositionEmbedding(MAXLEN, VOCAB_SIZE, embed_dim)(inputs)
    x = TransformerBlock(embed_dim, num_heads, ff_dim)(x)
    x = layers.GlobalAveragePooling1D()(x)
    x = layers.Dropout(0.1)(x)
    x = layers.Dense(20, activation="relu")(x)
    x = layers.Dropout(0.1)(x)
    outputs = layers.Dense(2, activation="softmax")(x)
    return keras.Model(inputs=inputs, outputs=outputs)


def compile(model, optimizer="adam"):
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])


def EXACT_OPTIMIZER():  # noqa: N802 (a constant-like factory)
    return keras.optimizers.SGD(0.05)


def _data(count, seed):
    rng = np.random.default_rng(seed)
    return rng.integers(1, VOCAB_SIZE, (count, MAXLEN)), rng.integers(0, 2, count)


def fit_kwargs(workdir):
    x, y = _data(SAMPLES, 9)
    return {"x": x, "y": y, "batch_size": 25, "epochs": 2,
            "validation_data": _data(31, 99), "verbose": 0}


def predict_x():
    return _data(SAMPLES, 9)[0]
