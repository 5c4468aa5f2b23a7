"""Which optimizers may run on pieces of parameters, and the refusal for those that may not.

ZeRO 1-2 run the user's optimizer on this rank's slice of a flat buffer: a parameter can be cut
between two data-parallel ranks, and both see only a 1-D piece of it. Tensor parallelism hands
every optimizer a slice of each sharded matrix, and ZeRO-3 (FSDP2) hands it DTensor shards. That
is exact only for *element-wise* optimizers, whose update of an element depends on that element's
gradient and state alone (SGD, Adam, ...). Optimizers that look at whole matrices -- factored
second moments (Adafactor), orthogonalization (Muon), per-parameter trust ratios (LAMB, LARS) --
would silently compute something else on a piece, so the strategy refuses them before step 1
wherever they would see one, and names the layout where they are exact: ``zero_stage=0`` with
``tensor_parallel=1`` (with mixed precision the masters are then whole, parameter-shaped tensors).

A custom optimizer declares itself element-wise with a class or instance attribute
``elementwise = True``.
"""

from __future__ import annotations

from typing import Any

import torch

# Update of element i reads only element i's gradient and state (and per-parameter step counts).
ELEMENTWISE = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.ASGD,
)


def is_elementwise(optimizer: Any) -> bool:
    declared = getattr(optimizer, "elementwise", None)
    if declared is not None:
        return bool(declared)
    return type(optimizer) in ELEMENTWISE


def check_optimizer_layout(optimizer: Any, zero_stage: int, tensor_parallel: int, expert_parallel: int = 1) -> None:
    """Refuse a non-element-wise optimizer where it would see pieces of parameters."""
    if is_elementwise(optimizer):
        return
    where = []
    if zero_stage in (1, 2):
        where.append(f"zero_stage={zero_stage} steps flat slices that cut parameters between data-parallel ranks")
    if zero_stage == 3:
        where.append("zero_stage=3 shards every parameter over the data-parallel ranks")
    if tensor_parallel > 1:
        where.append(f"tensor_parallel={tensor_parallel} gives each rank a slice of every sharded matrix")
    if expert_parallel > 1:
        where.append(f"expert_parallel={expert_parallel} gives each rank a slice of every stack of experts")
    if not where:
        return
    name = type(optimizer).__name__
    raise ValueError(
        f"{name} is not an element-wise optimizer (it needs whole parameters), but {' and '.join(where)}: it would "
        f"compute a different update than on one process. Use zero_stage=0 with tensor_parallel=1 and expert_parallel=1 for {name} "
        f"(pipeline and data parallelism are fine; mixed precision keeps whole fp32 masters), or an element-wise "
        f"optimizer such as AdamW. If {name} is element-wise after all, set `elementwise = True` on it."
    )


# How an optimizer runs, not what it computes. Optimizers ZeRO builds choose these themselves (below);
# the per-step copy of the user's hyper-parameters must not carry them over (``fused=None`` would
# switch a chosen fused kernel off).
IMPLEMENTATION_KEYS = ("foreach", "fused", "capturable", "differentiable")


def prefer_fused_adam(optimizer: torch.optim.Optimizer, foreach_otherwise: bool = False) -> None:
    """Where the user left the choice to torch (``foreach=None`` and ``fused=None``), Adam and AdamW take
    torch's fused kernel: one pass over parameter, gradient and both moments instead of a dozen
    element-wise ops, on CPU and GPU, DTensors included (torchtitan's default as well). With
    ``foreach_otherwise``, other optimizers take the multi-tensor path. A choice the user made stays."""
    adam = type(optimizer) in (torch.optim.Adam, torch.optim.AdamW)
    for group in optimizer.param_groups:
        if group.get("foreach") is not None or group.get("fused") is not None or group.get("differentiable"):
            continue
        # (not on the meta device, where the dry run steps: the fused kernel refuses it)
        if adam and "fused" in group and all(p.is_floating_point() and not p.is_meta for p in group["params"]):
            group["fused"] = True
        elif foreach_otherwise and "foreach" in group:
            group["foreach"] = True
