"""Context parallelism applied from outside: each cp rank keeps its chunks of every sequence.

A forward meets three pieces, installed by ``parallelize.apply_context_parallel``:

1. The model's ``forward`` is wrapped (outermost, around the loss normalization and the pipeline
   runtime): every tensor argument whose dim 1 is the sequence length of the first tensor
   argument (token ids, targets, masks) is cut to this rank's load-balanced chunks
   (:func:`~lightning_3d.context_parallel.layout.shard_sequence`). Every cp rank loads the same
   batch (the sampler splits samples over dp only), so no data moves.
2. The model family's adapter (``ModelAdapter.context_parallel``) points the model's seams at
   :class:`ContextParallel`: the true positions of the local tokens (RoPE, learned positions) and
   attention over the whole sequence (ring or all-to-all over the cp group).
3. Outputs. A training loss stays this rank's mean over its tokens: the loss normalization
   (:mod:`lightning_3d.transforms.loss_normalization`) rescales it over dp x cp by target counts, so the
   average the gradient reduction computes is the batch's token mean. An evaluation loss is
   combined here into the mean over the whole sequences (one all-reduce of sum and count); logits
   are gathered back to the full sequence in natural order (the gather's backward sums each rank's
   gradient for the tokens it holds, so a loss computed outside the model on full logits trains
   correctly too; passing targets to the model keeps the LM head's memory divided by cp).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_3d.context_parallel.layout import check_divisible, local_positions, shard_sequence, unshard_sequence
from lightning_3d.context_parallel.ring import ring_attention
from lightning_3d.context_parallel.ulysses import all_to_all_attention
from lightning_3d.core.forward_wrappers import unwrap_forward, wrap_forward, wrapper
from lightning_3d.core.layout_rules import CONTEXT_PARALLEL_MODES
from lightning_3d.pipeline.sequences import LayerSequence
from lightning_3d.tensor_parallel.mappings import gather_along, reduce_scatter_along

@dataclass(frozen=True)
class ContextParallel:
    """This rank's place in its cp group and the attention mode: what a model's seams call.

    ``split_after``: how many ways the local tokens are split again after context parallelism
    (tensor_parallel under sequence parallelism), only for the length check.
    """

    group: Any
    size: int
    rank: int
    mode: str = "ring"
    split_after: int = 1

    def __post_init__(self) -> None:
        if self.mode not in CONTEXT_PARALLEL_MODES:
            raise ValueError(f"context_parallel_mode={self.mode!r} is unknown: choose one of {CONTEXT_PARALLEL_MODES}.")

    def positions(self, t: int, device: torch.device) -> Tensor:
        """True positions of the ``t`` local tokens (this rank's two chunks of a ``t * size`` sequence)."""
        return local_positions(t * self.size, self.rank, self.size, device)

    def attention(
        self, q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0, *,
        scale: Optional[float] = None, window: Optional[int] = None, softcap: Optional[float] = None,
    ) -> Tensor:
        """Causal attention of the local queries over the whole sequence's keys (``AttentionCore.attend``,
        the HF attention function). ``window``: a sliding window shorter than the sequence;
        ``softcap``: soft-capped scores. Both only ``"all_to_all"`` computes (each rank holds whole
        sequences of its heads there); the ring refuses them by name."""
        if dropout_p:
            raise ValueError(
                f"context-parallel attention has no dropout (got dropout_p={dropout_p}); set the model's attention "
                f"dropout to 0 or use context_parallel=1."
            )
        if self.mode == "ring":
            if window is not None or softcap is not None:
                what = f"a sliding window of {window} tokens" if window is not None else f"soft-capped scores (softcap={softcap})"
                raise ValueError(
                    f"context_parallel_mode='ring' cannot compute attention with {what}: its blocks are causal or full. "
                    f"Use context_parallel_mode='all_to_all' (each rank attends over whole sequences of its heads), or "
                    f"context_parallel=1."
                )
            return ring_attention(q, k, v, self.group, scale)
        return all_to_all_attention(q, k, v, self.group, scale, window=window, softcap=softcap)

    def check_length(self, length: int) -> None:
        """Refuse, naming the values, a sequence the layout cannot cut (before anything runs on it)."""
        check_divisible(length, self.size)
        local = length // self.size
        if local % self.split_after:
            raise ValueError(
                f"sequence length {length} leaves {local} tokens per context-parallel rank (context_parallel="
                f"{self.size}), which sequence parallel cannot split over tensor_parallel={self.split_after}; use a "
                f"sequence length divisible by {math.lcm(2 * self.size, self.size * self.split_after)}."
            )

    def shard(self, x: Tensor) -> Tensor:
        """This rank's chunks of ``x`` along dim 1."""
        return shard_sequence(x, 1, self.rank, self.size)

    def gather(self, x: Tensor) -> Tensor:
        """The full sequence along dim 1 from every rank's local part (autograd: reduce-scatter back)."""
        return _GatherSequence.apply(x, self)


class _GatherSequence(torch.autograd.Function):
    """All-gather of the local parts along dim 1, reordered to natural order. Backward: every rank's
    gradient for the full sequence, reduced (summed) onto the rank holding each token."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, cp: ContextParallel) -> Tensor:
        ctx.cp = cp
        by_rank = gather_along(x, 1, cp.group)  # the local parts side by side, in cp-rank order
        return unshard_sequence(list(by_rank.chunk(cp.size, dim=1)), 1, cp.size)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        cp: ContextParallel = ctx.cp
        by_rank = torch.cat([shard_sequence(grad, 1, r, cp.size) for r in range(cp.size)], dim=1)
        return reduce_scatter_along(by_rank, 1, cp.group), None


def _sequence_length(args: tuple, kwargs: dict) -> Optional[int]:
    for value in (*args, *kwargs.values()):
        if isinstance(value, Tensor) and value.dim() >= 2:
            return int(value.shape[1])
    return None


def _combined_eval_loss(loss: Tensor, count: int, cp: ContextParallel) -> Tensor:
    """The mean over the whole sequences from each rank's mean over its tokens (weights: target counts)."""
    stats = torch.stack([loss.detach().float().nan_to_num(0.0) * count, torch.tensor(float(count), device=loss.device)])
    dist.all_reduce(stats, group=cp.group)
    return (stats[0] / stats[1].clamp(min=1.0)).to(loss.dtype)


CONTEXT_PARALLEL = "context_parallel"  # the forward wrapper that splits inputs over cp


def shard_inputs(model: nn.Module, sequence: LayerSequence, cp: ContextParallel) -> None:
    """Wrap ``model.forward``: sequence-shaped inputs -> local chunks; outputs as the module docstring
    says. Applied last, over whatever ``forward`` is then (loss normalization, pipeline runtime); a
    wrapper from an earlier set-up must be removed first (:func:`unshard_inputs`)."""
    if wrapper(model, CONTEXT_PARALLEL) is not None:
        raise RuntimeError("shard_inputs: the model's forward is already split for context parallelism.")
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            if sequence.before_split is not None:  # what must be computed on whole sequences (labels' shift, positions)
                args, kwargs = sequence.before_split(args, dict(kwargs))
            length = _sequence_length(args, kwargs)
            if length is None:
                return original(*args, **kwargs)
            cp.check_length(length)

            def local(value: Any) -> Any:
                return cp.shard(value) if isinstance(value, Tensor) and value.dim() >= 2 and value.shape[1] == length else value

            args = tuple(local(a) for a in args)
            kwargs = {k: local(v) for k, v in kwargs.items()}
            out = original(*args, **kwargs)
            loss = sequence.loss_of(out)
            if loss is not None:
                if torch.is_grad_enabled():
                    return out  # training: rescaled over dp x cp by the loss normalization inside
                count = int(sequence.target_count((sequence.loss_inputs or sequence.inputs)(args, kwargs)))
                return sequence.with_loss(out, _combined_eval_loss(loss, count, cp))
            if isinstance(out, Tensor) and out.dim() >= 2 and out.shape[1] == length // cp.size:
                return cp.gather(out)
            logits = getattr(out, "logits", None)  # a Hugging Face output without labels
            if isinstance(logits, Tensor) and logits.dim() >= 2 and logits.shape[1] == length // cp.size:
                out.logits = cp.gather(logits)
            return out

        return forward

    wrap_forward(model, CONTEXT_PARALLEL, make, state=cp)


def unshard_inputs(model: nn.Module) -> bool:
    """Undo :func:`shard_inputs` on ``model`` (``False`` if it was not split)."""
    return unwrap_forward(model, CONTEXT_PARALLEL)
