"""How a tensor-parallel parameter relates to its dense counterpart.

Every parameter of a tensor-parallel model carries a :class:`TPSpec` (:func:`get_spec`; kept in the
parameter's :class:`~lightning_3d.core.param_meta.ParameterMeta`):

* ``dim=None``: replicated, identical on every tp rank (layer norms, row-parallel biases);
  gradient norms count it once. ``sequence_parallel=True`` marks replicated parameters that
  only see a sequence shard, so their gradients must be summed over the tp group.
* ``dim=d``: split along ``d``; ``padded_size`` is the split dimension after padding (vocabulary
  padded to a multiple of tp); ``num_blocks > 1`` means the dense dimension is made of equal
  blocks that are split separately (a fused q/k/v projection: each rank holds q_r, k_r, v_r).
* ``transposed=True``: the *dense* tensor -- what checkpoints, consolidation, export and the
  optimizer's dense state see -- is the transpose of this layer's layout. Hugging Face's ``Conv1D``
  (GPT-2) stores ``[in, out]``; its tensor-parallel replacement computes with ``[out, in]`` slices.
  ``full_shape`` is always the dense shape; ``dim``, ``num_blocks`` and ``padded_size`` describe the
  layout (:attr:`TPSpec.layout_shape`), so ``local == shard_tensor(dense.t() if transposed else
  dense, dim, world, rank, num_blocks, padded_size)``.

The spec is what checkpoints use to gather and re-split tensors, and what ZeRO shards further.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_3d.core.param_meta import meta_of, update_meta
from lightning_3d.tensor_parallel.mappings import all_reduce, gather_along



@dataclass(frozen=True)
class TPSpec:
    dim: Optional[int]
    world: int
    rank: int
    full_shape: tuple[int, ...]
    padded_size: Optional[int] = None
    num_blocks: int = 1
    sequence_parallel: bool = False
    group: Optional[dist.ProcessGroup] = field(default=None, compare=False, repr=False)
    transposed: bool = False

    @property
    def is_sharded(self) -> bool:
        return self.dim is not None and self.world > 1

    @property
    def layout_shape(self) -> tuple[int, ...]:
        """The full (unsplit, unpadded) shape in this layer's own layout."""
        return tuple(reversed(self.full_shape)) if self.transposed else tuple(self.full_shape)

    @property
    def differs_from_dense(self) -> bool:
        """The local tensor is not simply the dense one: split over ranks, or transposed (or both)."""
        return self.is_sharded or self.transposed


