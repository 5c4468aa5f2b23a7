"""The backward-time skeleton shared by every gradient reducer: buckets, hooks, launch order.

Parameters are grouped (in the order autograd produces their gradients) into fixed-size
buckets. A post-accumulate-grad hook counts each parameter in; when a bucket is complete its
collective is launched asynchronously, so communication overlaps the rest of backward. When
backward ends (autograd's final callback) the remaining buckets are launched, everything is
waited on and the subclass finishes each bucket.

Rules that keep ranks in lockstep:

* Buckets are launched strictly in index order on every rank, whatever order gradients arrive
  in, so collectives always match.
* A bucket whose parameters are all frozen right now (``requires_grad=False``: Lightning's
  ``toggle_optimizer``) is skipped; freezing is the same on every rank.
* While disabled (gradient accumulation) hooks do nothing: no communication at all.
* ``after_backward`` covers a rank on which no hook fired (no gradient at all): its peers still
  expect the collectives.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Generic, Optional, TypeVar

import torch
import torch.distributed as dist
from torch.nn import Parameter

from lightning_3d.core.config import DEFAULT_BUCKET_MB
from lightning_3d.core.param_meta import replica_mesh_of
from lightning_3d.tensor_parallel.spec import sequence_parallel_group, take_sequence_parallel_sums

DEFAULT_BUCKET_BYTES = int(DEFAULT_BUCKET_MB * 2**20)

B = TypeVar("B")


def bucket_owners(params: list[Parameter], replicas: dist.ProcessGroup) -> dist.ProcessGroup:
    """The group a bucket reduces over: the ranks holding its parameters (one kind per bucket:
    :func:`assign_buckets`), i.e. ``replicas`` (every weight replica) unless they are expert slices."""
    mesh = replica_mesh_of(params[0])
    return replicas if mesh is None else mesh.get_group()


def unique_trainable(params: Iterable[Parameter]) -> list[Parameter]:
    unique: dict[int, Parameter] = {}
    for p in params:
        if p.requires_grad:
            unique.setdefault(id(p), p)
    return list(unique.values())


def assign_buckets(params: list[Parameter], bucket_bytes: int) -> list[list[Parameter]]:
    """Split parameters (already in gradient-ready order) into buckets per (device, dtype, the ranks
    holding them: every weight replica, or an expert slice's expert replicas; the tp group their
    gradient is partial over, for sequence-parallel replicas, whose bucket is summed over it)."""
    buckets: list[list[Parameter]] = []
    open_bucket: dict[tuple[Any, ...], tuple[list[Parameter], int]] = {}
    for p in params:
        key = (p.device, p.dtype, id(replica_mesh_of(p)), id(sequence_parallel_group(p)))
        members, size = open_bucket.get(key, ([], 0))
        if members and size + p.numel() * p.element_size() > bucket_bytes:
            buckets.append(members)
            members, size = [], 0
        members.append(p)
        open_bucket[key] = (members, size + p.numel() * p.element_size())
    buckets.extend(members for members, _ in open_bucket.values() if members)
    return buckets


class BucketedBackward(Generic[B]):
    """Subclasses build ``self.buckets`` (objects with a ``params`` list) and implement
    ``_gradient_ready``, ``_launch`` and ``_complete``."""

    def __init__(self, group: dist.ProcessGroup, max_in_flight: int = 2) -> None:
        self.group = group
        self.max_in_flight = max_in_flight  # launched, uncompleted buckets: bounds transient buffers
        self.world = dist.get_world_size(group)
        self.enabled = True
        self.collectives_launched = 0
        self.buckets: list[B] = []
        self._slot: dict[int, tuple[int, int]] = {}
        self._hooks: list[Any] = []
        self._pending = False
        self._finished = False
        self._reset()

    def _register(self, buckets: list[B]) -> None:
        self.buckets = buckets
        for b_idx, bucket in enumerate(buckets):
            for i, p in enumerate(bucket.params):  # type: ignore[attr-defined]
                self._slot[id(p)] = (b_idx, i)
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))
        take_sequence_parallel_sums(self._params(), True)  # a subclass sums their buckets over tp instead
        self._reset()

    def _params(self) -> list[Parameter]:
        return [p for bucket in self.buckets for p in bucket.params]  # type: ignore[attr-defined]

    # -- subclass interface ----------------------------------------------------------------
    def _gradient_ready(self, bucket: B, index: int, param: Parameter) -> bool:
        """Take ``param.grad`` into the bucket; return False if it was already taken this backward."""
        raise NotImplementedError

    def _launch(self, bucket: B) -> Optional[dist.Work]:
        raise NotImplementedError

    def _complete(self, bucket: B) -> None:
        raise NotImplementedError

    def _accumulated(self, bucket: B, index: int) -> None:
        """A gradient arrived while communication is off (accumulation): nothing to send, but a
        subclass may note that the parameter was used this step."""

    @property
    def active(self) -> bool:
        return self.enabled

    # -- machinery ---------------------------------------------------------------------------
    def _on_grad_ready(self, param: Parameter) -> None:
        b_idx, i = self._slot[id(param)]
        if not self.active:
            self._accumulated(self.buckets[b_idx], i)
            return
        if self._launched[b_idx] or not self._gradient_ready(self.buckets[b_idx], i, param):
            return
        self._ready[b_idx] += 1
        if not self._pending:
            self._pending = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if self._ready[self._next_launch] < len(bucket.params):  # type: ignore[attr-defined]
                return
            self._launch_next()

    def _launch_next(self) -> None:
        b_idx = self._next_launch
        bucket = self.buckets[b_idx]
        self._launched[b_idx] = True
        self._next_launch += 1
        if all(not p.requires_grad for p in bucket.params):  # type: ignore[attr-defined]
            self._skipped[b_idx] = True  # frozen on every rank right now (toggled optimizers)
            return
        self._handles[b_idx] = self._launch(bucket)
        self.collectives_launched += 1
        in_flight = [i for i in range(self._next_launch) if not self._skipped[i] and not self._completed[i]]
        for i in in_flight[: max(0, len(in_flight) - self.max_in_flight)]:
            self._complete_bucket(i)  # the oldest first: keeps at most max_in_flight buffers alive

    def _complete_bucket(self, b_idx: int) -> None:
        handle = self._handles[b_idx]
        if handle is not None:
            handle.wait()
        self._complete(self.buckets[b_idx])
        self._completed[b_idx] = True

    def finish(self) -> None:
        """Launch what is left (in order), wait for everything, complete every launched bucket.

        Runs automatically when backward ends; a second call is a no-op until the next backward.
        """
        if not self._pending:
            return
        while self._next_launch < len(self.buckets):
            self._launch_next()
        for b_idx in range(len(self.buckets)):
            if not self._skipped[b_idx] and not self._completed[b_idx]:
                self._complete_bucket(b_idx)
        self._reset()
        self._finished = True

    def _reset(self) -> None:
        n = len(self.buckets)
        self._ready = [0] * n
        self._launched = [False] * n
        self._skipped = [False] * n
        self._completed = [False] * n
        self._handles: list[Optional[dist.Work]] = [None] * n
        self._next_launch = 0
        self._pending = False

    def after_backward(self) -> None:
        """Called by the strategy after every backward (see the module docstring)."""
        if self.active and not self._finished:
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
        take_sequence_parallel_sums(self._params(), False)  # their hooks sum again

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)
