"""The TensorFlow engine's variables: each `keras.Variable` keeps its object, and the
TensorFlow variable behind it is swapped for a distributed twin for the length of a call
(`replicate`), then back, holding the trained values (`release`)."""

import tensorflow as tf

from keras_multigpu.backends import _tf_seeds


def _is_default(strategy):
    return not isinstance(strategy, (tf.distribute.MirroredStrategy,
                                     tf.distribute.MultiWorkerMirroredStrategy))


def _distributed_as(variable, optimizer_owned):
    """(aggregation, synchronization) of the variable's distributed twin."""
    aggregation = variable._map_aggregation(variable.aggregation)
    synchronization = variable._map_synchronization(variable.synchronization)
    if aggregation == tf.VariableAggregation.NONE and not variable.trainable:
        # Assigned inside replicas, where every replica computes the same value:
        # take the first's. A model's own (BatchNormalization statistics, seed
        # states) keeps a copy per replica, each assigned where it is computed and
        # read from the first: no broadcast a step. An optimizer's stays mirrored
        # (its apply updates it across replicas).
        aggregation = tf.VariableAggregation.ONLY_FIRST_REPLICA
        if not optimizer_owned:
            synchronization = tf.VariableSynchronization.ON_READ
    return aggregation, synchronization


def _mirrored_for(value, strategy):
    return (isinstance(value, tf.distribute.DistributedValues)
            and value._distribute_strategy is strategy)


def _as_tensor(value):
    if isinstance(value, tf.distribute.DistributedValues):
        return tf.convert_to_tensor(value)
    return value.read_value()


def _reindex(optimizer):
    """The optimizer finds a variable's slots by its TF variable's id: renew the index."""
    if optimizer is not None and optimizer.built:
        optimizer._trainable_variables_indices = {
            optimizer._var_key(v): i for i, v in enumerate(optimizer._trainable_variables)
        }


def replicate(variables, distribution, optimizers=()):
    """Puts each variable's value on every device of `distribution`, for one call.

    The `keras.Variable` objects stay the same; only the TensorFlow variable
    behind each is swapped for a mirrored one (kept per strategy, so that
    compiled steps stay valid from call to call) holding the same value.
    `release` swaps the plain ones back at the end of the call.
    """
    strategy = distribution.strategy
    if _is_default(strategy):
        return  # one device, no strategy: the variables train as they are
    variables = [*variables, _tf_seeds.generator().state]  # seed=None draws (_tf_seeds)
    swapped = False
    owned = {id(v) for optimizer in optimizers for v in optimizer.variables}
    for variable in variables:
        value = variable._value
        if value is None:
            continue  # not initialised yet: it will be created in scope
        mirrors = variable.__dict__.setdefault("_keras_multigpu_mirrors", {})
        mirrored = mirrors.get(strategy)
        if value is mirrored:
            continue
        if not isinstance(value, tf.distribute.DistributedValues):
            variable._keras_multigpu_plain = value
        current = _as_tensor(value)
        if mirrored is None:
            aggregation, synchronization = _distributed_as(variable, id(variable) in owned)
            with strategy.scope():
                mirrored = tf.Variable(current, trainable=variable.trainable,
                                       name=variable.name, aggregation=aggregation,
                                       synchronization=synchronization)
            mirrors[strategy] = mirrored
        else:
            with strategy.scope():
                mirrored.assign(current)
        variable._value = mirrored
        swapped = True
    for optimizer in optimizers:
        # Optimizers made outside the strategy (all of a GAN's, before it is compiled in a
        # scope) take their strategy at construction: each is pointed at this one.
        optimizer._distribution_strategy = strategy
        if swapped:
            _reindex(optimizer)


def recompiled(variables, distribution):
    """The model was compiled again, so its steps will be traced afresh: a twin whose kind no
    longer fits its variable, frozen or unfrozen since (`layer.trainable = True`, then
    `compile`), is dropped, and the next `replicate` makes one that fits (a frozen
    variable's twin is per replica and unwatched by the gradient tape: an unfrozen base
    would not train). Between compiles a traced step keeps the twins it captured, as
    Keras's keeps the trainable variables it was traced with."""
    for variable in variables:
        mirrors = variable.__dict__.get("_keras_multigpu_mirrors", {})
        twin = mirrors.get(distribution.strategy)
        if twin is not None and twin.trainable != variable.trainable:
            del mirrors[distribution.strategy]


def release(variables, distribution, optimizers=(), failed=False):
    """Swaps plain variables, holding the trained values, back in after a call.

    The user's model then trains, predicts and saves on its own, outside any
    strategy, as if it had never been distributed.
    """
    strategy = distribution.strategy
    if _is_default(strategy):
        return
    made = _tf_seeds.forget_unused()  # the call's global seed generator, put back too
    variables = [*variables, *([] if made is None else [made.state])]
    for variable in variables:
        value = variable._value
        if not isinstance(value, tf.distribute.DistributedValues):
            continue
        if not _mirrored_for(value, strategy):
            continue
        # Created in the strategy's scope (the optimizer's slots): keep it for
        # the next call, and give the variable a plain twin.
        variable.__dict__.setdefault("_keras_multigpu_mirrors", {})[strategy] = value
        plain = variable.__dict__.get("_keras_multigpu_plain")
        current = tf.convert_to_tensor(value)
        if plain is None:
            with tf.init_scope():
                plain = tf.Variable(current, trainable=variable.trainable, name=variable.name,
                                    aggregation=value.aggregation,
                                    synchronization=variable._map_synchronization(
                                        variable.synchronization))
            variable._keras_multigpu_plain = plain
        else:
            plain.assign(current)
        variable._value = plain
    for optimizer in optimizers:
        optimizer._distribution_strategy = tf.distribute.get_strategy()
        _reindex(optimizer)


def copies(variable):
    """The variable's value on each of this process's replicas, as NumPy arrays: a
    variable its replicas assign apart (`_distributed_as`: one copy per replica, read from
    the first) may hold one per replica; any other, one."""
    value = variable._value
    if isinstance(value, tf.distribute.DistributedValues):
        return [part.numpy() for part in value.values]
    return [value.numpy()]
