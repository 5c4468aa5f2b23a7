"""Autograd-aware collectives over the tensor-parallel group (Megatron's f/g operators and friends).

Each function is a pair of collectives: what forward does, and its adjoint in backward. The
activation layout is ``[..., sequence, hidden]``: "last dim" is the hidden/vocab dimension that
tensor parallelism splits; the sequence dimension (``-2``) is what sequence parallelism splits.

| function                       | forward                   | backward                  |
| ------------------------------ | ------------------------- | ------------------------- |
| copy_to_tensor_parallel        | identity                  | all-reduce                |
| reduce_from_tensor_parallel    | all-reduce                | identity                  |
| scatter_to_tensor_parallel     | split last dim            | all-gather last dim       |
| gather_from_tensor_parallel    | all-gather last dim       | split last dim            |
| scatter_to_sequence_parallel   | split sequence dim        | all-gather sequence dim   |
| gather_from_sequence_parallel  | all-gather sequence dim   | reduce-scatter sequence   |
| reduce_scatter_to_sequence_parallel | reduce-scatter sequence | all-gather sequence     |

All of them are the identity when the group has a single rank.

Sequence parallelism and what backward keeps: a column-parallel linear reading an all-gathered input
would keep the gathered (full-sequence) tensor for its weight gradient, ``t`` times what the rank
holds. :func:`gather_for_column_parallel` (one entry collective shared by several column layers)
and :class:`~lightning_3d.tensor_parallel.layers.ColumnParallelLinear` instead keep the sequence
shard and all-gather it again in backward (Megatron-LM's scheme; Korthikanti et al. 2022, section
4.2.2), so a layer's saved input is ``1/t`` of the gathered one.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_3d.core.distributed import all_gather_flat, reduce_scatter_flat
from lightning_3d.core.eager import communicates

SEQUENCE_DIM = -2


# -- raw collectives along an arbitrary dimension -------------------------------------------------
def _world(group: dist.ProcessGroup) -> int:
    return dist.get_world_size(group)


def _rank(group: dist.ProcessGroup) -> int:
    return dist.get_rank(group)


def all_reduce(x: Tensor, group: dist.ProcessGroup, inplace: bool = False) -> Tensor:
    out = x if inplace else x.clone()
    dist.all_reduce(out, group=group)
    return out


def split_along(x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    world = _world(group)
    if x.shape[dim] % world:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by the tensor-parallel size {world}.")
    return x.chunk(world, dim=dim)[_rank(group)].contiguous()


def gather_along(x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    world = _world(group)
    x = x.contiguous()
    flat = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_flat(flat, x, group=group)
    # (world, ..., d, ...) -> (..., world * d, ...)
    dim = dim % x.dim()
    return flat.view(world, *x.shape).movedim(0, dim).flatten(dim, dim + 1)


def start_gather_along_first(x: Tensor, group: dist.ProcessGroup) -> tuple[Tensor, Any]:
    """Start an all-gather of ``x`` (contiguous) along dim 0 without waiting: (output, work).
    The output is ``(world * x.shape[0], ...)`` on ``x``'s device; call ``work.wait()`` before reading it."""
    world = _world(group)
    flat = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    work = all_gather_flat(flat, x, group=group, async_op=True)
    return flat, work


def unflatten_gathered(flat: Tensor, shape: tuple[int, ...], dim: int) -> Tensor:
    """``(world * d0, ...)`` gathered by :func:`start_gather_along_first` from pieces of ``shape`` -> the
    pieces concatenated along ``dim`` (what :func:`gather_along` returns)."""
    world = flat.shape[0] // shape[0]
    dim = dim % len(shape)
    return flat.view(world, *shape).movedim(0, dim).flatten(dim, dim + 1)


