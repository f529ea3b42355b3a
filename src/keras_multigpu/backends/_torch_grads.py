"""A custom step's gradients on torch, as one device's: rules of the torch engine's table
(`torch._rules_table`), in force inside its steps.

Keras's own `train_step` hands `apply` the parameters' `.grad` right after its backward
pass, and the engine all-reduces them in DDP's buckets, overlapped with that pass
(`_torch_reducer`). A step of the user's own may read its gradients between the backward
pass and `apply`: a clip by a global norm it computes, SAM's perturbation. There every
backward pass ends with the weighted all-reduce of the gradients it accumulated into
parameters (in place), so that the step reads one device's; `apply` then takes them as
they are. Gradients with respect to tensors of the process's rows (an adversarial step's
inputs, a gradient penalty's), from a backward pass or `torch.autograd.grad`, are weighed
as one device's; `torch.autograd.grad`'s with respect to parameters are all-reduced as a
backward pass's are. A sum over the rows is found by the graph, in `evaluate` too
(`compute_loss`)."""

import contextlib

import keras
import torch

from keras_multigpu import rules, rules_metrics
from keras_multigpu._keras.torch import COMPUTE_LOSS
from keras_multigpu.rules_gather import rows_of, voted


def on_keras_steps():
    """This module's rules on Keras's own torch steps, for the engine's table (Keras's own
    `train_step`, whose backward pass is left to the buckets, is `rules.own_step`)."""
    return [(keras.Model, COMPUTE_LOSS, compute_loss)]


def backward(replica, original, tensors, *args, **kwargs):
    """`torch.autograd.backward` (which `Tensor.backward` calls) in a user's step: then the
    gradients it accumulated into parameters are weighed by k / n and all-reduced, in
    place. A second backward pass adds its process's own part to what is one device's
    already, and its all-reduce leaves that part as it is (the weights sum to 1). What it
    accumulated into tensors of this process's rows (an adversarial step's inputs, made to
    require grad) is weighed as one device's, in place."""
    if sums_rows(replica, rules.unscaled(replica, tensors)):  # its part of one device's sum,
        # times n / k (seen through a loss scaler's product)
        tensors = tensors * rules.share(replica, tensors.dtype)
    if replica.own_step:  # Keras's step (a `compute_loss` that sums: keras-io's BERT MLM):
        return original(tensors, *args, **kwargs)  # the buckets weigh it by k / n
    params, leaves = _leaves(tensors)  # read before the pass, which frees the graph
    before = [None if leaf.grad is None else leaf.grad.clone() for leaf in leaves]
    result = original(tensors, *args, **kwargs)
    grads = [p.grad for p in params if p.grad is not None]
    with torch.no_grad():
        for g, s in zip(grads, weighed_sums(replica, grads)):
            g.copy_(s)
    replica.reduced.extend(grads)
    if leaves and _of_rows(replica, leaves):
        with torch.no_grad():
            for leaf, old in zip(leaves, before):
                if leaf.grad is not None:
                    added = leaf.grad if old is None else leaf.grad - old
                    weighed = rules.weigh_gradient(replica, added)
                    leaf.grad.copy_(weighed if old is None else old + weighed)
    return result


def grad(replica, original, outputs, inputs, *args, **kwargs):
    """`torch.autograd.grad` in a user's step, as one device's. Gradients with respect to
    parameters are weighed by k / n and all-reduced at once, as a backward pass's are (a
    clip by their global norm is exact; `apply` takes them as they are), but where the
    step differentiates them again (`create_graph`), which an all-reduce would cut: then
    `apply` all-reduces them. Gradients with respect to tensors of this process's rows (an
    adversarial step's input gradient, a gradient penalty's) are weighed as one device's
    (k / n of a mean's, a per-row target's as it is); those with respect to other tensors
    are the process's own."""
    listed = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
    params = [isinstance(t, torch.nn.Parameter) for t in listed]
    graph = kwargs.get("create_graph", args[2] if len(args) > 2 else False)
    if not listed or (all(params) and graph) or (not all(params) and (
            any(params) or not _of_rows(replica, listed))):
        return original(outputs, inputs, *args, **kwargs)
    targets = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
    summed = all([sums_rows(replica, rules.unscaled(replica, t))  # every process votes
                  for t in targets])
    grads = original(outputs, inputs, *args, **kwargs)
    if summed:  # this process's part of one device's sum, times n / k (as `backward` scales)
        grads = [None if g is None else g * rules.share(replica, g.dtype) for g in grads]
    if not all(params):  # one device's mean divides by the batch's rows: k / n of this one's
        return tuple(None if g is None else rules.weigh_gradient(replica, g) for g in grads)
    grads = tuple(weighed_sums(replica, grads))
    replica.reduced.extend(g for g in grads if g is not None)
    return grads


