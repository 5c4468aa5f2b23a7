"""Tensors every tensor-parallel rank holds whole are made identical across the tp group.

``parallelize`` calls this once after the plan is applied: replicated weights that drift apart
(a user who seeds per rank) would silently train different models on the tp ranks.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_3d.core.distributed import _local, broadcast_tensors
from lightning_3d.tensor_parallel.spec import get_spec


def broadcast_tensor_parallel_replicas(
    module: nn.Module, group: dist.ProcessGroup, src: int, device: Optional[torch.device] = None
) -> None:
    """Make the tensors every tensor-parallel rank holds whole (norms, position embeddings, row-parallel
    biases, buffers) identical to ``src``'s, as ``distribute_tensor(..., Replicate())`` would: a user who
    seeds per rank must not get replicas that drift apart. Tensor-parallel shards are left alone; under
    ZeRO-3 the local chunks are exchanged (tp peers chunk a replicated tensor alike)."""
    if dist.get_world_size(group) == 1:
        return
    def replicated(t: Tensor) -> bool:
        spec = get_spec(t)
        return spec is None or not spec.is_sharded

    tensors = [_local(t) for t in [*module.parameters(), *module.buffers()] if replicated(t)]
    broadcast_tensors(list({id(t): t for t in tensors}.values()), group, src, device)
