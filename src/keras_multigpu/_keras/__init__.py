"""Keras's internals, in one place.

Keras has no public hook for some of what the library does: the batch order comes from
Keras's own data adapters; the TensorFlow and torch engines weigh Keras's loss and metric
reductions per replica for the length of a call; every engine makes a direct
`keras.saving.save_model` write on one process only. Every `keras.src` module the library
uses is imported here (the engine-specific ones in `_keras/<engine>.py`), and every Keras
attribute it calls privately or patches is named in a table beside the import.

Each table is checked when its module is imported: where an attribute moved in a Keras
release, the import raises one `KerasVersionError` naming the installed Keras, the range
the library is tested on, and every missing attribute, instead of an AttributeError from
deep inside `fit`.
"""

import importlib
import inspect
import sys

import keras

from keras_multigpu._extras import KerasVersionError

# The range the library is tested on (pyproject.toml pins it): Keras 3.15.1, and Keras's
# main branch of 2026-08-21, whose version string says 3.16.0 (../shared/keras-next).
TESTED = ">=3.15,<3.17"


def load(table, where):
    """Imports every module of `table` and checks its attributes.

    Args:
        table: `{module path: names}`, where a name may be dotted (`"Layer.add_loss"`).
        where: what needs them, for the message (e.g. "the TensorFlow engine").

    Returns:
        The modules, in the table's order.

    Raises:
        KerasVersionError: naming every module or attribute not found.
    """
    modules, missing = [], []
    for path, names in table.items():
        try:
            module = importlib.import_module(path)
        except ImportError as error:
            modules.append(None)
            missing.append(f"{path} ({error})")
            continue
        modules.append(module)
        for name in names:
            owner = module
            for part in name.split("."):
                owner = getattr(owner, part, _MISSING)
                if owner is _MISSING:
                    missing.append(f"{path}.{name}")
                    break
    if missing:
        raise KerasVersionError(
            f"keras-multigpu ({where}) does not work with the installed Keras "
            f"{keras.__version__}: it is tested on keras{TESTED}, and these Keras internals "
            f"it relies on are not there: {', '.join(missing)}. Install a Keras in that "
            f'range, e.g. pip install "keras{TESTED}".'
        )
    return modules


_MISSING = object()

# What every engine and the data path use. Patched for a call (see the engines' rule
# tables): loss_module.{reduce_weighted_values, reduce_values, apply_mask,
# scale/unscale_loss_for_distribution}, Trainer._aggregate_additional_loss,
# Trainer.get_metrics_result (or the backend trainer's own, where it has one: the next
# Keras's torch trainer), Layer.{add_loss, _get_own_losses, _clear_losses},
# Mean.update_state, MeanMetricWrapper.update_state, BatchNormalization._moments,
# Optimizer.apply, LossScaleOptimizer.apply (TensorFlow; it calls _common_apply),
# {Optimizer, LossScaleOptimizer}.scale_loss, Model.train_step (Keras's own, on every engine),
# {MixUp, CutMix, RandomElasticTransform,
# RandomGaussianBlur}.call, each Metric's result, each Loss's call but CompileLoss's,
# backend.numpy.tensordot (a contraction over the batch axis), backend.numpy.matmul (a
# product of the batch's rows warns), backend.nn.ctc_loss and
# backend.math.{fft, fft2, ifft2, rfft, irfft, stft, istft} (on a replica dealt no rows); on
# TensorFlow, where its CPU convolutions misshape an empty batch,
# backend.nn.{conv, depthwise_conv, separable_conv}, and everywhere backend.nn.max_pool
# (its gradient on zero rows aborts under oneDNN);
# patched for the process: every alias of keras.saving.{save_model, save_weights}
# (see `processes`, `_face.save_templates` and `replace_saving`). Where Keras offers the
# class or function publicly (keras.layers, keras.metrics, keras.saving,
# keras.StatelessScope, keras.ops.is_tensor), it is taken from there, and only its private
# attributes are checked here.
PUBLIC = {
    "keras.layers": ("Layer.add_loss", "Layer._get_own_losses", "Layer._clear_losses",
                     "BatchNormalization._moments"),
    "keras.metrics": ("Metric.result", "Mean.update_state", "MeanMetricWrapper.update_state"),
    "keras.optimizers": ("Optimizer.apply", "LossScaleOptimizer._common_apply"),
    "keras.saving": ("save_model", "save_weights"),
}
COMMON = {
    "keras.src.backend": ("in_stateless_scope", "compute_output_spec", "get_keras_mask",
                          "set_keras_mask",
                          "common.global_state.get_global_attribute",
                          "nn.conv", "nn.depthwise_conv", "nn.separable_conv", "nn.max_pool",
                          "nn.ctc_loss", "numpy.tensordot", "numpy.matmul", "math.fft", "math.fft2",
                          "math.ifft2", "math.rfft", "math.irfft", "math.stft", "math.istft"),
    "keras.src.losses.loss": ("reduce_weighted_values", "reduce_values", "apply_mask",
                              "scale_loss_for_distribution", "unscale_loss_for_distribution",
                              "squeeze_or_expand_to_same_rank"),
    "keras.src.random.seed_generator": ("SeedGenerator", "draw_seed",
                                        "global_seed_generator", "make_default_seed"),
    "keras.src.trainers.trainer": ("Trainer._aggregate_additional_loss", "CompileLoss"),
    # The data adapters' package, whose own imports bring its modules.
    "keras.src.trainers.data_adapters": (
        "get_data_adapter", "data_adapter.DataAdapter", "GeneratorDataAdapter",
        "PyDatasetAdapter", "TFDatasetAdapter",
        "data_adapter_utils.class_weight_to_sample_weights", "data_adapter_utils.get_tensor_spec"),
    "keras.src.utils.io_utils": ("print_msg",),
}

load(PUBLIC, "its engines' rules")
(
    backend,
    loss_module,
    seed_generator,
    base_trainer,
    data_adapters,
    io_utils,
) = load(COMMON, "its data path and engines")
global_state = backend.common.global_state


def replace_saving(name, wrap, marker):
    """Replaces `keras.saving.<name>` (`save_model`, `save_weights`) by `wrap(it)` in every
    Keras module that holds it: `keras.saving`, `keras.models`, and the one `Model.save`
    calls it from; not where the one there has the attribute `marker` (`wrap` set it, on
    it or on a wrapper of it, whose `functools.wraps` copied it)."""
    original = getattr(keras.saving, name)
    if hasattr(original, marker):
        return
    wrapper = wrap(original)
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").split(".")[0] == "keras" \
                and getattr(module, name, None) is original:
            setattr(module, name, wrapper)


def save_signature(function):
    """`inspect.signature` of a Keras save function; None where it has none to read."""
    try:
        return inspect.signature(function)
    except (TypeError, ValueError):
        return None


def by_name(signature, model, filepath, *args, **kwargs):
    """A save's arguments after the model and the path, each by its name: Keras takes
    `overwrite` (and `zipped`) by position too, `save_model(model, path, False)`. None
    where the function does not name them so (not Keras's own)."""
    kinds = [p.kind for p in signature.parameters.values()][:2] if signature else []
    if kinds != [inspect.Parameter.POSITIONAL_OR_KEYWORD] * 2 or any(
            p.kind is inspect.Parameter.VAR_POSITIONAL for p in signature.parameters.values()):
        return None
    bound = signature.bind(model, filepath, *args, **kwargs)
    named = {}
    for name, value in list(bound.arguments.items())[2:]:
        if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        else:
            named[name] = value
    return named