@contextlib.contextmanager
def _few_rows(replica):
    """torch's own error in a step on a process dealt one row (or none) of a batch of
    several, with a note that says why one device, with all of them, has none: torch's
    Conv2D differentiated twice (a gradient penalty) fails on a batch of one row, in plain
    torch too, and Keras's torch `segment_sum` on none (its `num_segments=0` is taken for
    one not given). Around the whole step (`run_step`), its backward passes included;
    noted once, however it nests."""
    try:
        yield
    except (RuntimeError, ValueError, IndexError) as error:
        from keras_multigpu.processes import CollectiveError  # (not on each pass's way)

        if isinstance(replica.k, int) and replica.k < 2 <= replica.n and hasattr(
                error, "add_note") and not isinstance(
                    error, (CollectiveError, torch.cuda.OutOfMemoryError)) and not any(
                        _FEW_ROWS in note for note in getattr(error, "__notes__", ())):
            error.add_note(
                f"{_FEW_ROWS} {replica.k} row(s) of this batch of "
                f"{replica.n}. Where this is torch or Keras failing on so few rows (torch's "
                "Conv2D differentiated twice fails on one row, Keras's segment_sum on none), "
                "one device, with all of them, does not: give every process at least 2 rows "
                "of each batch, the last included (a batch_size of 2 rows per process or "
                "more, and drop_remainder=True to fit where only the last batch is short).")
        raise


_FEW_ROWS = "keras_multigpu: this process trains on"


def weighed_sums(replica, grads, variables=None):
    """`grads` (None kept) weighed by k / n and summed across processes, in one all-reduce:
    one device's gradients, from each process's gradients of its mean.

    Given the `variables`, a gradient that some processes have and others do not (a branch
    their own rows chose, an `ops.cond` on them) is zeros on the others, and every process
    takes the sum, so that they update alike; it stays None where no process has it."""
    from keras_multigpu.backends import torch as engine  # it imports this module

    if variables is not None and len(variables) == len(grads) and grads:
        with torch.no_grad():
            full = [rules.weigh_gradient(replica, g) if g is not None
                    else torch.zeros_like(v.value) for g, v in zip(grads, variables)]
            have = torch.tensor([float(g is not None) for g in grads], device=full[0].device)
            *summed, have = engine._flat_all_reduce([*full, have], "all-reduce of the gradients")
        if all(g is not None for g in grads):  # the counts are read only where one lacks
            return summed
        return [s if h > 0 else None for s, h in zip(summed, have.tolist())]
    present = [g for g in grads if g is not None]
    if not present:
        return list(grads)
    with torch.no_grad():
        summed = iter(engine._flat_all_reduce([rules.weigh_gradient(replica, g) for g in present],
                                              "all-reduce of the gradients"))
    return [None if g is None else next(summed) for g in grads]


def _of_rows(replica, tensors):
    """Whether every one of `tensors` holds this process's rows (every process votes)."""
    return voted(replica, all(rows_of(replica, t) for t in tensors), tensors,
                 "all-reduce of a gradient's inputs' rows")


