"""Activation checkpointing (recompute in backward instead of storing), applied from outside.

* ``"full"``: each selected transformer block keeps only its input; everything inside is
  recomputed during backward (about one block input per layer stays alive).
* ``"selective"`` (Korthikanti et al., 2022): only the attention core -- the softmax and
  attention-over-values part, whose activations grow with the square of the sequence but which
  costs few FLOPs -- is recomputed. Which module that is, is the model family's knowledge (its
  adapter's ``recompute_target``: the reference GPT's ``AttentionCore``); :func:`attention_of` is
  the default for others (the attention sublayer).

``every_n_layers=k`` checkpoints blocks 0, k, 2k, ... Recompute uses torch's non-reentrant
checkpoint; the tensor-parallel RNG tracker's states are replayed too, so dropout masks are
identical in the recomputed forward.

This module knows no model: :func:`lightning_3d.parallel.parallelize.apply_activation_checkpointing` finds
the models and their targets and calls :func:`checkpoint_blocks`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_3d.core.forward_wrappers import wrap_forward
from lightning_3d.pipeline.weight_gradients import checkpoint_contexts
from lightning_3d.tensor_parallel.random import Reenterable, RNGStatesTracker

MODES = ("full", "selective")


def attention_of(block: nn.Module) -> nn.Module:
    """The attention sublayer of a transformer block (``self_attn``, ``attn`` or ``attention``)."""
    for name in ("self_attn", "attn", "attention"):
        if isinstance(getattr(block, name, None), nn.Module):
            return getattr(block, name)
    raise ValueError(f"selective activation checkpointing found no attention in {type(block).__name__}.")


CHECKPOINTED = "activation_checkpointing"  # the forward wrapper that recomputes in backward


def check_mode(mode: str, every_n_layers: int) -> None:
    if mode not in MODES:
        raise ValueError(f"activation_checkpointing={mode!r}: choose one of {MODES}.")
    if every_n_layers < 1:
        raise ValueError(f"checkpoint_every_n_layers={every_n_layers} must be at least 1.")


def checkpoint_forward(module: nn.Module, tracker: Optional[RNGStatesTracker] = None) -> None:
    """Make ``module``'s forward store only its inputs and recompute the rest in backward."""
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def context_fn() -> tuple[Any, Any]:
            # the recompute sees the tensor-parallel RNG tracker, and a zero-bubble step's deferred linears, as forward did
            forward, recompute = checkpoint_contexts()
            if tracker is None:
                return forward, recompute
            tracked_forward, tracked_recompute = tracker.checkpoint_context()
            return Reenterable(lambda: _together(tracked_forward, forward)), Reenterable(lambda: _together(tracked_recompute, recompute))

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return original(*args, **kwargs)
            return checkpoint(original, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

        # inside a compiled block (selective recompute) the checkpoint runs as written, a graph break: Dynamo's own
        # checkpoint takes only dispatch-mode contexts and drops the RNG replay ours needs (what it calls runs eagerly)
        return torch.compiler.disable(forward, recursive=False)

    wrap_forward(module, CHECKPOINTED, make)


@contextmanager
def _together(*contexts: Any) -> Iterator[None]:
    """Several context managers entered as one."""
    with ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield


def checkpoint_blocks(
    blocks: Iterable[nn.Module],
    mode: str,
    every_n_layers: int = 1,
    tracker: Optional[RNGStatesTracker] = None,
    recompute_target: Callable[[nn.Module], nn.Module] = attention_of,
) -> int:
    """Checkpoint blocks 0, n, 2n, ... of one model: whole (``"full"``) or their ``recompute_target``
    (``"selective"``); returns how many."""
    check_mode(mode, every_n_layers)
    count = 0
    for i, block in enumerate(blocks):
        if i % every_n_layers == 0:
            checkpoint_forward(block if mode == "full" else recompute_target(block), tracker)
            count += 1
    return count
