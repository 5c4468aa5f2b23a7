"""A mixture-of-experts MLP: route each token to k experts, compute them grouped, combine.

Dispatch is local (every expert on this rank) unless expert parallelism was applied
(moe/expert_parallel.py: rows travel to their expert's rank and back). Tokens are not dropped unless a capacity factor
is given (``capacity_factor``; Megatron's name), in which case each expert keeps at most
``ceil(factor * T * k / E)`` rows of each sequence of ``T`` tokens, those with the highest router
weights (Megatron's ``probs`` drop policy, applied per sequence rather than per micro-batch, so that
the drops are one process's at any data-parallel size or accumulation); a dropped row adds
nothing, so that token keeps only its residual (and the shared experts).

Auxiliary losses (``aux_loss`` after a training forward, None otherwise) are computed per sequence
(the sequence-wise balance loss of DeepSeek-V3, and the router z-loss of ST-MoE averaged over
tokens): a sequence's statistics do not depend on which micro-batch or replica it lands in, so the
loss is the same however the batch is split. The model adds them to its loss. Under context
parallelism (``sequence_group``: the ranks holding the other parts of each sequence) each rank
holds part of every sequence: the experts' token counts are summed over that group, so each rank's
balance term is ``sum_i f_i P_i_local`` with the whole sequence's ``f_i``, and the mean over the
group (the replicas' gradient average) is the sequence's loss.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_3d.core.eager import communicates
from lightning_3d.moe.expert_parallel import dispatch_to_experts
from lightning_3d.moe.experts import ExpertStack, GroupedExperts, capacity
from lightning_3d.moe.router import Routing, TopKRouter
from lightning_3d.tensor_parallel.mappings import (
    copy_to_tensor_parallel,
    gather_from_sequence_parallel,
    reduce_from_tensor_parallel,
    reduce_scatter_to_sequence_parallel,
)


class SharedExperts(nn.Module):
    """Experts every token goes through (DeepSeek-V3, Qwen2-MoE): one SwiGLU of ``n * hidden`` width."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Combine(torch.autograd.Function):
    """Each token's weighted rows summed into its output row (``index_add_``, deterministic on the CPU),
    keeping only the index for backward: autograd's own ``index_add_`` keeps a copy of its source (h values
    per routed row, for nothing), and an accumulating ``index_put_`` adds in a varying order on CPU threads."""

    @staticmethod
    def forward(ctx, rows: Tensor, index: Tensor, tokens: int) -> Tensor:  # noqa: ANN001 - autograd's context
        ctx.save_for_backward(index)
        return rows.new_zeros((tokens, rows.shape[-1])).index_add_(0, index, rows)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:  # noqa: ANN001
        (index,) = ctx.saved_tensors
        return grad.index_select(0, index), None, None


def _count(ids: Tensor, n: int) -> Tensor:
    """How many of ``ids`` equal each of ``0..n-1``, on their device without a host read
    (``torch.bincount`` reads the maximum back on CUDA)."""
    return torch.zeros(n, dtype=torch.long, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))


