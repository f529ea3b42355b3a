"""The exactness rules for random draws, written once in `keras.ops` (see `rules`): a draw
whose first dimension is the replica's rows is drawn for the global batch and sliced to
the replica's rows, so each row gets one device's numbers; Dropout's mask likewise, and a
`categorical` draw from the gathered batch's logits."""

import inspect

import keras

from keras_multigpu._keras import seed_generator
from keras_multigpu.rules_gather import (
    GATHERED,
    every_replicas,
    gather,
    own_rows,
    rows_of,
    voted,
)


class Drawn(seed_generator.SeedGenerator):
    """A seed already drawn, handed to Keras's draw functions as a generator would be:
    every branch of a traced draw then uses one draw, so the layer's generator moves on
    once per call, as on one device."""

    def __init__(self, value):  # no state variable: `next` only returns `value`
        self.value = value
        self._initial_seed = 0

    def next(self, ordered=True):
        return self.value


def _seeded(seed):
    """Whether Keras draws `seed`'s numbers from a seed (not from the framework's own
    global generator, as torch does for an unseeded draw)."""
    return seed is not None and not (isinstance(seed, seed_generator.SeedGenerator)
                                     and seed._initial_seed is None)


def batch_draw(replica, draw, shape, seed):
    """`draw(shape, seed)`, where a first dimension of whole multiples of the replica's rows
    is the batch's.

    Such a draw is made for the global batch and this replica's rows are taken from it,
    so that every row gets the numbers it gets on one device. A first dimension of c times
    the rows is c blocks of them, as one device's draw for c times its rows holds them (a
    GAN's noise for its real and generated rows, concatenated): this replica's rows of
    each block are taken. Other draws are the replica's own: each replica draws what one
    device does. Traced engines take a static first dimension for none. Eager ones see
    plain ints (`_eager_blocks`): where the batch splits unevenly, the replicas compare
    theirs, and only c times each one's rows is the batch's; where it splits evenly, a
    first dimension that is a multiple of k by chance (a per-feature draw) is taken for
    the batch's too.
    """
    if keras.ops.is_tensor(shape):
        shape = [shape[i] for i in range(int(shape.shape[0]))]
    shape = list(shape)
    k, n, start = replica.k, replica.n, replica.start
    if not shape or (replica.traced and isinstance(shape[0], int)):
        return draw(shape, seed)
    if not replica.traced:
        rows = int(shape[0])
        blocks = _eager_blocks(replica, rows)
        if not blocks:
            return draw(shape, seed)
        drawn = draw([blocks * n, *shape[1:]], Drawn(seed_generator.draw_seed(seed))
                     if _seeded(seed) else seed)
        if blocks == 1:
            return drawn[start:start + k]
        return keras.ops.concatenate([drawn[b * n + start:b * n + start + k]
                                      for b in range(blocks)])
    seed = Drawn(seed_generator.draw_seed(seed))
    rows = keras.ops.cast(shape[0], "int32")
    blocks = keras.ops.floor_divide(rows, keras.ops.maximum(k, 1))

    rest = [keras.ops.cast(d, "int32") if keras.ops.is_tensor(d) else d for d in shape[1:]]

    def global_rows():
        drawn = draw([blocks * n, *rest], seed)
        mine = keras.ops.reshape(keras.ops.arange(blocks)[:, None] * n + start
                                 + keras.ops.arange(k)[None, :], [-1])
        return keras.ops.take(drawn, mine, axis=0)

    batch_shaped = keras.ops.logical_and(
        keras.ops.logical_and(k > 0, keras.ops.equal(rows, blocks * k)), blocks > 0)
    return keras.ops.cond(batch_shaped, global_rows, lambda: draw(shape, seed))


