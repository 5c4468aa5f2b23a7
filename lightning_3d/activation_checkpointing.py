"""Activation checkpointing (recompute in backward instead of storing), applied from outside.

* ``"full"``: each selected transformer block keeps only its input; everything inside is
  recomputed during backward (about one block input per layer stays alive).
* ``"selective"`` (Korthikanti et al., 2022): only the attention core -- the softmax and
  attention-over-values part, whose activations grow with the square of the sequence but which
  costs few FLOPs -- is recomputed. The reference GPT exposes it as ``AttentionCore``; for models
  without one (Hugging Face), the attention sublayer is recomputed.

``every_n_layers=k`` checkpoints blocks 0, k, 2k, ... Recompute uses torch's non-reentrant
checkpoint; the tensor-parallel RNG tracker's states are replayed too, so dropout masks are
identical in the recomputed forward.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_3d.pipeline.sequences import find_sequences
from lightning_3d.tensor_parallel.random import RNGStatesTracker

MODES = ("full", "selective")


def _selective_target(block: nn.Module) -> nn.Module:
    from lightning_3d.models.gpt import AttentionCore

    for module in block.modules():
        if isinstance(module, AttentionCore):
            return module
    for name in ("self_attn", "attn", "attention"):
        if isinstance(getattr(block, name, None), nn.Module):
            return getattr(block, name)
    raise ValueError(f"selective activation checkpointing found no attention in {type(block).__name__}.")


def checkpoint_forward(module: nn.Module, tracker: Optional[RNGStatesTracker] = None) -> None:
    """Make ``module``'s forward store only its inputs and recompute the rest in backward."""
    if getattr(module, "_activation_checkpointed", False):
        return
    original = module.forward
    context_fn = tracker.checkpoint_context if tracker is not None else None

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        extra = {"context_fn": context_fn} if context_fn is not None else {}
        return checkpoint(original, *args, use_reentrant=False, **extra, **kwargs)

    module.forward = forward  # type: ignore[method-assign]
    module._activation_checkpointed = True  # type: ignore[attr-defined]


def apply_activation_checkpointing(
    root: nn.Module, mode: str, every_n_layers: int = 1, tracker: Optional[RNGStatesTracker] = None
) -> int:
    """Checkpoint the blocks of every model with a layer sequence inside ``root``; returns how many."""
    if mode not in MODES:
        raise ValueError(f"activation_checkpointing={mode!r}: choose one of {MODES}.")
    if every_n_layers < 1:
        raise ValueError(f"checkpoint_every_n_layers={every_n_layers} must be at least 1.")
    found = find_sequences(root)
    if not found:
        raise ValueError(
            f"activation_checkpointing={mode!r} found no model with a layer sequence in {type(root).__name__} "
            f"(GPT, LlamaForCausalLM, GPT2LMHeadModel, or a model with pipeline_sequence())."
        )
    count = 0
    for _, _, sequence in found:
        for i, block in enumerate(sequence.blocks):
            if i % every_n_layers == 0:
                checkpoint_forward(block if mode == "full" else _selective_target(block), tracker)
                count += 1
    return count
