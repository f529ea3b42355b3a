"""A model of named inputs (a dict, in the source's order, which is not sorted): Gated
Residual and Variable Selection Networks on the US Census Income data, with instance weights,
EarlyStopping on validation data, and `predict` on a dict of a partly built model.

Source: https://github.com/keras-team/keras-io/blob/master/examples/structured_data/
classification_with_grn_and_vsn.py (the backend-agnostic Keras 3 version: its feature
names, GatedLinearUnit, GatedResidualNetwork, VariableSelection with its own `build` that
leaves its sub-layers to build on the first batch, the model, Adam, binary cross-entropy
and accuracy). Adapted to run on a CPU in a test: the source's 40 features become its first
2 numeric and first 3 categorical ones, still not in sorted order (a GRN per feature makes
40 slow to compile three times); the CSV files become 107 synthetic rows (each categorical
feature takes 2 to 6 values, already indices, as the source's `process` makes them); the
per-backend matmul of the selection weights becomes `keras.ops.matmul`; the batch 265
becomes 25; 2 epochs; the encoding size 16 becomes 8.
"""

import keras
import numpy as np
from keras import layers

SOURCE = (
    "https://github.com/keras-team/keras-io/blob/master/examples/structured_data/"
    "classification_with_grn_and_vsn.py"
)
SAVE = "weights"  # its layers have no get_config
SAMPLES = 107

NUMERIC_FEATURE_NAMES = [
    "age", "wage_per_hour", "capital_gains", "capital_losses", "dividends_from_stocks",
    "num_persons_worked_for_employer", "weeks_worked_in_year",
]
CATEGORICAL_FEATURE_NAMES = [
    "class_of_worker", "detailed_industry_recode", "detailed_occupation_recode", "education",
    "enroll_in_edu_inst_last_wk", "marital_stat", "major_industry_code",
    "major_occupation_code", "race", "hispanic_origin", "sex", "member_of_a_labor_union",
    "reason_for_unemployment", "full_or_part_time_employment_stat", "tax_filer_stat",
    "region_of_previous_residence", "state_of_previous_residence",
    "detailed_household_and_family_stat", "detailed_household_summary_in_household",
    "migration_code-change_in_msa", "migration_code-change_in_reg",
    "migration_code-move_within_reg", "live_in_this_house_1_year_ago",
    "migration_prev_res_in_sunbelt", "family_members_under_18", "country_of_birth_father",
    "country_of_birth_mother", "country_of_birth_self", "citizenship",
    "own_business_or_self_employed", "fill_inc_questionnaire_for_veterans_admin",
    "veterans_benefits", "year",
]
VOCABULARY_SIZES = {name: 2 + i % 5 for i, name in enumerate(CATEGORICAL_FEATURE_NAMES)}
NUMERIC_FEATURE_NAMES, CATEGORICAL_FEATURE_NAMES = (NUMERIC_FEATURE_NAMES[:2],
                                                    CATEGORICAL_FEATURE_NAMES[:3])
VOCABULARY_SIZES = {name: VOCABULARY_SIZES[name] for name in CATEGORICAL_FEATURE_NAMES}
FEATURE_NAMES = NUMERIC_FEATURE_NAMES + CATEGORICAL_FEATURE_NAMES
DROPOUT_RATE, ENCODING_SIZE = 0.15, 8


def create_model_inputs():
    inputs = {}
    for feature_name in FEATURE_NAMES:
        dtype = "int64" if feature_name in VOCABULARY_SIZES else "float32"
        inputs[feature_name] = layers.Input(name=feature_name, shape=(), dtype=dtype)
    return inputs


class GatedLinearUnit(layers.Layer):
    def __init__(self, units):
        super().__init__()
        self.linear = layers.Dense(units)
        self.sigmoid = layers.Dense(units, activation="sigmoid")

    def call(self, inputs):
        return self.linear(inputs) * self.sigmoid(inputs)


