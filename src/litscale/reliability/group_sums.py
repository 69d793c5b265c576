"""The sums over the replica groups that each step takes (``ReplicaFaultTolerance``).

A group of one process has no reduction inside it, and its gradients' sum over the groups,
taken after backward, put the whole all-reduce on the step's critical path, where DDP's runs
while the layers below are still being differentiated (on a GPU, beside the compute, on the
network). ``OverlappedGradientSum`` does what DDP's reducer does for these groups: the
parameters are cut into buckets in the order backward finishes them (the reverse of the
module's, with DDP's first-bucket and bucket sizes), and a bucket's sum starts as soon as its
last gradient is accumulated, on the micro batch that ends the step. On 2 CPU cores that the
ranks fill (``experiments/reliability/overhead.py``), the sum's wait after backward fell from
9.4 to 6.4-6.9 ms a GPT-nano step; the step itself did not measurably change there. Summing
in place in buffers kept for the fit (below) took the groups' step from 1.25x to 1.06-1.10x
DDP's on GPT-nano, with the callback logging only where the loggers write.

Every group starts its buckets in one order (bucket k after bucket k-1), so that the groups'
collectives pair up whatever order their hooks fire in. A bucket whose gradients backward did
not all produce (a parameter no forward used, gradients set without backward as
``determinism=layout_invariant`` sets them) starts when the step asks for its sums.

A group of several ranks (DDP, FSDP) sums after backward (``sum_over_groups``): its own
reduction inside the group must end first, and FSDP's gradients are shards it writes itself.

Written here rather than taken from torchft's ``torchft.ddp.DistributedDataParallel`` (DDP's
reducer over the manager): that wrapper needs the strategy to wrap the module, which Lightning's
single-device strategy does not, and the groups' sum also carries what each group counted (the
loss, a router's load, BatchNorm's statistics), gated by the callback's quorum.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed import ReduceOp

# DDP's defaults (``DistributedDataParallel``: the first bucket small, so that a sum starts
# early in backward; then ``bucket_cap_mb=25``).
FIRST_BUCKET_BYTES = 1024 * 1024
BUCKET_BYTES = 25 * 1024 * 1024


def sum_over_groups(manager: Any, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` summed over the groups of the quorum, each as a view of one flat buffer per
    dtype: one collective for a float32 model (gradients and counts together), every one started
    before any is waited for."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for index, tensor in enumerate(tensors):
        by_dtype.setdefault(tensor.dtype, []).append(index)
    flats = {dtype: torch._utils._flatten_dense_tensors([tensors[i] for i in indices])
             for dtype, indices in by_dtype.items()}
    works = [manager.allreduce(flat, reduce_op=ReduceOp.SUM) for flat in flats.values()]
    for work in works:
        work.wait()
    summed: list[Any] = [None] * len(tensors)
    for dtype, indices in by_dtype.items():
        for index, piece in zip(indices, torch._utils._unflatten_dense_tensors(
                flats[dtype], [tensors[i] for i in indices]), strict=True):
            summed[index] = piece
    return summed


@dataclass
class _Bucket:
    parameters: list[torch.nn.Parameter]
    flat: torch.Tensor  # the bucket's gradients, one after another, summed over the groups in place
    views: list[torch.Tensor]  # each parameter's piece of ``flat``, shaped as the parameter
    waiting: int = 0  # gradients of this step's backward not accumulated yet
    work: Any = None


def _bucket(parameters: list[torch.nn.Parameter]) -> _Bucket:
    flat = torch.zeros(sum(p.numel() for p in parameters), dtype=parameters[0].dtype, device=parameters[0].device)
    views = [piece.view_as(p) for piece, p in zip(flat.split([p.numel() for p in parameters]), parameters,
                                                      strict=True)]
    return _Bucket(parameters, flat, views)


def buckets_in_backward_order(parameters: list[torch.nn.Parameter]) -> list[list[torch.nn.Parameter]]:
    """The parameters cut as DDP cuts them: reversed (backward finishes the last layers first),
    one dtype to a bucket, the first bucket up to ``FIRST_BUCKET_BYTES``, the others up to
    ``BUCKET_BYTES``."""
    buckets: list[list[torch.nn.Parameter]] = []
    size = 0
    for parameter in reversed(parameters):
        cap = FIRST_BUCKET_BYTES if len(buckets) <= 1 else BUCKET_BYTES
        nbytes = parameter.numel() * parameter.element_size()
        if not buckets or buckets[-1][0].dtype != parameter.dtype or size + nbytes > cap:
            buckets.append([])
            size = 0
        buckets[-1].append(parameter)
        size += nbytes
    return buckets


class OverlappedGradientSum:
    """A one-process group's gradients summed over the groups bucket by bucket during the
    backward that ends a step (``arm``), the rest started by ``start_rest``, all applied (the
    groups' mean) by ``finish``.

    Each bucket keeps one buffer for the whole fit, and a parameter's gradient becomes its piece
    of it when its bucket starts (as DDP's ``gradient_as_bucket_view``): the sum runs in place,
    and the mean is one division of the buffer, with nothing copied back. A gradient that is a
    piece already (``zero_grad(set_to_none=False)``) is not copied at all.

    NOTE: on a 2-core CPU (GPT-nano, timed part by part in ``experiments/reliability/overhead.py``'s
    jobs) a new buffer per bucket and step took 0.4-0.5 ms to fill, and copying each gradient
    back out of it with its division 0.9-1.3 ms, of a 40 ms step."""

    def __init__(self, manager: Any, parameters: list[torch.nn.Parameter]) -> None:
        self.manager = manager
        self.buckets = [_bucket(members) for members in buckets_in_backward_order(parameters)]
        self._bucket_of = {id(p): bucket for bucket in self.buckets for p in bucket.parameters}
        self._next = 0  # the next bucket to start
        self._armed = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._accumulated) for p in parameters]

    def arm(self) -> None:
        """The next backward ends the step: its gradients are summed as they are accumulated."""
        for bucket in self.buckets:
            bucket.waiting, bucket.work = len(bucket.parameters), None
        self._next = 0
        self._armed = True

    def _accumulated(self, parameter: torch.nn.Parameter) -> None:
        if not self._armed:
            return  # a micro batch inside an accumulation window: its gradients are not the step's
        self._bucket_of[id(parameter)].waiting -= 1
        while self._next < len(self.buckets) and self.buckets[self._next].waiting <= 0:
            self._start(self.buckets[self._next])

    def _start(self, bucket: _Bucket) -> None:
        unused, into, copied = [], [], []
        for parameter, view in zip(bucket.parameters, bucket.views, strict=True):
            if parameter.grad is None:
                unused.append(view)  # this group did not use it: it adds nothing to the sum
            elif parameter.grad.data_ptr() != view.data_ptr():
                into.append(view)
                copied.append(parameter)
        if unused:
            torch._foreach_zero_(unused)
        if into:
            torch._foreach_copy_(into, [parameter.grad for parameter in copied])
            for parameter, view in zip(copied, into, strict=True):
                parameter.grad = view
        bucket.work = self.manager.allreduce(bucket.flat, reduce_op=ReduceOp.SUM)
        self._next += 1

    def start_rest(self) -> None:
        """Start, in order, the buckets backward did not complete (all of them when it was not armed)."""
        if not self._armed:
            self.arm()
        while self._next < len(self.buckets):
            self._start(self.buckets[self._next])
        self._armed = False

    def finish(self, participants: int) -> None:
        """Wait for every bucket and make each gradient the groups' mean. A parameter that has no
        gradient here but had one in another group takes the mean, as DDP gives a parameter
        unused on one rank the others' average."""
        for bucket in self.buckets:
            bucket.work.wait()
        with torch.no_grad():
            for bucket in self.buckets:
                bucket.flat.div_(participants)
                for parameter, view in zip(bucket.parameters, bucket.views, strict=True):
                    if parameter.grad is None and view.any():
                        parameter.grad = view

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
