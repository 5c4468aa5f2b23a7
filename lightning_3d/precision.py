"""``ThreeDPrecision``: the precision plugin the strategy installs.

Today it provides ``"32-true"`` and ``"bf16-mixed"`` (autocast) and, for every mode, gradient
clipping by the *global* norm: each parameter is counted exactly once across tensor-parallel
shards (sharded parameters contribute their slice, replicated ones are counted on tp rank 0
only) and the squares are summed over the tp group. Lightning's default would clip each rank
by its local norm, which differs between layouts.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable
from contextlib import contextmanager, nullcontext
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor
from torch.optim import Optimizer

from lightning_3d.tensor_parallel.spec import get_spec
from lightning_3d.topology import Topology

SUPPORTED = ("32-true", "bf16-mixed")
LATER = ("16-mixed", "bf16-true")


def global_grad_norm(parameters: Iterable[Tensor], topology: Optional[Topology], norm_type: float = 2.0) -> Tensor:
    """Norm of all gradients of the (sharded) model, counting every parameter once."""
    unique = list({id(p): p for p in parameters if p.grad is not None}.values())
    device = unique[0].grad.device if unique else torch.device("cpu")
    tp_rank = topology.tp_rank if topology is not None else 0
    sharded: list[Tensor] = []
    replicated: list[Tensor] = []
    for p in unique:
        spec = get_spec(p)
        (sharded if spec is not None and spec.is_sharded else replicated).append(p.grad.detach())
    if tp_rank != 0:
        replicated = []  # identical on every tp rank: rank 0 counts them
    parts = sharded + replicated
    if norm_type == float("inf"):
        total = torch.stack([g.abs().max().float() for g in parts]).max() if parts else torch.zeros((), device=device)
        op = dist.ReduceOp.MAX
    else:
        total = sum((g.float().norm(norm_type) ** norm_type for g in parts), torch.zeros((), device=device))
        op = dist.ReduceOp.SUM
    if topology is not None and topology.dims.tp > 1:
        dist.all_reduce(total, op=op, group=topology.tp_group)
    return total if norm_type == float("inf") else total ** (1.0 / norm_type)


class ThreeDPrecision(Precision):
    """Precision plugin for ``ThreeDParallelStrategy`` (installed automatically)."""

    def __init__(self, precision: str = "32-true") -> None:
        if precision in LATER:
            raise NotImplementedError(
                f"precision={precision!r} with the 3d strategy needs the ZeRO/ThreeDPrecision milestone; "
                f"use one of {SUPPORTED} for now."
            )
        if precision not in SUPPORTED:
            raise ValueError(f"precision={precision!r} is not supported by ThreeDPrecision; choose one of {SUPPORTED}.")
        self.precision = precision
        self.topology: Optional[Topology] = None
        self.device_type = "cpu"

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        ctx = torch.autocast(self.device_type, dtype=torch.bfloat16) if self.precision == "bf16-mixed" else nullcontext()
        with ctx:
            yield

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        norm = global_grad_norm(params, self.topology)
        scale = (clip_val / (norm + 1e-6)).clamp(max=1.0)
        for p in {id(p): p for p in params if p.grad is not None}.values():
            p.grad.detach().mul_(scale.to(p.grad.device))

    def state_dict(self) -> dict[str, Any]:
        return {"precision": self.precision}


def adopt_precision(plugin: Optional[Precision], tensor_parallel: int) -> Optional[Precision]:
    """Swap Lightning's plugin for ``Trainer(precision=...)`` for ours where ours covers the mode.

    Other plugins (``"16-mixed"``, ``"bf16-true"``, ...) are kept with data parallel only; with
    tensor parallelism they would clip by a per-rank norm, so they are refused.
    """
    from lightning.pytorch.plugins.precision import MixedPrecision

    if plugin is None or isinstance(plugin, ThreeDPrecision):
        return plugin
    if type(plugin) is Precision:
        return ThreeDPrecision("32-true")
    if isinstance(plugin, MixedPrecision) and plugin.precision == "bf16-mixed":
        return ThreeDPrecision("bf16-mixed")
    if tensor_parallel > 1:
        name = getattr(plugin, "precision", type(plugin).__name__)
        raise NotImplementedError(
            f"precision={name!r} with tensor_parallel={tensor_parallel} needs the ZeRO/ThreeDPrecision milestone; "
            f"use precision='32-true' or 'bf16-mixed'."
        )
    return plugin