def padded(size: int, world: int) -> int:
    """``size`` rounded up to a multiple of ``world``."""
    return -(-size // world) * world


def get_spec(param: Tensor) -> Optional[TPSpec]:
    return meta_of(param).tp_spec


def set_spec(param: Tensor, spec: TPSpec) -> None:
    update_meta(param, tp_spec=spec)


def replicated_spec(param: Tensor, group: dist.ProcessGroup, sequence_parallel: bool = False) -> TPSpec:
    return TPSpec(
        dim=None,
        world=dist.get_world_size(group),
        rank=dist.get_rank(group),
        full_shape=tuple(param.shape),
        sequence_parallel=sequence_parallel,
        group=group,
    )


class SumOverGroup:
    """Gradient hook summing each incoming gradient over a group; ``enabled`` lets a pipeline
    runtime defer the sum to the single backward that hands its gradients to the optimizer. A
    data-parallel reducer that buckets the parameter sets ``taken`` and sums the bucket over the
    group itself, in one call for all such parameters, instead of one blocking call per parameter."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.enabled = True
        self.taken = False

    def __call__(self, grad: Tensor) -> Tensor:
        return all_reduce(grad, self.group) if self.enabled and not self.taken else grad


def sequence_parallel_group(param: Tensor) -> Optional[dist.ProcessGroup]:
    """The tp group over which ``param``'s gradient is partial (a sequence-parallel replica), if any."""
    hook = meta_of(param).sequence_parallel_hook
    return hook.group if hook is not None and dist.get_world_size(hook.group) > 1 else None


def take_sequence_parallel_sums(params: list[Tensor], taken: bool) -> None:
    """Hand the tp sums of these parameters' gradients to a reducer (``taken``), or back to their hooks."""
    for p in params:
        hook = meta_of(p).sequence_parallel_hook
        if hook is not None:
            hook.taken = taken


def mark_sequence_parallel(param: Tensor, group: dist.ProcessGroup) -> None:
    """A replicated parameter applied to a sequence shard: each rank's gradient is partial, so every
    backward's contribution is summed over the tp group (a gradient hook: exact under accumulation
    and repeated backward passes)."""
    spec = get_spec(param)
    if spec is not None and spec.sequence_parallel:
        return
    hook = SumOverGroup(group)
    param.register_hook(hook)
    update_meta(param, tp_spec=replicated_spec(param, group, sequence_parallel=True), sequence_parallel_hook=hook)


def sum_partial_gradients(params: list[Tensor], device: torch.device) -> int:
    """Sum over tp the gradients of replicated parameters that see partial inputs, where their hook
    could not do it: FSDP2 (ZeRO-3) swaps the Parameter objects and writes the reduced-scattered
    shard's ``.grad`` itself, so the :class:`SumOverGroup` hook is gone. The sum of the dp-averaged
    shards over tp equals the dp average of the tp sums (both linear); done once per optimizer step,
    one all-reduce per (group, dtype) over the flattened gradients in parameter order (every tp peer
    holds the same parameters, shards of the same sizes). Returns how many were summed."""
    pending: dict[tuple[int, torch.dtype], tuple[dist.ProcessGroup, list[Tensor]]] = {}
    for p in params:
        group = meta_of(p).partial_gradient_group
        if group is None or p.grad is None:
            continue
        local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        pending.setdefault((id(group), local.dtype), (group, []))[1].append(local)
    for group, locals_ in pending.values():
        flat = torch.cat([t.reshape(-1).to(device) for t in locals_])
        dist.all_reduce(flat, group=group)
        for t, part in zip(locals_, flat.split([t.numel() for t in locals_])):
            t.copy_(part.view_as(t))
    return sum(len(locals_) for _, locals_ in pending.values())


def shard_tensor(full: Tensor, dim: int, world: int, rank: int, num_blocks: int = 1, padded_size: Optional[int] = None) -> Tensor:
    """This rank's shard of a dense tensor (padding the split dimension with zeros if asked)."""
    if padded_size is not None and padded_size > full.shape[dim]:
        pad_shape = list(full.shape)
        pad_shape[dim] = padded_size - full.shape[dim]
        full = torch.cat([full, full.new_zeros(pad_shape)], dim=dim)
    blocks = full.chunk(num_blocks, dim=dim)
    return torch.cat([b.chunk(world, dim=dim)[rank] for b in blocks], dim=dim).contiguous()


def _transpose(t: Tensor) -> Tensor:
    if t.dim() != 2:
        raise ValueError(f"a transposed tensor-parallel spec needs a matrix, got shape {tuple(t.shape)}.")
    return t.t().contiguous()


def shard_like(full: Tensor, spec: TPSpec) -> Tensor:
    """Re-split a dense tensor (e.g. from a consolidated checkpoint) for the rank ``spec`` describes
    (transposed into the layer's layout first when ``spec.transposed``)."""
    if spec.transposed:
        full = _transpose(full)
    if not spec.is_sharded:
        return full
    assert spec.dim is not None
    return shard_tensor(full, spec.dim, spec.world, spec.rank, spec.num_blocks, spec.padded_size)


def gather_full(shard: Tensor, spec: TPSpec) -> Tensor:
    """The dense tensor from every rank's shard (a collective over ``spec.group``), padding removed,
    transposed back when the layer's layout is the dense tensor's transpose."""
    if not spec.is_sharded:
        return _transpose(shard) if spec.transposed else shard
    assert spec.dim is not None and spec.group is not None
    dim = spec.dim % shard.dim()
    gathered = gather_along(shard, dim, spec.group)
    if spec.num_blocks > 1:  # (rank-major) q0 k0 v0 q1 k1 v1 -> (block-major) q0 q1 k0 k1 v0 v1
        pieces = gathered.chunk(spec.world * spec.num_blocks, dim=dim)
        order = [pieces[r * spec.num_blocks + b] for b in range(spec.num_blocks) for r in range(spec.world)]
        gathered = torch.cat(order, dim=dim)
    gathered = gathered.narrow(dim, 0, spec.layout_shape[dim])
    return _transpose(gathered) if spec.transposed else gathered


def assemble_dense(locals_by_rank: dict[int, Tensor], spec: dict) -> Tensor:
    """The dense tensor from every tensor-parallel rank's local tensor, without communication.

    ``spec`` is a serialized :class:`TPSpec` (``dim``, ``world``, ``num_blocks``, ``full_shape`` -- the
    dense shape --, ``transposed``): the inverse of :func:`shard_tensor` (and of the transpose), used
    when reading sharded checkpoints.
    """
    dim, world = spec.get("dim"), spec.get("world", 1)
    transposed = bool(spec.get("transposed", False))
    if dim is None or world == 1:
        local = next(iter(locals_by_rank.values()))
        return _transpose(local) if transposed else local
    missing = set(range(world)) - set(locals_by_rank)
    if missing:
        raise ValueError(f"tensor-parallel ranks {sorted(missing)} of a sharded tensor are missing.")
    blocks = spec.get("num_blocks", 1)
    parts = [locals_by_rank[r].chunk(blocks, dim=dim) for r in range(world)]
    dense = torch.cat([parts[r][b] for b in range(blocks) for r in range(world)], dim=dim)
    layout = list(reversed(spec["full_shape"])) if transposed else list(spec["full_shape"])
    dense = dense.narrow(dim, 0, layout[dim])
    return _transpose(dense) if transposed else dense


def spec_record(spec: Optional[TPSpec], full_shape: tuple[int, ...]) -> dict:
    """A serializable description of how a local tensor relates to its dense counterpart.
    ``full_shape`` is the dense shape; ``transposed`` appears only when true (older manifests lack it)."""
    if spec is None or not spec.differs_from_dense:
        return {"dim": None, "world": 1, "rank": 0, "num_blocks": 1, "full_shape": list(full_shape)}
    if not spec.is_sharded:  # transposed only
        return {"dim": None, "world": 1, "rank": 0, "num_blocks": 1, "full_shape": list(spec.full_shape), "transposed": True}
    record = {
        "dim": spec.dim,
        "world": spec.world,
        "rank": spec.rank,
        "num_blocks": spec.num_blocks,
        "full_shape": list(spec.full_shape),
    }
    if spec.transposed:
        record["transposed"] = True
    return record