def sorted_rows(routing: Routing, n_experts: int, keep: Optional[int] = None, sequences: int = 1) -> tuple[Tensor, Tensor, Tensor]:
    """(token of each routed row, its weight, rows per expert), rows grouped by expert in token order.

    With ``keep``, each expert takes at most ``keep`` rows of each of the ``sequences`` (equal-length
    runs of tokens), those with the highest weights: which tokens a sequence drops then does not
    depend on the other sequences of its micro-batch, so not on how the batch is split."""
    k = routing.experts.shape[-1]
    experts = routing.experts.reshape(-1)
    weights = routing.weights.reshape(-1)
    if keep is None:
        order = torch.argsort(experts, stable=True)
    else:
        group = torch.div(torch.arange(experts.numel(), device=experts.device), experts.numel() // sequences, rounding_mode="floor")
        group = group * n_experts + experts  # (sequence, expert)
        by_weight = torch.argsort(weights, descending=True, stable=True)
        ranked = by_weight[torch.argsort(group[by_weight], stable=True)]  # by group, each by weight
        counts = _count(group, sequences * n_experts)
        starts = torch.cumsum(counts, 0) - counts
        position = torch.arange(ranked.numel(), device=ranked.device) - starts[group[ranked]]
        kept = torch.sort(ranked[position < keep]).values  # back in token order
        order = kept[torch.argsort(experts[kept], stable=True)]
    counts = _count(experts[order], n_experts)
    return order // k, weights[order], counts


def enter_tensor_parallel_share(x: Tensor, tp: Any, sequence_parallel: bool) -> Tensor:
    """The input of an MoE layer whose tp ranks each compute a share of the output from every token: whole
    (gathered over tp under sequence parallelism); its gradients, partial on each rank, are summed (reduce-
    scattered under SP) on the way back."""
    return gather_from_sequence_parallel(x, tp) if sequence_parallel else copy_to_tensor_parallel(x, tp)


def leave_tensor_parallel_share(out: Tensor, tp: Any, sequence_parallel: bool) -> Tensor:
    """The tp ranks' shares of an MoE layer's output summed (reduce-scattered to the sequence shards under SP)."""
    return reduce_scatter_to_sequence_parallel(out, tp) if sequence_parallel else reduce_from_tensor_parallel(out, tp)


class _ScaleGradient(torch.autograd.Function):
    """forward: identity; backward: the gradient times ``scale``."""

    @staticmethod
    def forward(ctx, x: Tensor, scale: float) -> Tensor:  # noqa: ANN001 - autograd's context
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # noqa: ANN001
        return grad * ctx.scale, None


def backpropagate_share(value: Tensor, tp: Any) -> Tensor:
    """``value`` (an auxiliary loss, router logits) that every tp rank computes alike from parameters whose
    gradients are summed over tp: each rank keeps all of its value and backpropagates ``1 / tp`` of it."""
    return _ScaleGradient.apply(value, 1.0 / dist.get_world_size(tp))


def tensor_parallel_share(token_of_row: Tensor, weight_of_row: Tensor, counts: Tensor, local: int, tp: Any) -> tuple[Tensor, Tensor, Tensor]:
    """The rows (sorted by expert) of the experts this tp rank's expert group holds, ``local`` of them
    per rank. The experts are split over ``ep x tp`` ranks (ep-major: expert block ``b`` lives on
    expert-group rank ``b // tp``, tp rank ``b % tp``); the other tp ranks take the rest. A
    data-dependent selection: one host read."""
    n_experts = counts.numel()
    tp_size, tp_rank = dist.get_world_size(tp), dist.get_rank(tp)
    owner = torch.arange(n_experts, device=counts.device) // local
    mine = owner % tp_size == tp_rank
    expert_of_row = torch.repeat_interleave(torch.arange(n_experts, device=counts.device), counts, output_size=token_of_row.numel())
    keep = mine[expert_of_row]
    return token_of_row[keep], weight_of_row[keep], counts[mine]


@communicates
def run_experts(
    tokens: Tensor, routing: Routing, n_experts: int, experts: ExpertStack, expert_group: Any = None, tp: Any = None,
    keep: Optional[int] = None, sequences: int = 1, combine_dtype: Optional[torch.dtype] = None,
) -> Tensor:
    """Every token's routed rows through their experts, weighted and summed per token (``(N, dim)``,
    in the experts' dtype -- autocast's, as a dense MLP's output would be -- or ``combine_dtype``).

    ``experts`` holds this rank's ``experts.n_experts`` of the layer's ``n_experts``;
    ``expert_group``: the ranks the rows travel to (expert parallelism); ``tp``: the tensor-parallel
    ranks that split the experts further (each computes its share of every token's output);
    ``keep``: the capacity per expert and sequence."""
    token_of_row, weight_of_row, counts = sorted_rows(routing, n_experts, keep, sequences)
    if tp is not None:
        token_of_row, weight_of_row, counts = tensor_parallel_share(token_of_row, weight_of_row, counts, experts.n_experts, tp)
    if expert_group is None:
        rows = experts(tokens[token_of_row], torch.cumsum(counts, 0).to(torch.int32))
    else:
        rows = dispatch_to_experts(tokens[token_of_row], counts, experts, expert_group)
    if combine_dtype is not None:  # (else in the experts' dtype)
        rows = rows.to(combine_dtype)
    return _Combine.apply(rows * weight_of_row.to(rows.dtype)[:, None], token_of_row, tokens.shape[0])


class MoE(nn.Module):
    """Router, routed experts and optional shared experts, as a drop-in for a block's MLP."""

    def __init__(
        self,
        dim: int,
        hidden: int,
        n_experts: int,
        top_k: int,
        n_shared_experts: int = 0,
        score: str = "softmax",
        normalize: bool = True,
        capacity_factor: Optional[float] = None,
        balance_coefficient: float = 0.01,
        z_loss_coefficient: float = 0.0,
    ) -> None:
        super().__init__()
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"capacity_factor={capacity_factor} must be positive (None: drop no token).")
        self.router = TopKRouter(dim, n_experts, top_k, score=score, normalize=normalize)
        self.experts = GroupedExperts(dim, hidden, n_experts)
        self.shared_experts = SharedExperts(dim, n_shared_experts * hidden) if n_shared_experts else None
        self.capacity_factor = capacity_factor
        self.balance_coefficient, self.z_loss_coefficient = balance_coefficient, z_loss_coefficient
        self.aux_loss: Optional[Tensor] = None
        self.expert_group: Optional[Any] = None  # set by expert parallelism (moe/expert_parallel.py)
        self.sequence_group: Optional[Any] = None  # set under context parallelism (bind_sequence_group)
        self.tp_group: Optional[Any] = None  # set under tensor parallelism (moe/expert_parallel.py)
        self.sequence_parallel = False  # under tensor parallelism: the input is this rank's sequence shard

    @property
    def n_experts(self) -> int:
        """Routed experts of the whole layer (this rank holds ``n_experts / ep`` of them)."""
        return self.router.n_experts

    @communicates
    def forward(self, x: Tensor) -> Tensor:
        tp = self.tp_group
        if tp is not None:  # each tp rank computes a share of every path below
            x = enter_tensor_parallel_share(x, tp, self.sequence_parallel)
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        routing = self.router(tokens)
        sequences = shape[0] if len(shape) == 3 else 1
        keep = None
        if self.capacity_factor is not None:
            keep = capacity(tokens.shape[0] // sequences, self.router.top_k, self.n_experts, self.capacity_factor)
        out = run_experts(tokens, routing, self.n_experts, self.experts, self.expert_group, tp, keep, sequences)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        out = out.view(shape)
        # (the auxiliary losses before the output's reduction: a recomputed forward, which stops once it has
        # rebuilt every saved tensor, then stops short of that collective, as a dense MLP's does)
        self.aux_loss = self._aux_loss(routing, sequences) if self.training and torch.is_grad_enabled() else None
        if self.aux_loss is not None and tp is not None:  # (the same on every tp rank; the router's gradients are summed)
            self.aux_loss = backpropagate_share(self.aux_loss, tp)
        if tp is not None:  # the tp ranks' shares: routed rows of their experts, their slice of the shared experts
            out = leave_tensor_parallel_share(out, tp, self.sequence_parallel)
        return out

    def _aux_loss(self, routing: Routing, sequences: int) -> Optional[Tensor]:
        """Balance loss per sequence, averaged over the sequences; z-loss averaged over the tokens."""
        terms = []
        if self.balance_coefficient:
            e, k = self.n_experts, self.router.top_k
            chosen = F.one_hot(routing.experts, e).sum(dim=1).float().view(sequences, -1, e)  # (S, T, E)
            scores = routing.scores / routing.scores.sum(dim=-1, keepdim=True)  # sigmoid scores normalised
            counts, tokens = chosen.sum(dim=1), chosen.shape[1]  # (no gradient: counts of choices)
            if self.sequence_group is not None:  # the whole sequences' counts (context parallelism)
                dist.all_reduce(counts, group=self.sequence_group)
                tokens *= dist.get_world_size(self.sequence_group)
            fraction = counts / tokens * (e / k)  # f_i per sequence: 1 when balanced
            probability = scores.view(sequences, -1, e).mean(dim=1)  # P_i per sequence
            terms.append(self.balance_coefficient * (fraction * probability).sum(dim=-1).mean())
        if self.z_loss_coefficient:
            terms.append(self.z_loss_coefficient * torch.logsumexp(routing.logits, dim=-1).square().mean())
        return sum(terms) if terms else None  # type: ignore[return-value]


def bind_sequence_group(module: nn.Module, group: Optional[Any]) -> int:
    """Tell every MoE layer in ``module`` which ranks hold the other parts of its sequences (context
    parallelism; ``None``: none). Returns how many layers. A capacity factor is refused there: which
    rows an expert keeps depends on the whole sequence's routing, which no rank has."""
    layers = [m for m in module.modules() if isinstance(m, MoE)]
    for layer in layers:
        if group is not None and layer.capacity_factor is not None:
            raise ValueError(
                f"context_parallel={dist.get_world_size(group)}: an MoE layer has capacity_factor={layer.capacity_factor}, "
                f"whose per-sequence drops need the whole sequence's routing on one rank; use capacity_factor=None "
                f"(dropless) or context_parallel=1."
            )
        layer.sequence_group = group
    return len(layers)


def take_aux_losses(module: nn.Module) -> Optional[Tensor]:
    """The auxiliary losses the MoE layers inside ``module`` produced in their last training forward,
    summed, each handed out once (None: none). Models add them to their loss; a pipeline stage
    adds its blocks' to the gradient it propagates (``LayerSequence.aux_loss``)."""
    total: Optional[Tensor] = None
    for layer in module.modules():
        if isinstance(layer, MoE) and layer.aux_loss is not None:
            total = layer.aux_loss if total is None else total + layer.aux_loss
            layer.aux_loss = None
    return total