def reduce_scatter_along(x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    world = _world(group)
    dim = dim % x.dim()
    if x.shape[dim] % world:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by the tensor-parallel size {world}.")
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((moved.shape[0] // world, *moved.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_flat(out, moved, group=group)
    return out.movedim(0, dim)


# -- autograd pairs ----------------------------------------------------------------------------
class _CopyToTP(torch.autograd.Function):
    """forward: identity; backward: all-reduce."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """forward: all-reduce; backward: identity."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup, inplace: bool) -> Tensor:
        return all_reduce(x, group, inplace=inplace)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return grad, None, None


class _Split(torch.autograd.Function):
    """forward: keep this rank's chunk of ``dim``; backward: all-gather along ``dim``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
        ctx.dim, ctx.group = dim, group
        return split_along(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return gather_along(grad, ctx.dim, ctx.group), None, None


class _Gather(torch.autograd.Function):
    """forward: all-gather along ``dim``; backward: keep this rank's chunk (or reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, group: dist.ProcessGroup, reduce_grad: bool) -> Tensor:
        ctx.dim, ctx.group, ctx.reduce_grad = dim, group, reduce_grad
        return gather_along(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        if ctx.reduce_grad:
            return reduce_scatter_along(grad, ctx.dim, ctx.group), None, None, None
        return split_along(grad, ctx.dim, ctx.group), None, None, None


class _ReduceScatter(torch.autograd.Function):
    """forward: reduce-scatter along ``dim``; backward: all-gather along ``dim``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
        ctx.dim, ctx.group = dim, group
        return reduce_scatter_along(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return gather_along(grad, ctx.dim, ctx.group), None, None


# -- public API ------------------------------------------------------------------------------------
@communicates
def copy_to_tensor_parallel(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Enter a tensor-parallel region with a replicated input (Megatron's ``f``)."""
    return x if _world(group) == 1 else _CopyToTP.apply(x, group)


@communicates
def reduce_from_tensor_parallel(x: Tensor, group: dist.ProcessGroup, inplace: bool = False) -> Tensor:
    """Leave a tensor-parallel region by summing partial results (Megatron's ``g``).

    ``inplace=True`` reuses ``x``'s memory; only for a fresh tensor nothing else reads.
    """
    return x if _world(group) == 1 else _ReduceFromTP.apply(x, group, inplace)


@communicates
def scatter_to_tensor_parallel(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    return x if _world(group) == 1 else _Split.apply(x, -1, group)


@communicates
def gather_from_tensor_parallel(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    return x if _world(group) == 1 else _Gather.apply(x, -1, group, False)


@communicates
def scatter_to_sequence_parallel(x: Tensor, group: dist.ProcessGroup, dim: int = SEQUENCE_DIM) -> Tensor:
    return x if _world(group) == 1 else _Split.apply(x, dim, group)


@communicates
def gather_from_sequence_parallel(x: Tensor, group: dist.ProcessGroup, dim: int = SEQUENCE_DIM) -> Tensor:
    """Enter a tensor-parallel region from a sequence-sharded one (the sequence-parallel ``f``).

    Whatever reads the gathered tensor and saves it for backward keeps the full sequence; for
    column-parallel layers use :func:`gather_for_column_parallel` (or let the layer gather)."""
    return x if _world(group) == 1 else _Gather.apply(x, dim, group, True)


class SequenceShard:
    """Attached (as ``SEQUENCE_SHARD_ATTR``) to a tensor :func:`gather_for_column_parallel` gathered:
    the shard it came from, so that column-parallel layers reading the gathered tensor keep the shard
    for backward instead (:class:`~lightning_3d.tensor_parallel.layers.ColumnParallelLinear`).

    Layers computing in another dtype (autocast) share one cast of the shard (``cast``); the layers'
    backward passes share one re-gather of it (``regather``). The object lives as long as the
    gathered tensor (forward only); ``regather`` is referenced by the layers' autograd nodes and
    holds a tensor only between the first and the last of their backward passes."""

    __slots__ = ("shard", "dim", "group", "casts", "regather", "versions")

    def __init__(self, shard: Tensor, dim: int, group: dist.ProcessGroup, gathered: Tensor) -> None:
        self.shard, self.dim, self.group = shard, dim, group
        self.casts: dict[torch.dtype, Tensor] = {}
        self.regather = SharedRegather()
        self.versions = (shard._version, gathered._version)

    def matches(self, gathered: Tensor) -> bool:
        """Neither the shard nor the gathered tensor was modified in place since the gather (an in-place
        dropout or ``mul_`` in between): only then is the shard what the layer's input came from."""
        return self.versions == (self.shard._version, gathered._version)

    def shard_as(self, dtype: torch.dtype) -> Tensor:
        """The shard (detached) in ``dtype``: one cast per dtype, shared by the layers."""
        if self.shard.dtype == dtype:
            return self.shard.detach()
        if dtype not in self.casts:
            self.casts[dtype] = self.shard.detach().to(dtype)
        return self.casts[dtype]


class SharedRegather:
    """One backward all-gather of a saved sequence shard for the column layers that read it: the first
    layer whose backward runs starts it (``begin``, asynchronous: the input gradient is computed
    meanwhile), ``finish`` waits for it; the others reuse it, and after the last of the layers
    counted in forward (``register``) it is let go."""

    __slots__ = ("users", "left", "full", "pending")

    def __init__(self) -> None:
        self.users, self.left = 0, 0
        self.full: Optional[Tensor] = None
        self.pending: Optional[tuple[Tensor, Any, tuple[int, ...], int]] = None

    def register(self) -> "SharedRegather":
        self.users += 1
        return self

    def begin(self, shard: Tensor, dim: int, group: dist.ProcessGroup) -> None:
        if self.full is None and self.pending is None:
            flat, work = start_gather_along_first(shard.contiguous(), group)
            self.pending = (flat, work, tuple(shard.shape), dim)

    def finish(self) -> Tensor:
        if self.full is None:
            assert self.pending is not None, "SharedRegather.finish() before begin()"
            flat, work, shape, dim = self.pending
            self.pending = None
            if work is not None:
                work.wait()
            self.full, self.left = unflatten_gathered(flat, shape, dim), self.users
        full = self.full
        self.left -= 1
        if self.left <= 0:
            self.full = None
        return full


SEQUENCE_SHARD_ATTR = "_lightning_3d_sequence_shard"


@communicates
def gather_for_column_parallel(x: Tensor, group: dist.ProcessGroup, dim: int = SEQUENCE_DIM) -> Tensor:
    """:func:`gather_from_sequence_parallel` for an input several column-parallel layers read (q/k/v,
    gate/up): one all-gather in forward, one reduce-scatter of their summed input gradients in backward,
    and -- unlike a plain gather -- the layers keep ``x`` (the shard) for their weight gradients, not the
    gathered tensor, and re-gather it once in backward."""
    if _world(group) == 1:
        return x
    gathered = _Gather.apply(x, dim, group, True)
    setattr(gathered, SEQUENCE_SHARD_ATTR, SequenceShard(x, dim, group, gathered))
    return gathered


@communicates
def reduce_scatter_to_sequence_parallel(x: Tensor, group: dist.ProcessGroup, dim: int = SEQUENCE_DIM) -> Tensor:
    """Leave a tensor-parallel region into a sequence-sharded one (the sequence-parallel ``g``)."""
    return x if _world(group) == 1 else _ReduceScatter.apply(x, dim, group)
