"""Is any value of these tensors inf or NaN? One answer as a device tensor, with no host sync.

Used by the precision plugin before every step and by ZeRO-2 offload while gradients still sit on
the device; kept here so that both ask the same question the same way.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor


def any_nonfinite(tensors: Iterable[Tensor], device: torch.device) -> Tensor:
    """1.0 if any element of ``tensors`` is inf or NaN, else 0.0: a 0-d float tensor on ``device``.

    On a GPU one fused max-abs per (device, dtype) group (inf and NaN survive it; squaring could
    overflow). In host memory each tensor's min and max instead: torch's CPU max-abs runs about 10x
    slower than its vectorized min/max (0.13 vs 0.012 s per 10^8 fp32 on 2 cores), and on a 1.28 B
    offloaded model it was a third of the step (0.38 s of 1.12 s on an H200's host)."""
    flag = torch.zeros((), device=device)
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for t in tensors:
        if t.numel():
            groups.setdefault((t.device, t.dtype), []).append(t.detach())
    for (where, _), group in groups.items():
        if where.type == "cpu":
            worst = torch.stack([bound for t in group for bound in torch.aminmax(t)])  # NaN and +-inf survive min/max
        else:
            worst = torch.stack(torch._foreach_norm(group, float("inf")))
        flag = torch.maximum(flag, (~torch.isfinite(worst)).any().float().to(device))
    return flag
