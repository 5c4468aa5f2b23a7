"""Average the loss over the batch's targets, not over the data-parallel replicas' means.

One process averages a language-model loss over every target of the batch that is not masked
(``ignore_index``). Data parallelism splits the batch: when replicas hold different numbers of
unmasked targets (padding, prompt masking), averaging each replica's mean -- what DDP does, and
what the gradient reduction does -- weighs a replica's targets by ``1 / its count`` instead of
``1 / the batch's count``, a different loss and different gradients.

For models with a layer sequence (the reference GPT, HF Llama / GPT-2, or any model with
``pipeline_sequence()``), the strategy rescales each replica's training loss by
``local count * dp / global count``: the mean of the rescaled losses over the replicas -- what the
gradient all-reduce and ``self.log(..., sync_dist=True)`` compute -- is exactly the batch mean.
With balanced counts the factor is exactly 1. The pipeline runtime applies the same factor to its
micro-batch weights. Evaluation keeps per-replica means (no extra collective outside training).

The count's all-reduce is one scalar per forward; it is a device tensor (NCCL-safe).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_3d.core.forward_wrappers import wrap_forward
from lightning_3d.pipeline.sequences import LayerSequence


def global_count(local: int, group: dist.ProcessGroup, device: torch.device) -> Tensor:
    """Sum of ``local`` over ``group`` (a float tensor on ``device``)."""
    total = torch.tensor(float(local), device=device)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return total


def data_parallel_factor(local: int, group: dist.ProcessGroup, device: torch.device) -> Tensor:
    """``local * dp / global``: turns a replica's mean into its share of the batch mean (1 when balanced)."""
    total = global_count(local, group, device)
    return (local * dist.get_world_size(group)) / total.clamp(min=1.0)


def normalize_over_data_parallel(model: nn.Module, sequence: LayerSequence, group: dist.ProcessGroup) -> None:
    """Rescale ``model``'s training loss so the replicas' average is the batch's target mean (idempotent)."""
    if dist.get_world_size(group) == 1:
        return

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            loss = sequence.loss_of(out)
            if loss is None or not (model.training and torch.is_grad_enabled()):
                return out
            count = sequence.target_count((sequence.loss_inputs or sequence.inputs)(args, kwargs))
            factor = data_parallel_factor(count, group, loss.device).to(loss.dtype)
            if count == 0:  # this replica's targets are all masked: its mean is 0/0, its share is zero
                return sequence.with_loss(out, loss.nan_to_num(0.0) * factor)
            return sequence.with_loss(out, loss * factor)

        return forward

    wrap_forward(model, "loss_normalization", make)
