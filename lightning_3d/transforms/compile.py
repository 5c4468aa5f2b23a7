"""Regional ``torch.compile``: each transformer block compiled on its own, after the layout is applied.

What a user of torchtitan expects from ``compile``, and why per block rather than the whole model:

* the blocks of a model run the same code, so they share one compiled graph (Dynamo caches by code
  and guards, not by module): compile time is one block's, whatever the depth;
* everything outside the blocks keeps running as written: the pipeline runtime, the loss, ZeRO-3's
  FSDP2 hooks (Dynamo skips them) and ZeRO 0-2's gradient hooks;
* the blocks are compiled after tensor and context parallelism replaced their layers, so the
  graphs see this rank's shapes; their collectives stay eager (:mod:`lightning_3d.core.eager`);
* activation checkpointing wraps the compiled forward (full recompute: the recompute reruns the
  compiled code) or sits inside it (selective: the attention core's checkpoint is marked to run as
  written, a graph break, and the core under it runs eagerly).

Each compiled block forward is recorded as a forward wrapper (``"compiled"``), so a second set-up
(``validate`` after ``fit``) does not compile twice.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any, Callable

import torch
from torch import nn

from lightning_3d.core.forward_wrappers import wrap_forward
from lightning_3d.testing import strict_comm

COMPILED = "compiled"  # the forward wrapper kind
RECOMPILES_PER_BLOCK_CODE = 64  # train / eval, ragged batches, selective recompute on some blocks, ... per code object


def compile_blocks(blocks: Iterable[nn.Module], options: dict[str, Any]) -> int:
    """Compile each block's forward with ``torch.compile(**options)``; returns how many were wrapped."""
    _allow_recompiles()

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        compiled = torch.compile(original, **options)

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            with strict_comm.host_tracking_paused():  # (a test-only mode; see there)
                return compiled(*args, **kwargs)

        return forward

    return sum(wrap_forward(block, COMPILED, make) for block in blocks)


def _allow_recompiles() -> None:
    """Dynamo keeps at most ``recompile_limit`` variants per code object and then runs it eagerly, with
    one warning: blocks that differ in what they contain (an MoE block every other layer, recompute on
    every n-th) or in how they are called (training, validation, a ragged last batch) multiply the
    variants of one ``forward``. Raise the limit so that a deep model does not silently lose its
    compilation part way down."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), RECOMPILES_PER_BLOCK_CODE))
