"""The torch engine's gradient all-reduce, overlapped with the backward pass, as DDP's is.

A `Reducer` splits an optimizer's variables into DDP's buckets (torch's own assignment:
about 25 MiB each, a small last one, in reverse order, so that the first to fill is the
last layer's). A hook on each parameter (`register_post_accumulate_grad_hook`) notes its
gradient once the backward pass has accumulated it; a bucket whose gradients are all
there is weighed by k / n (`rules.weigh_gradient`) and all-reduced asynchronously while the
backward pass goes on, buckets in the same order on every process, with a count of the
processes that have each gradient: one that only some have (a branch their own rows chose)
is the sum on every process, so that they update alike. `Optimizer.apply`
then waits for them (`take`) and applies the sums.

The overlap is for Keras's own step, which hands `apply` the parameters' own `.grad`
tensors. Where a step does anything else (gradients of another list of variables,
gradients changed in place after the backward pass, a second backward pass before
`apply`), `take` says so, and the engine all-reduces what `apply` received after the
backward pass; the reducer then stays off for the rest of the call. Every process runs
the same step, so every process makes the same choices, and they launch the same
collectives in the same order.
"""

import torch
import torch.distributed as dist

from keras_multigpu import rules

# DDP's bucket sizes (`DistributedDataParallel(bucket_cap_mb=25)`, and its first bucket).
BUCKET_BYTES = 25 * 1024 * 1024
FIRST_BUCKET_BYTES = 1024 * 1024  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES


class Reducer:
    """Buckets of `variables`' gradients, all-reduced as the backward pass fills them."""

    def __init__(self, variables, collective):
        self.variables = list(variables)
        self.collective = collective  # `_collective(what, function, ...)`: named errors
        self.params = [v.value for v in self.variables]  # their torch tensors
        assignment, _ = dist._compute_bucket_assignment_by_size(
            self.params, [FIRST_BUCKET_BYTES, BUCKET_BYTES], [False] * len(self.params))
        self.buckets = list(reversed(assignment))  # lists of indices into `variables`
        self.handles = [p.register_post_accumulate_grad_hook(self._hook(i))
                        for i, p in enumerate(self.params)]
        self.on = True
        self.replica = None
        self._reset()

    def _reset(self):
        self.seen = {}  # variable index: (its .grad tensor, that tensor's version)
        self.works = []  # (bucket, flat buffer, async work), in launch order
        self.twice = False

    def begin(self, replica):
        """A step starts (`replica`: its rows); its backward pass fills the buckets."""
        self.replica = replica

    def finish(self, failed=False):
        """The step has ended: nothing is left in flight, and the hooks sleep till the next.

        After a step that raised, its buckets are not waited for: a peer that stopped would
        keep them waiting, and their error would hide the step's own."""
        self.replica = None
        if failed:
            self._reset()
        else:
            self._drain()

    def end(self):
        """Removes the hooks (the end of a call), then waits for what is in flight."""
        for handle in self.handles:
            handle.remove()
        self.finish()

    def _drain(self):
        for _, _, work in self.works:
            self.collective("all-reduce of the gradients", work.wait)
        self._reset()

    def _hook(self, index):
        def hook(param):
            if not self.on or self.replica is None:
                return
            if index in self.seen:
                self.twice = True  # a second backward pass: `take` will decline
                return
            self.seen[index] = (param.grad, param.grad._version)
            with torch.no_grad():
                self._launch_ready()
        return hook

    def _launch_ready(self, everything=False):
        """Launches the next buckets, in order, while each is complete (`everything`: the
        rest, with zeros for gradients that never came)."""
        while len(self.works) < len(self.buckets):
            b = len(self.works)
            bucket = self.buckets[b]
            if not everything and any(i not in self.seen for i in bucket):
                return
            parts = [self.seen[i][0].reshape(-1) if i in self.seen else
                     torch.zeros_like(self.params[i]).reshape(-1) for i in bucket]
            have = torch.tensor([float(i in self.seen) for i in bucket], dtype=parts[0].dtype,
                                device=parts[0].device)  # which processes have each
            flat = torch.cat([rules.weigh_gradient(self.replica, torch.cat(parts)), have])
            work = self.collective("all-reduce of the gradients", dist.all_reduce, flat,
                                   async_op=True)
            self.works.append((b, flat, work))

    def take(self, grads, variables):
        """The all-reduced `grads` for `apply(grads, variables)`, or None where they are not
        the gradients the hooks saw (the caller all-reduces them itself)."""
        ours = (self.on and not self.twice and self.replica is not None
                and variables is not None and len(variables) == len(self.variables)
                and all(a is b for a, b in zip(variables, self.variables)))
        if ours:
            for i, g in enumerate(grads):
                noted = self.seen.get(i)
                if (g is None) != (noted is None) or (
                        g is not None and (g is not noted[0] or g._version != noted[1])):
                    ours = False
                    break
        if not ours:
            self.on = False
            self._drain()
            return None
        with torch.no_grad():
            self._launch_ready(everything=True)
        reduced = list(grads)
        for b, flat, work in self.works:
            self.collective("all-reduce of the gradients", work.wait)
            bucket, offset = self.buckets[b], 0
            # The counts are read (a wait for the device) only where this process lacks a
            # gradient: one that another process has is the sum here too.
            have = (flat[-len(bucket):].tolist() if any(grads[i] is None for i in bucket)
                    else [1] * len(bucket))
            for i, had in zip(bucket, have):
                size = self.params[i].numel()
                if had > 0:
                    reduced[i] = flat[offset:offset + size].view_as(self.params[i])
                offset += size
        self._reset()
        self.replica = None  # this step's gradients are taken: a later backward pass in
        # the step (a GAN's generator through its discriminator) launches nothing
        return reduced