def compute_loss(replica, original, model, *args, **kwargs):
    """Keras's `_compute_loss`, through which its own steps call a model's `compute_loss`.
    Under `no_grad` (Keras's `test_step`: `evaluate`, validation), a `compute_loss` of the
    model's own runs on a copy of the prediction that records a graph (from a leaf that
    requires grad), so that the loss tracker tells a sum over the rows from a mean
    (`mean_update`) as in training: before, `evaluate` took each process's sum for a mean (a
    loss of 2.4 apart from one device's). The copy keeps Keras's mask and may be changed in
    place; its graph goes with the loss. It costs one copy of the prediction and, where that
    `compute_loss` calls the model again, the graph of that call."""
    if torch.is_grad_enabled() or type(model).compute_loss is keras.Model.compute_loss:
        return original(model, *args, **kwargs)
    with torch.enable_grad():
        if "y_pred" in kwargs:
            kwargs["y_pred"] = _recording(kwargs["y_pred"])
        elif len(args) > 2:
            args = (*args[:2], _recording(args[2]), *args[3:])
        return original(model, *args, **kwargs)


def _recording(y_pred):
    def copy(tensor):
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            return tensor
        recorded = tensor.detach().requires_grad_().clone()
        recorded.__dict__.update(tensor.__dict__)  # Keras's `_keras_mask`, if any
        return recorded

    return keras.tree.map_structure(copy, y_pred)


def mean_update(replica, original, metric, values, sample_weight=None):
    """`rules.mean_update` (a loss tracker's update), with a sum over this process's rows
    (Keras's own step's loss from a `compute_loss` that sums: keras-io's BERT masked
    language model) taken as its part of the batch's sum times n / k: the weighing by
    k / n (a weight of None), or by the rows (Keras's step's weight), then adds each once
    across processes. Under `no_grad` (`evaluate`), `compute_loss` leaves the graph."""
    if (isinstance(values, torch.Tensor) and values.dim() == 0
            and not rules_metrics.updating(metric) and sums_rows(replica, values)):
        values = values * rules.share(replica, values.dtype)
    return rules.mean_update(replica, original, metric, values, sample_weight)


def sums_rows(replica, tensors):
    """Whether a backward pass, or a loss tracker's value, is from a sum over this
    process's rows, not a mean: from a tensor of them (a per-row loss, with `gradient=`),
    or from a full sum of one (`ops.sum(per_row).backward()`), not of values stacked (Keras's
    `compute_loss` sums its losses so: a regularizer's and the compiled one's are two, which
    a process of two rows would take for its rows). Every process votes
    (`rules_gather.voted`)."""
    if not isinstance(tensors, torch.Tensor) or not tensors.is_floating_point():
        return False
    summed = tensors.grad_fn is not None and tensors.grad_fn.name() == "SumBackward0"
    if summed and any(node is not None and node.name() == "StackBackward0"
                      for node, _ in tensors.grad_fn.next_functions):
        return False  # the same graph, so the same answer, on every process
    if tensors.dim() == 0 and not summed:
        return False  # a mean, or any other scalar: the same question on every process
    if tensors.dim():
        rows = rows_of(replica, tensors)
    else:
        sizes = tuple(getattr(tensors.grad_fn, "_saved_self_sym_sizes", ()))
        rows = bool(sizes) and int(sizes[0]) == int(replica.k)
    return voted(replica, rows, [tensors], "all-reduce of a backward pass's rows")


def sums_scalar(replica, value):
    """`sums_rows` for an `add_loss` scalar; None where no graph tells (Keras evaluates under
    `no_grad`), the same on every process."""
    if isinstance(value, torch.Tensor) and value.grad_fn is None:
        return None
    return sums_rows(replica, value)


def _leaves(tensors):
    """The parameters the backward pass from `tensors` accumulates into, and the other
    tensors it accumulates into (inputs made to require grad), in the graph's order (the
    same on every process, which runs the same step)."""
    roots = tensors if isinstance(tensors, (list, tuple)) else [tensors]
    stack = [t.grad_fn for t in roots if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen, params, leaves = set(), [], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.nn.Parameter):
            params.append(variable)
        elif isinstance(variable, torch.Tensor):
            leaves.append(variable)
        stack.extend(child for child, _ in node.next_functions)
    return params, leaves