class GatedResidualNetwork(layers.Layer):
    def __init__(self, units, dropout_rate):
        super().__init__()
        self.units = units
        self.elu_dense = layers.Dense(units, activation="elu")
        self.linear_dense = layers.Dense(units)
        self.dropout = layers.Dropout(dropout_rate)
        self.gated_linear_unit = GatedLinearUnit(units)
        self.layer_norm = layers.LayerNormalization()
        self.project = layers.Dense(units)

    def call(self, inputs):
        x = self.elu_dense(inputs)
        x = self.linear_dense(x)
        x = self.dropout(x)
        if inputs.shape[-1] != self.units:
            inputs = self.project(inputs)
        x = inputs + self.gated_linear_unit(x)
        return self.layer_norm(x)


class VariableSelection(layers.Layer):
    def __init__(self, num_features, units, dropout_rate):
        super().__init__()
        self.units = units
        self.embeddings = {
            name: layers.Embedding(input_dim=size, output_dim=units, name=name)
            for name, size in VOCABULARY_SIZES.items()
        }
        self.proj_layer = {name: layers.Dense(units=units) for name in NUMERIC_FEATURE_NAMES}
        self.grns = [GatedResidualNetwork(units, dropout_rate) for _ in range(num_features)]
        self.grn_concat = GatedResidualNetwork(units, dropout_rate)
        self.softmax = layers.Dense(units=num_features, activation="softmax")

    def call(self, inputs):
        concat_inputs = []
        for input_ in inputs:
            if input_ in VOCABULARY_SIZES:
                max_index = self.embeddings[input_].input_dim - 1
                concat_inputs.append(
                    self.embeddings[input_](keras.ops.clip(inputs[input_], 0, max_index)))
            else:
                proj_feature = keras.ops.expand_dims(inputs[input_], -1)
                concat_inputs.append(self.proj_layer[input_](proj_feature))
        v = layers.concatenate(concat_inputs)
        v = self.grn_concat(v)
        v = keras.ops.expand_dims(self.softmax(v), axis=-1)
        x = keras.ops.stack([self.grns[i](item) for i, item in enumerate(concat_inputs)],
                            axis=1)
        return keras.ops.squeeze(keras.ops.matmul(keras.ops.transpose(v, (0, 2, 1)), x),
                                 axis=1)

    def build(self):
        self.built = True


def build():
    inputs = create_model_inputs()
    features = VariableSelection(len(inputs), ENCODING_SIZE, DROPOUT_RATE)(inputs)
    outputs = layers.Dense(units=1, activation="sigmoid")(features)
    return keras.Model(inputs=inputs, outputs=outputs)


def compile(model):
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate=0.001),
        loss=keras.losses.BinaryCrossentropy(),
        metrics=[keras.metrics.BinaryAccuracy(name="accuracy")],
    )


def _data(rows=SAMPLES, seed=18):
    rng = np.random.default_rng(seed)
    x = {}
    for name in FEATURE_NAMES:
        if name in VOCABULARY_SIZES:
            x[name] = rng.integers(0, VOCABULARY_SIZES[name], rows).astype("int64")
        else:
            x[name] = rng.normal(size=rows).astype("float32")
    y = rng.integers(0, 2, rows).astype("float32")
    weight = rng.uniform(0.5, 2.0, rows).astype("float32")
    return x, y, weight


def fit_kwargs(workdir):
    x, y, weight = _data()
    valid_x, valid_y, valid_weight = _data(40, seed=19)
    early_stopping = keras.callbacks.EarlyStopping(monitor="val_loss", patience=5,
                                                   restore_best_weights=True)
    return {"x": x, "y": y, "sample_weight": weight, "batch_size": 25, "epochs": 2,
            "validation_data": (valid_x, valid_y, valid_weight),
            "callbacks": [early_stopping], "verbose": 0}


def predict_x():
    return _data(31, seed=20)[0]
