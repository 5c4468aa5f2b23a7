"""Small collective helpers shared by the strategy and the parallel layers."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_3d.core.param_meta import replica_mesh_of


def current_compute_device() -> torch.device:
    """Where a rank that holds no tensors of its own makes the ones it communicates: the current GPU
    when there is one (NCCL refuses host tensors), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def all_gather_flat(output: Tensor, input: Tensor, group: Optional[dist.ProcessGroup] = None, async_op: bool = False) -> Any:
    """Every rank's ``input`` into ``output``, in rank order. torch 2.13 renamed
    ``all_gather_into_tensor`` to ``all_gather_single`` (the old name warns); looked up per call, since
    strict communication mode patches both."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


def reduce_scatter_flat(output: Tensor, input: Tensor, group: Optional[dist.ProcessGroup] = None, async_op: bool = False) -> Any:
    """The sum of every rank's ``input``, this rank's block of it into ``output`` (torch 2.13's
    ``reduce_scatter_single``; ``reduce_scatter_tensor`` before it)."""
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return reduce_scatter(output, input, group=group, async_op=async_op)


def broadcast_tensors(tensors: Iterable[Tensor], group: dist.ProcessGroup, src: int, device: Optional[torch.device] = None) -> None:
    """Broadcast ``tensors`` in place from global rank ``src``, one flat message per (device, dtype).
    ``device``: where the message travels (the compute device; NCCL refuses host tensors, e.g. CPU-
    offloaded shards)."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[Tensor]] = defaultdict(list)
    for t in tensors:
        by_kind[(t.device, t.dtype)].append(t)
    for kind in sorted(by_kind, key=str):  # same order on every rank
        members = by_kind[kind]
        flat = torch.cat([t.detach().reshape(-1) for t in members])
        if device is not None and flat.device != device:
            flat = flat.to(device)
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        for t in members:
            t.data.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def broadcast_module_state(module: nn.Module, group: dist.ProcessGroup, src: int, device: Optional[torch.device] = None) -> None:
    """Make every replica in ``group`` start from ``src``'s parameters and buffers.

    DTensors (already sharded by ZeRO-3) are skipped: each rank rightly holds a different shard. A
    tensor that only some replicas hold (an expert slice: ``replica_mesh``) comes from the first rank
    of its own replicas instead.
    """
    tensors = [t for t in [*module.parameters(), *module.buffers()] if not hasattr(t, "device_mesh")]
    whole: list[Tensor] = []
    partial: dict[int, tuple[Any, list[Tensor]]] = {}  # id(mesh) -> (mesh, its tensors), in parameter order
    for t in {id(t): t for t in tensors}.values():
        mesh = replica_mesh_of(t)
        if mesh is None:
            whole.append(t)
        else:
            partial.setdefault(id(mesh), (mesh, []))[1].append(t)
    if dist.get_world_size(group) > 1:
        broadcast_tensors(whole, group, src, device)
    for mesh, members in partial.values():
        if mesh.size() > 1:
            owners = mesh.get_group()
            broadcast_tensors(members, owners, dist.get_global_rank(owners, 0), device)


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def share_cpu_threads(device: torch.device, local_processes: int) -> None:
    """On CPU, share the cores among the local ranks instead of oversubscribing them (unless the user
    set ``OMP_NUM_THREADS``)."""
    import os

    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_processes)))

