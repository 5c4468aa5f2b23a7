"""Gradient averaging over the data-parallel group for plain data parallel (ZeRO stage 0).

Built on :class:`~lightning_3d.zero.buckets.BucketedBackward`: gradients are copied into flat
buckets as autograd produces them, each bucket is all-reduced asynchronously as soon as it is
complete, and averaged gradients are written back to ``param.grad`` when backward ends.

Semantics match one process exactly:

* Each bucket carries one presence flag per parameter. A parameter that got no gradient on *any*
  rank keeps ``grad=None`` (optimizers skip it, as without data parallel); one that got a
  gradient on some ranks is averaged with zeros from the others.
* Averaging the whole accumulated ``param.grad`` is linear, so gradients already averaged by an
  earlier backward in the same step (several optimizers, GANs) stay correct.
* Expert slices: an expert's local gradient already sums the rows of its whole expert group
  (``lightning_3d/moe/expert_parallel.py``), so the step's gradient is the sum over the ranks that
  hold it (its ``R / ep`` expert replicas) divided by the ``R`` weight replicas. That operation is not
  idempotent: applied again to a gradient reduced by an earlier backward of the same step (manual
  optimization reduces every backward), it would divide that part by ``ep`` once more. So each
  incoming expert gradient is scaled by ``owners / R`` as it arrives (a gradient hook, before
  accumulation, under ``no_sync`` too; a pipeline runs it once, when it hands its stash over: the
  hook is recorded on the parameter for that), and its bucket is *averaged* over its owners like a dense
  bucket over all replicas: every reduction is then a mean over the ranks holding identical copies,
  which leaves an already reduced part unchanged.
* Sequence-parallel replicas (layer norms, row-parallel biases, routers: a partial gradient on each
  tp rank) go into buckets of their own, which the reducer sums over tp too, in place of one blocking
  all-reduce per parameter from their hooks (``SumOverGroup.taken``). The same rule keeps it
  idempotent: each contribution is scaled by tp as it arrives, and the bucket is averaged over dp,
  then over tp (a mean over the dp x tp ranks, which end with identical copies). At dp = 1 the
  reducer holds only these buckets.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Parameter

from lightning_3d.core.param_meta import update_meta
from lightning_3d.tensor_parallel.spec import sequence_parallel_group
from lightning_3d.zero.buckets import DEFAULT_BUCKET_BYTES, BucketedBackward, assign_buckets, bucket_owners, unique_trainable


@dataclass
class _Bucket:
    params: list[Parameter]
    offsets: list[int]
    numel: int
    buffer: Tensor  # numel gradient slots followed by one presence flag per parameter
    present: list[bool] = field(default_factory=list)
    owners: Optional[dist.ProcessGroup] = None  # the ranks holding these parameters (None: one rank)
    holders: int = 1  # how many ranks hold these parameters (the mean's divisor)
    partial: Optional[dist.ProcessGroup] = None  # sequence-parallel replicas: the tp group their gradients are partial over
    partial_world: int = 1

    def grad_view(self, i: int) -> Tensor:
        p = self.params[i]
        return self.buffer[self.offsets[i] : self.offsets[i] + p.numel()].view_as(p)


class ScaleOnArrival:
    """Gradient hook: each incoming contribution times ``scale`` (off while a pipeline fills its stash,
    which it hands over in one backward that runs the hook once)."""

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.enabled = True

    def __call__(self, grad: Tensor) -> Tensor:
        return grad * self.scale if self.enabled else grad


class GradientReducer(BucketedBackward[_Bucket]):
    """Averages ``param.grad`` over ``group`` with bucketed, overlapped all-reduces."""

    def __init__(self, params: Iterable[Parameter], group: dist.ProcessGroup, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        super().__init__(group)
        buckets = []
        trainable = unique_trainable(params)
        if self.world == 1:  # nothing to average: only sequence-parallel replicas need a reduction (over tp)
            trainable = [p for p in trainable if sequence_parallel_group(p) is not None]
        # Autograd produces gradients roughly in reverse order of registration.
        for members in assign_buckets(trainable[::-1], bucket_bytes):
            offsets, total = [], 0
            for p in members:
                offsets.append(total)
                total += p.numel()
            buffer = torch.zeros(total + len(members), dtype=members[0].dtype, device=members[0].device)
            owners = bucket_owners(members, group)
            holders = dist.get_world_size(owners)
            partial = sequence_parallel_group(members[0])
            partial_world = dist.get_world_size(partial) if partial is not None else 1
            buckets.append(
                _Bucket(members, offsets, total, buffer, [False] * len(members), owners if holders > 1 else None, holders, partial, partial_world)
            )
            scale = holders / self.world * partial_world
            if scale != 1.0:  # expert slices, sequence-parallel replicas: each contribution scaled once, as it arrives
                hook = ScaleOnArrival(scale)
                for p in members:
                    self._hooks.append(p.register_hook(hook))
                    update_meta(p, arrival_scale_hook=hook)  # (a pipeline defers it to its hand-over)
        self._register(buckets)

    def remove(self) -> None:
        super().remove()
        for p in self._params():  # (this reducer is the only writer of the record)
            update_meta(p, arrival_scale_hook=None)

    @property
    def active(self) -> bool:
        return self.enabled and bool(self.buckets)

    def _gradient_ready(self, bucket: _Bucket, index: int, param: Parameter) -> bool:
        if bucket.present[index]:
            return False  # a retained graph backpropagated twice: taken already
        bucket.grad_view(index).copy_(param.grad)
        bucket.present[index] = True
        return True

    def _launch(self, bucket: _Bucket) -> Optional[dist.Work]:
        flags = []
        for i, p in enumerate(bucket.params):
            if not bucket.present[i]:
                view = bucket.grad_view(i)
                if p.grad is not None:  # a gradient from an earlier backward of this step
                    view.copy_(p.grad)
                else:
                    view.zero_()
            flags.append(1.0 if (bucket.present[i] or p.grad is not None) else 0.0)
        bucket.buffer[bucket.numel :].copy_(torch.tensor(flags, dtype=bucket.buffer.dtype))
        divisor = bucket.holders * bucket.partial_world
        if divisor > 1:  # the mean over identical copies (sequence-parallel replicas: over dp x tp)
            bucket.buffer[: bucket.numel].mul_(1.0 / divisor)
        if bucket.owners is None:
            return None  # an expert slice held by one rank, or dp = 1: its mean over dp is itself
        return dist.all_reduce(bucket.buffer, group=bucket.owners, async_op=True)

    def _complete(self, bucket: _Bucket) -> None:
        if bucket.partial is not None:  # then over tp (after the dp sum: every rank calls it in bucket order)
            dist.all_reduce(bucket.buffer[: bucket.numel], group=bucket.partial)
        # (a dry run's meta buffers have no values: every parameter counts as present)
        flags = [1.0] * len(bucket.params) if bucket.buffer.is_meta else bucket.buffer[bucket.numel :].tolist()
        for i, p in enumerate(bucket.params):
            if flags[i] == 0:
                continue  # no rank produced a gradient: leave grad as it was (None)
            if p.grad is None:
                p.grad = bucket.grad_view(i).clone()
            else:
                p.grad.copy_(bucket.grad_view(i))
        bucket.present = [False] * len(bucket.params)
