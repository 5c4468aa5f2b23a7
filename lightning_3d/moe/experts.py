"""The experts of a mixture-of-experts layer as three stacked weights, computed by grouped GEMM.

Each expert is a SwiGLU MLP (``down(silu(gate(x)) * up(x))``, as Mixtral, Qwen3-MoE, OLMoE and
DeepSeek-V3 use). Stacking them as ``(E, in, out)`` tensors lets one grouped matrix multiply serve
every expert's rows at once (``torch._grouped_mm``; a loop over experts where it is missing), and is
the layout expert parallelism splits along dim 0 and tensor parallelism along the hidden dim.
"""

from __future__ import annotations

import math
from typing import Optional, Protocol

import torch
from torch import Tensor, nn
from torch.nn import functional as F


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a dense gradient: ``torch._grouped_mm``'s backward refuses the
    expanded (stride 0) gradient a ``.sum()`` produces."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:  # noqa: ANN001 - autograd's context
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # noqa: ANN001
        return grad.contiguous()


def _grouped_mm_available(x: Tensor, weight: Tensor) -> bool:
    """torch 2.13's kernel: fp32 / bf16 on CPU or CUDA (and its shapes on meta, for the dry run), rows of whole 16-byte multiples."""
    aligned = all(n * x.element_size() % 16 == 0 for n in (x.shape[-1], weight.shape[-1]))
    return hasattr(torch, "_grouped_mm") and x.dtype in (torch.float32, torch.bfloat16) and x.device.type in ("cpu", "cuda", "meta") and aligned


def grouped_mm(x: Tensor, weight: Tensor, offsets: Tensor, counts: Optional[list[int]] = None) -> Tensor:
    """Rows ``offsets[e-1]:offsets[e]`` of ``x`` (``(M, in)``) times ``weight[e]`` (``(E, in, out)``).

    ``offsets``: the int32 cumulative row counts, on ``x``'s device. ``counts``: the same on the host,
    needed only by the loop that stands in where grouped GEMM is missing. Under autocast both run in
    its dtype, as a ``Linear`` would (``torch._grouped_mm`` has no autocast rule of its own)."""
    if x.device.type != "meta" and torch.is_autocast_enabled(x.device.type):  # (meta: the dry run, no autocast)
        dtype = torch.get_autocast_dtype(x.device.type)
        x, weight = x.to(dtype), weight.to(dtype)
    if _grouped_mm_available(x, weight):
        return _ContiguousGrad.apply(torch._grouped_mm(x, weight.to(x.dtype), offs=offsets))
    if counts is None:
        counts = torch.diff(offsets, prepend=offsets.new_zeros(1)).tolist()  # a host read: the fallback only
    return torch.cat([rows @ w.to(x.dtype) for rows, w in zip(torch.split(x, counts), weight.unbind(0))], dim=0)


class ExpertStack(Protocol):
    """What dispatch needs of a rank's experts: how many it holds, and their rows' outputs (rows sorted
    by expert, ``offsets``: where each expert's rows end). ``GroupedExperts`` is one; a Hugging Face
    family's stacked experts are another (``models/adapters/hf_moe.py``)."""

    n_experts: int

    def __call__(self, x: Tensor, offsets: Tensor, counts: Optional[list[int]] = None) -> Tensor: ...


class GroupedExperts(nn.Module):
    """``n_experts`` SwiGLU experts of width ``hidden`` (``gate_proj``, ``up_proj``: ``(E, dim, hidden)``;
    ``down_proj``: ``(E, hidden, dim)``)."""

    def __init__(self, dim: int, hidden: int, n_experts: int) -> None:
        super().__init__()
        self.n_experts = n_experts
        self.gate_proj = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.up_proj = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.down_proj = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02, down_std: Optional[float] = None) -> None:
        for weight in (self.gate_proj, self.up_proj):
            nn.init.normal_(weight, std=std)
        nn.init.normal_(self.down_proj, std=std if down_std is None else down_std)

    def forward(self, x: Tensor, offsets: Tensor, counts: Optional[list[int]] = None) -> Tensor:
        """``x``: the routed rows sorted by expert; ``offsets``: where each expert's rows end."""
        hidden = F.silu(grouped_mm(x, self.gate_proj, offsets, counts)) * grouped_mm(x, self.up_proj, offsets, counts)
        return grouped_mm(hidden, self.down_proj, offsets, counts)


def capacity(tokens: int, top_k: int, n_experts: int, factor: float) -> int:
    """Megatron's per-expert capacity: ``ceil(factor * tokens * k / E)`` rows."""
    return math.ceil(factor * tokens * top_k / n_experts)
