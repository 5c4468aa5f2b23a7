"""Where ``torch.compile`` stops: lightning_3d's communication runs eagerly, between compiled graphs.

Regional compilation (``ThreeDParallelStrategy(compile=...)``, :mod:`lightning_3d.transforms.compile`)
compiles each transformer block after the layout has been applied, so a block's forward contains
our tensor-parallel layers, context-parallel attention and expert exchanges. Each of those is marked
:func:`communicates`: Dynamo breaks its graph there and calls it as written. Why not let Dynamo trace
the collectives into its graphs (it can rewrite ``dist.all_reduce`` into functional collectives):

* the collective is the same call, in the same order, with or without compilation: what the NCCL
  rules (strict communication mode, every multi-rank test) proved of the eager path holds compiled;
* the layers keep Python state across the collective that a graph would drop (a gathered sequence
  shard attached to its tensor, RNG-tracker forks, counts read back for all-to-all split sizes);
* the local compute between collectives (norms, attention, activations, residuals) is what fuses.

The cost is a graph break per collective (a few microseconds of guard checks each).
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch

Fn = TypeVar("Fn", bound=Callable[..., Any])


def communicates(fn: Fn) -> Fn:
    """Mark ``fn`` (it talks to other ranks) to run eagerly, with all it calls, inside compiled code."""
    return torch.compiler.disable(fn, recursive=True)  # type: ignore[return-value]
