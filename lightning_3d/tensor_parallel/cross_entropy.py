"""Cross-entropy over vocabulary-sharded logits, without ever forming the full logits on a rank.

Forward needs two reductions over the tp group: the max logit (for a stable softmax), then one
summed message with the target's logit, the sum of exponentials and (for label smoothing) the
sum of logits. Backward is local: ``softmax - smoothed one-hot`` on this rank's columns.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: Tensor,
        target: Tensor,
        group: dist.ProcessGroup,
        ignore_index: int,
        label_smoothing: float,
        vocab_size: int,
    ) -> Tensor:
        local_vocab = logits.shape[-1]
        start = dist.get_rank(group) * local_vocab
        logits = logits.float()
        valid_columns = (vocab_size - start) if vocab_size < start + local_vocab else local_vocab
        valid_columns = max(0, min(local_vocab, valid_columns))

        masked = logits.narrow(-1, 0, valid_columns)
        local_max = masked.max(dim=-1).values if valid_columns else logits.new_full(logits.shape[:-1], -torch.inf)
        global_max = local_max.clone()
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)

        shifted = logits - global_max.unsqueeze(-1)
        if valid_columns < local_vocab:  # padded vocabulary columns never count
            shifted[..., valid_columns:] = -torch.inf
        exp = shifted.exp()

        ignored = target == ignore_index
        local_target = target - start
        owned = (local_target >= 0) & (local_target < valid_columns) & ~ignored
        index = local_target.masked_fill(~owned, 0).unsqueeze(-1)
        target_logit = shifted.gather(-1, index).squeeze(-1).masked_fill(~owned, 0.0)

        stats = [target_logit, exp.sum(-1)]
        if label_smoothing > 0:
            stats.append(shifted.narrow(-1, 0, valid_columns).sum(-1))
        stats_t = torch.stack(stats)
        dist.all_reduce(stats_t, group=group)
        log_sum_exp = stats_t[1].log()
        loss = log_sum_exp - stats_t[0]
        if label_smoothing > 0:
            mean_logit = stats_t[2] / vocab_size
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (log_sum_exp - mean_logit)
        loss = loss.masked_fill(ignored, 0.0)
        count = (~ignored).sum().clamp(min=1)

        softmax = exp.div_(stats_t[1].unsqueeze(-1))
        ctx.save_for_backward(softmax, index.squeeze(-1), owned, ignored, count)
        ctx.label_smoothing, ctx.vocab_size, ctx.valid_columns = label_smoothing, vocab_size, valid_columns
        return loss.sum() / count

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Optional[Tensor], ...]:
        softmax, index, owned, ignored, count = ctx.saved_tensors
        eps = ctx.label_smoothing
        grad = softmax  # reuse: d loss / d logits = softmax - (1 - eps) * onehot - eps / V
        flat = grad.view(-1, grad.shape[-1])
        rows = torch.arange(flat.shape[0], device=grad.device)
        flat[rows, index.view(-1)] -= (1.0 - eps) * owned.view(-1).to(grad.dtype)
        if eps > 0:
            grad[..., : ctx.valid_columns] -= eps / ctx.vocab_size
        grad.masked_fill_(ignored.unsqueeze(-1), 0.0)
        grad.mul_(grad_output / count)
        return grad, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: Tensor,
    target: Tensor,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    tp_group: Optional[dist.ProcessGroup] = None,
    vocab_size: Optional[int] = None,
) -> Tensor:
    """Mean cross-entropy of ``target`` under logits split along the last dim over ``tp_group``.

    Matches ``F.cross_entropy(full_logits, target, ignore_index=..., label_smoothing=...)``.
    ``vocab_size`` is the true vocabulary when the sharded logits carry padding columns.
    """
    from lightning_3d.tensor_parallel.layers import resolve_tp_group

    group = resolve_tp_group(tp_group)
    world = dist.get_world_size(group)
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1).")
    vocab = vocab_size if vocab_size is not None else logits.shape[-1] * world
    return _VocabParallelCrossEntropy.apply(logits, target, group, ignore_index, label_smoothing, vocab)


class CausalLMLoss:
    """Drop-in for Hugging Face's ``model.loss_function`` with vocabulary-sharded logits.

    Shifts labels like ``transformers``' ``ForCausalLMLoss`` and honours ``num_items_in_batch``.
    """

    def __init__(self, tp_group: dist.ProcessGroup, vocab_size: int) -> None:
        self.tp_group, self.vocab_size = tp_group, vocab_size

    def __call__(
        self,
        logits: Tensor,
        labels: Tensor,
        vocab_size: Optional[int] = None,
        num_items_in_batch: Optional[Tensor] = None,
        ignore_index: int = -100,
        shift_labels: Optional[Tensor] = None,
        **kwargs: Any,
    ) -> Tensor:
        if shift_labels is None:
            labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
            shift_labels = labels[..., 1:]
        flat_logits = logits.reshape(-1, logits.shape[-1])
        flat_labels = shift_labels.reshape(-1).to(logits.device)
        loss = vocab_parallel_cross_entropy(
            flat_logits, flat_labels, ignore_index=ignore_index, tp_group=self.tp_group, vocab_size=self.vocab_size
        )
        if num_items_in_batch is not None:
            counted = (flat_labels != ignore_index).sum()
            loss = loss * counted / num_items_in_batch
        return loss