def _eager_blocks(replica, rows):
    """How many blocks of its k rows an eager replica's draw of `rows` first holds, or 0 for
    a draw not shaped by the batch. A replica with no rows draws one block, as many numbers
    as a draw shaped by the batch (the common case) takes from the generators the others
    draw from. Where the split is uneven, a draw for the batch has other rows on each
    replica than a draw of a constant size, so they compare theirs (one small all-reduce;
    none where the split is even, and every replica finds what the others find): a
    per-feature draw of 6 values on replicas of 4, 3 and 3 rows is no batch's, where the
    replicas of 3 alone would take it for 2 blocks and draw other numbers than one device.
    A draw from a generator every replica shares (unseeded: torch's global one) moves it
    by what the replica draws, so there a replica deciding alone would part the generators
    for the rest of the run."""
    k, n = replica.k, replica.n
    if getattr(GATHERED, "on", False):  # every replica runs the whole batch
        return 0
    if n % replica.replicas == 0:
        if k == n or (k and rows % k) or bool(k) != bool(rows):
            return 0
        return rows // k if k else 1
    every = every_replicas(replica, keras.ops.convert_to_tensor([float(rows), float(k)]),
                           "all-reduce of a draw's rows").astype(int)
    blocks = {int(r // kr) for r, kr in every if kr}
    if len(blocks) != 1 or not all(r == kr * (r // max(kr, 1)) for r, kr in every):
        return 0
    return blocks.pop()


def random_draw(replica, original, *args, **kwargs):
    """Keras's `normal`, `uniform`, `gamma`, `binomial`, ... (`original`, with `shape` and
    `seed` arguments), drawn by `batch_draw`. A draw whose parameters are given per row (a
    `gamma` of an `alpha` shaped as the draw) is the replica's own."""
    arguments = inspect.signature(original).bind(*args, **kwargs).arguments
    if any(_per_row(value, arguments["shape"]) for name, value in arguments.items()
           if name not in ("shape", "seed", "dtype")):
        return original(*args, **kwargs)

    def draw(shape, seed):
        return original(**{**arguments, "shape": shape, "seed": seed})

    return batch_draw(replica, draw, arguments["shape"], arguments.get("seed"))


def categorical(replica, original, *args, **kwargs):
    """Keras's `categorical` (`original`) of logits with a row per row of the batch: drawn
    from the logits gathered from every replica, as one device draws for the batch, and
    this replica's rows kept. Eager replicas vote on whether the logits are the batch's
    (`voted`: every replica draws here, so every replica asks); other logits (the same on
    every replica) are drawn as one device draws them."""
    arguments = inspect.signature(original).bind(*args, **kwargs).arguments
    logits = arguments["logits"] = keras.ops.convert_to_tensor(arguments["logits"])
    if not voted(replica, rows_of(replica, logits), [logits],
                 "all-reduce of keras.random.categorical's rows"):
        return original(**arguments)
    arguments["logits"] = gather(replica, keras.ops.stop_gradient(logits),
                                 "all-gather of the batch for keras.random.categorical")
    seed = arguments.get("seed")
    if _seeded(seed):
        arguments["seed"] = Drawn(seed_generator.draw_seed(seed))
    drawn = original(**arguments)
    return own_rows(replica, drawn)


def _per_row(value, shape):
    """Whether a draw's parameter `value` may hold one value per row of a draw of `shape`:
    it has the draw's rank, and its first dimension is the draw's (or unknown)."""
    if not hasattr(value, "shape") or len(value.shape) == 0:
        return False
    if keras.ops.is_tensor(shape):
        shape = [None] * int(shape.shape[0])
    if len(value.shape) != len(shape):
        return False
    rows, draws = value.shape[0], shape[0]
    if rows is None:
        return True
    if draws is None or keras.ops.is_tensor(draws):  # a traced batch: a static 1 broadcasts
        return int(rows) != 1
    return int(rows) == int(draws)


def dropout(replica, original, inputs, rate, noise_shape=None, seed=None):
    """Keras's `dropout` (`original`) with its mask drawn by `batch_draw`: the mask is
    Keras's dropout of ones (with a noise shape only where the user gave one, as Keras
    draws from the seed then), times the inputs."""
    if isinstance(rate, (int, float)) and rate in (0.0, 1.0):
        return original(inputs, rate, noise_shape, seed)
    if keras.backend.backend() == "torch" and noise_shape is None and not _seeded(seed):
        # Keras's torch dropout draws no seed: the framework's own dropout, which the
        # engine's rule draws for the batch (in the memory layout of `inputs`).
        return original(inputs, rate, noise_shape, seed)
    dims = list(keras.ops.shape(inputs))
    if replica.traced:  # the inputs' first dimension is the step's rows, even if known
        dims[0] = keras.ops.convert_to_tensor(dims[0], "int32")
    concrete = dims if noise_shape is None else [
        dim if size is None else size for dim, size in zip(dims, noise_shape)]

    def draw(shape, seed):
        ones = keras.ops.ones(shape, dtype=inputs.dtype)
        return original(ones, rate, None if noise_shape is None else shape, seed)

    return inputs * batch_draw(replica, draw, concrete, seed)
