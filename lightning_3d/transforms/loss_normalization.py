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

The count's all-reduce is one scalar per forward; it is a device tensor (NCCL-safe). A model whose
``target_count`` returns a device tensor (ours and the Hugging Face adapters do) is counted, reduced
and rescaled without a host read: on a GPU, ``int(count)`` would make every training forward wait
for the device before the host could queue the backward.

A loss that includes auxiliary terms averaged over sequences rather than targets (an MoE layer's
balance and z-losses; the model says which part: ``LayerSequence.aux_in_loss``) has that part
rescaled by the sequences' factor instead (``local sequences * dp / global sequences``, from the
same all-reduce): with masked targets spread unevenly, the target factor would weigh it by targets.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_3d.core.forward_wrappers import wrap_forward
from lightning_3d.pipeline.sequences import LayerSequence


Count = Union[int, Tensor]  # a host int, or a 0-dim integer tensor on the device (read nowhere)


def data_parallel_factor(local: Count, group: dist.ProcessGroup, device: torch.device) -> Tensor:
    """``local * dp / global``: turns a replica's mean into its share of the batch mean (1 when balanced)."""
    return data_parallel_factors([local], group, device)[0]


def data_parallel_factors(counts: list[Count], group: dist.ProcessGroup, device: torch.device) -> Tensor:
    """:func:`data_parallel_factor` of several counts at once (one all-reduce of ``len(counts)`` values).
    Host ints become device values by a fill, not a copy from pageable memory (which would wait for
    the stream); the sum is exact in int64, the factor float32 as the loss math expects."""
    local = torch.stack([on_device(c, device) for c in counts])
    total = local.clone()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return local.float() * dist.get_world_size(group) / total.float().clamp(min=1.0)


def on_device(count: Count, device: torch.device) -> Tensor:
    """``count`` as a 0-dim int64 tensor on ``device`` (a model's count may sit elsewhere, e.g. a
    user's count of host-side labels: NCCL takes device tensors only)."""
    if isinstance(count, Tensor):
        return count.to(device=device, dtype=torch.int64, non_blocking=True).reshape(())
    return torch.full((), int(count), dtype=torch.int64, device=device)


def zero_without_targets(mean: Tensor, count: Tensor) -> Tensor:
    """A replica whose targets are all masked has mean 0/0; its share of the batch is zero (decided
    on the device: no host read)."""
    return torch.where(count > 0, mean, mean.nan_to_num(0.0))


def batch_size(inputs: dict[str, Any]) -> int:
    """Sequences in a batch of named inputs: the first tensor's first dimension."""
    return next(int(v.shape[0]) for v in inputs.values() if isinstance(v, Tensor) and v.dim())


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
            inputs = (sequence.loss_inputs or sequence.inputs)(args, kwargs)
            count = on_device(sequence.target_count(inputs), loss.device)
            aux = sequence.aux_in_loss(out) if sequence.aux_in_loss is not None else None
            if aux is None:
                factor = data_parallel_factor(count, group, loss.device).to(loss.dtype)
                main = loss
            else:  # the auxiliary part is a mean over sequences: weighed by sequences
                factor, per_sequence = data_parallel_factors([count, batch_size(inputs)], group, loss.device).to(loss.dtype)
                main = loss - aux
            main = zero_without_targets(main, count)
            scaled = main * factor if aux is None else main * factor + aux * per_sequence
            return sequence.with_loss(out, scaled)

        return forward

    wrap_forward(model, "loss_normalization", make)
