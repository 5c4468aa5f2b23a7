"""Bucketed, overlapped gradient averaging over the data-parallel group (ZeRO stage 0).

Gradients are copied into fixed-size flat buckets as autograd produces them; a bucket's
all-reduce is launched asynchronously as soon as all of its gradients are ready, so
communication overlaps the rest of backward. When backward ends every bucket is waited on
and the averaged gradients are written back to ``param.grad``.

Correctness rules worth knowing:

* Buckets are launched strictly in index order on every rank, so collectives always match
  even when ranks see gradients in a different order or some parameters are unused.
* Each bucket carries one presence flag per parameter. A parameter that got no gradient on
  *any* rank keeps ``grad=None`` (optimizers then skip it, exactly as without data parallel);
  one that got a gradient on some ranks is averaged with zeros from the others.
* Averaging the whole accumulated ``param.grad`` is linear, so gradients that were already
  averaged by an earlier backward in the same step (several optimizers, GANs) stay correct.
* While disabled (gradient accumulation steps) the hooks do nothing: no communication.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Parameter

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


@dataclass
class _Bucket:
    params: list[Parameter]
    offsets: list[int]
    numel: int
    buffer: Tensor  # numel gradient slots followed by one presence flag per parameter
    ready: int = 0
    handle: Optional[dist.Work] = None
    launched: bool = False
    present: list[bool] = field(default_factory=list)

    def reset(self) -> None:
        self.ready = 0
        self.handle = None
        self.launched = False
        self.present = [False] * len(self.params)

    def grad_view(self, i: int) -> Tensor:
        p = self.params[i]
        return self.buffer[self.offsets[i] : self.offsets[i] + p.numel()].view_as(p)


def _assign_buckets(params: list[Parameter], bucket_bytes: int) -> list[list[Parameter]]:
    """Group parameters (already in expected gradient-ready order) by device and dtype into buckets."""
    buckets: list[list[Parameter]] = []
    open_bucket: dict[tuple[torch.device, torch.dtype], tuple[list[Parameter], int]] = {}
    for p in params:
        key = (p.device, p.dtype)
        members, size = open_bucket.get(key, ([], 0))
        if members and size + p.numel() * p.element_size() > bucket_bytes:
            buckets.append(members)
            members, size = [], 0
        members.append(p)
        open_bucket[key] = (members, size + p.numel() * p.element_size())
    buckets.extend(members for members, _ in open_bucket.values() if members)
    return buckets


class GradientReducer:
    """Averages ``param.grad`` over ``group`` with bucketed, overlapped all-reduces."""

    def __init__(
        self,
        params: Iterable[Parameter],
        group: dist.ProcessGroup,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        unique: dict[int, Parameter] = {}
        for p in params:
            if p.requires_grad:
                unique.setdefault(id(p), p)
        # Autograd produces gradients roughly in reverse order of registration.
        ordered = list(unique.values())[::-1]
        self.group = group
        self.world = dist.get_world_size(group)
        self.enabled = True
        self.collectives_launched = 0
        self._buckets: list[_Bucket] = []
        self._slot: dict[int, tuple[int, int]] = {}
        for b_idx, members in enumerate(_assign_buckets(ordered, bucket_bytes)):
            offsets, total = [], 0
            for i, p in enumerate(members):
                offsets.append(total)
                total += p.numel()
                self._slot[id(p)] = (b_idx, i)
            buffer = torch.zeros(total + len(members), dtype=members[0].dtype, device=members[0].device)
            bucket = _Bucket(members, offsets, total, buffer)
            bucket.reset()
            self._buckets.append(bucket)
        self._next_launch = 0
        self._pending = False
        self._finished = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in unique.values()]

    # -- backward-time machinery ----------------------------------------------------------
    def _on_grad_ready(self, param: Parameter) -> None:
        if not self.enabled or self.world == 1:
            return
        b_idx, i = self._slot[id(param)]
        bucket = self._buckets[b_idx]
        if bucket.launched or bucket.present[i]:
            return  # already reduced in this backward (e.g. a retained graph backpropagated twice)
        bucket.grad_view(i).copy_(param.grad)
        bucket.present[i] = True
        bucket.ready += 1
        if not self._pending:
            self._pending = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next_launch < len(self._buckets):
            bucket = self._buckets[self._next_launch]
            if bucket.ready < len(bucket.params):
                return
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
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
        bucket.buffer[: bucket.numel].mul_(1.0 / self.world)
        bucket.handle = dist.all_reduce(bucket.buffer, group=self.group, async_op=True)
        bucket.launched = True
        self.collectives_launched += 1
        self._next_launch += 1

    def finish(self) -> None:
        """Launch what is left (in order), wait for everything, write averaged gradients back.

        Runs automatically when backward ends; calling it again is a no-op until the next backward.
        """
        if not self._pending:
            return
        for bucket in self._buckets[self._next_launch :]:
            if all(not p.requires_grad for p in bucket.params):
                bucket.launched = True  # frozen now on every rank (toggled optimizers): skip it
                self._next_launch += 1
                continue
            self._launch(bucket)
        for bucket in self._buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
                flags = bucket.buffer[bucket.numel :].tolist()
                for i, p in enumerate(bucket.params):
                    if flags[i] == 0:
                        continue  # no rank produced a gradient: leave grad as it was (None)
                    if p.grad is None:
                        p.grad = bucket.grad_view(i).clone()
                    else:
                        p.grad.copy_(bucket.grad_view(i))
            bucket.reset()
        self._next_launch = 0
        self._pending = False
        self._finished = True

    def after_backward(self) -> None:
        """Called by the strategy after every backward.

        Normally a no-op (the end-of-backward callback already finished). It matters on a rank
        where no gradient at all was produced: its hooks never fired, but its peers still expect
        the bucket collectives.
        """
        if self.enabled and self.world > 1 and not self._finished:
            self._pending = True
            self.finish()
        self._finished = False

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, with no communication."""
        previous, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = previous

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)
