"""Small collective helpers shared by the strategy and the parallel layers."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn


def broadcast_tensors(tensors: Iterable[Tensor], group: dist.ProcessGroup, src: int) -> None:
    """Broadcast ``tensors`` in place from global rank ``src``, one flat message per (device, dtype)."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[Tensor]] = defaultdict(list)
    for t in tensors:
        by_kind[(t.device, t.dtype)].append(t)
    for kind in sorted(by_kind, key=str):  # same order on every rank
        members = by_kind[kind]
        flat = torch.cat([t.detach().reshape(-1) for t in members])
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        for t in members:
            t.data.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def broadcast_module_state(module: nn.Module, group: dist.ProcessGroup, src: int) -> None:
    """Make every replica in ``group`` start from ``src``'s parameters and buffers.

    DTensors (already sharded by ZeRO-3) are skipped: each rank rightly holds a different shard.
    """
    if dist.get_world_size(group) == 1:
        return
    tensors = [t for t in [*module.parameters(), *module.buffers()] if not hasattr(t, "device_mesh")]
    unique = list({id(t): t for t in tensors}.values())
    broadcast_tensors(unique, group, src)
