"""The top-k router of a mixture-of-experts layer.

Scores are a softmax over the experts (Mixtral, Qwen3-MoE, OLMoE) or independent sigmoids
(DeepSeek-V3). The k chosen experts' weights are renormalised to sum to one when asked
(``normalize``: Qwen3-MoE's ``norm_topk_prob``; always for sigmoid scores, as DeepSeek-V3 does;
``normalize=False`` with softmax keeps the raw probability, as Switch's top-1 does),
then multiplied by ``scale`` (DeepSeek-V3's ``routed_scaling_factor``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

SCORES = ("softmax", "sigmoid")


@dataclass(frozen=True)
class Routing:
    """What the router decided for ``N`` tokens."""

    weights: Tensor  # (N, k): each chosen expert's weight, in the compute dtype of the scores
    experts: Tensor  # (N, k) int64: the chosen experts
    scores: Tensor  # (N, E) fp32: every expert's score (the balance loss's P)
    logits: Tensor  # (N, E) fp32: the gate's output (the z-loss)


class TopKRouter(nn.Module):
    """``gate``: a bias-free linear map to one logit per expert (its weight is the router's only
    parameter; the key Hugging Face calls ``mlp.gate.weight``)."""

    def __init__(self, dim: int, n_experts: int, top_k: int, score: str = "softmax", normalize: bool = True, scale: float = 1.0) -> None:
        super().__init__()
        if score not in SCORES:
            raise ValueError(f"router score={score!r} is not one of {SCORES}.")
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and n_experts={n_experts}.")
        self.n_experts, self.top_k, self.score, self.scale = n_experts, top_k, score, scale
        self.normalize = normalize or score == "sigmoid"
        self.gate = nn.Linear(dim, n_experts, bias=False)

    def forward(self, x: Tensor) -> Routing:
        logits = self.gate(x).float()  # routing decisions in fp32: bf16 ties flip experts between layouts
        scores = torch.softmax(logits, dim=-1) if self.score == "softmax" else torch.sigmoid(logits)
        weights, experts = torch.topk(scores, self.top_k, dim=-1, sorted=False)
        if self.normalize:  # (at top_k=1 the weight is then 1: the router learns from the auxiliary losses alone)
            weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=1e-20)
        if self.scale != 1.0:
            weights = weights * self.scale
        return Routing(weights=weights, experts=experts, scores=scores, logits=logits)
