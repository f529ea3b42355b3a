"""Counters of the collectives a training step runs, for the bench's workers: torch's
process-group calls (`CollectiveCounter`) and the reductions TensorFlow traces into a step
(`TracedCollectives`). JAX's are read from the compiled HLO (`worker.compiled_collectives`).
"""

import contextlib


class CollectiveCounter:
    """Counts torch.distributed's collectives, and the bytes they carry, while it is on.

    A wrapper counts each call of `torch.distributed.all_reduce` and its kin: ours calls
    them from Python. DistributedDataParallel's reducer runs its own from C++, untouched
    (no communication hook, so DDP is timed as it runs); it all-reduces each of its
    buckets once a step, and `ddp_buckets` reads them from DDP's own logging data.
    Exchanges through the process group's store (`processes.exchange`: the stop flag at a
    step boundary, where no collective carried it) are counted apart.
    """

    NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "barrier",
             "reduce_scatter_tensor")

    def __init__(self):
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        from keras_multigpu import processes

        self.count = self.bytes = self.store = 0
        self.on = False
        self.ddps = []
        for name in self.NAMES:
            setattr(dist, name, self._counted(getattr(dist, name)))
        processes.exchange = self._counted_store(processes.exchange)
        build = DistributedDataParallel.__init__

        def init(ddp, *args, **kwargs):
            build(ddp, *args, **kwargs)
            self.ddps.append(ddp)

        DistributedDataParallel.__init__ = init

    def ddp_buckets(self):
        """(buckets, bytes) DDP all-reduces a step, over every DDP model made here."""
        count = size = 0
        for ddp in self.ddps:
            data = ddp._get_ddp_logging_data()
            sizes = str(data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or "")
            sizes = [int(v) for v in sizes.replace(" ", "").split(",") if v]
            count, size = count + len(sizes), size + sum(sizes)
        return count, size

    def _add(self, tensor):
        if self.on:
            self.count += 1
            if tensor is not None and hasattr(tensor, "element_size"):
                self.bytes += tensor.numel() * tensor.element_size()

    def _counted(self, function):
        def counted(*args, **kwargs):
            tensor = next((a for a in args if hasattr(a, "element_size")), None)
            self._add(tensor)
            return function(*args, **kwargs)
        return counted

    def _counted_store(self, function):
        def counted(*args, **kwargs):
            if self.on:
                self.store += 1
            return function(*args, **kwargs)
        return counted

    @contextlib.contextmanager
    def counting(self):
        self.count = self.bytes = self.store = 0
        self.on = True
        try:
            yield self
        finally:
            self.on = False


class TracedCollectives:
    """Counts the cross-device reductions and broadcasts a TensorFlow strategy puts into
    the traced training step (`one_step_on_data`), and the bytes of one replica's values.

    tf.distribute's `CrossDeviceOps.reduce`, `batch_reduce` and `broadcast` are wrapped
    (the entry points of every strategy's communication, whatever implements it: NCCL on
    GPUs, through one device on CPUs); each call while the step's graph is traced is one
    collective a step runs. A step traced again (another input shape) counts once: the
    graph with the most. Eager calls (placing, reading variables) are not per step.
    """

    STEP = "one_step_on_data"

    def __init__(self):
        import tensorflow as tf
        from tensorflow.python.distribute import cross_device_ops

        self._tf = tf
        self.graphs = {}  # id(graph): [collectives, bytes]
        self._inside = 0  # one collective may run another (a reduction to one device
        # broadcasts its result): only the outermost counts
        base = cross_device_ops.CrossDeviceOps
        for name, values in (("reduce", lambda a: [a[1]]),
                             ("batch_reduce", lambda a: [v for v, _ in a[1]]),
                             ("broadcast", lambda a: [a[0]])):
            setattr(base, name, self._counted(getattr(base, name), values))

    def _counted(self, function, values):
        def counted(ops, *args, **kwargs):
            graph = self._tf.compat.v1.get_default_graph()
            if getattr(graph, "name", None) == self.STEP and not self._inside:
                entry = self.graphs.setdefault(id(graph), [0, 0])
                entry[0] += 1
                try:
                    entry[1] += sum(self._bytes(v) for v in values(args))
                except (IndexError, TypeError, ValueError):  # passed by keyword: not sized
                    pass
            self._inside += 1
            try:
                return function(ops, *args, **kwargs)
            finally:
                self._inside -= 1
        return counted

    def _bytes(self, value):
        if isinstance(value, self._tf.distribute.DistributedValues):
            value = value.values[0]  # one replica's part
        if isinstance(value, self._tf.IndexedSlices):
            value = value.values
        shape = getattr(value, "shape", None)
        if shape is None or not shape.is_fully_defined():
            return 0
        return shape.num_elements() * value.dtype.size

    def per_step(self):
        """(collectives, bytes) of the traced step, or (0, 0) when it traced none."""
        return tuple(max(self.graphs.values(), default=(0, 0)))
