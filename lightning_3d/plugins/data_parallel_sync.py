"""What logging, metrics and Lightning's decisions reduce over: the data-parallel replicas.

tp, pp and cp peers hold copies of the same samples, so ``self.log(..., sync_dist=True)``, torchmetrics
and ``all_gather`` must reduce over data parallel only; decisions (early stopping, checkpointing) are
agreed by the whole world. A mixin of :class:`~lightning_3d.plugins.strategy.ThreeDParallelStrategy`.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies.strategy import TBroadcast
from torch import Tensor


def all_reduce_in_place(tensor: Tensor, group: Optional[Any], reduce_op: Optional[Union[ReduceOp, str]]) -> Tensor:
    """Lightning's ``_sync_ddp`` without its barrier: one all-reduce (a mean is a sum divided by the
    group's size, on every backend alike; ``None`` sums, as Lightning documents). The barrier before it synchronized nothing the all-reduce
    does not, and on NCCL it waits on the host for the device: under ``self.log(..., sync_dist=True)``
    it stalled every step's host between forward and backward (62 ms of a 0.30 s step on an H200,
    the GPU left without queued work while the host caught up)."""
    if not _distributed_is_initialized():
        return tensor
    group = dist.group.WORLD if group is None else group
    name = reduce_op.lower() if isinstance(reduce_op, str) else None
    mean = name in ("mean", "avg") or (reduce_op is not None and name is None and reduce_op == dist.ReduceOp.AVG)
    if mean or reduce_op is None:
        op = dist.ReduceOp.SUM
    elif name is not None:
        op = getattr(dist.ReduceOp, name.upper())
    else:
        op = reduce_op
    size = dist.get_world_size(group)
    narrow = mean and tensor.is_floating_point() and torch.finfo(tensor.dtype).bits < 32
    if narrow:  # fp16/bf16: divide first, so the sum cannot overflow where the mean would not (NCCL's AVG does so too)
        tensor.div_(size)
    dist.all_reduce(tensor, op=op, group=group)
    if not mean or narrow:
        return tensor
    return tensor.div_(size) if torch.is_floating_point(tensor) else tensor.copy_(tensor / size)


class DataParallelCollectives:
    """Lightning's collective hooks, over the data-parallel group (``_topology``, ``model`` and
    ``root_device`` are the strategy's)."""

    _topology: Any
    model: Any
    root_device: torch.device

    def _point_metrics_at_dp_group(self) -> None:
        """torchmetrics sync over the world by default; tp/pp/cp peers hold copies of the same samples
        (the step code sees whole sequences; only the model's forward splits them over cp)."""
        try:
            from torchmetrics import Metric
        except ImportError:  # pragma: no cover - torchmetrics is a dependency
            return
        assert self.model is not None
        for module in self.model.modules():
            if isinstance(module, Metric) and module.process_group is None:
                module.process_group = self.topology.sample_group

    def _default_group(self, group: Optional[Any], per_sample: bool = False) -> Optional[Any]:
        """dp x cp (every rank holding the same weights: a cp rank's training loss is its tokens'
        share, whose mean over dp x cp is the batch's), or dp alone for per-sample values (sums,
        gathers: cp peers hold copies of the same samples). At cp=1 both are the dp group."""
        if group is not None or self._topology is None:
            return group
        return self._topology.sample_group if per_sample else self._topology.dp_group

    def reduce(
        self, tensor: Union[Tensor, Any], group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean"
    ) -> Union[Tensor, Any]:
        """Reduce over the data-parallel group (tp and pp peers already agree); sums over dp only,
        means over dp x cp (see :meth:`_default_group`)."""
        if isinstance(tensor, Tensor):
            summed = reduce_op is None or str(reduce_op).lower().endswith("sum")  # "sum", ReduceOp.SUM, None (a sum)
            return all_reduce_in_place(tensor, self._default_group(group, per_sample=summed), reduce_op)
        return tensor

    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        """Gather from every data-parallel replica (one copy of each sample)."""
        return super().all_gather(tensor, group=self._default_group(group, per_sample=True), sync_grads=sync_grads)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Decisions (early stopping, checkpointing) are agreed by the whole world."""
        if not _distributed_is_initialized():
            return decision
        flag = torch.tensor(int(decision), device=self.root_device)
        dist.all_reduce(flag, op=dist.ReduceOp.SUM)
        return bool(flag == dist.get_world_size()) if all else bool(flag > 0)

    def barrier(self, name: Optional[str] = None) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]
