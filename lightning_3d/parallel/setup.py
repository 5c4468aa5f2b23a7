"""``setup_parallel``: the whole set-up of one rank, shared by the strategy and the dry run.

The strategy's ``setup`` and the dry run (``lightning-3d dry-run``, on the meta device under a fake
process group) must build the same rank: the same ``parallelize`` order, the same ZeRO wrapping of
the same optimizers, the same hand-over of master weights read before set-up. Both call this; the
dry run keeps no copy of the order, and the strategy keeps only Lightning's side (its hooks, the
optimizers Lightning builds, the callbacks it installs).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_3d.core.config import ParallelConfig
from lightning_3d.core.topology import Topology
from lightning_3d.parallel.parallelize import Parallelized, parallelize
from lightning_3d.pipeline.runtime import PipelineRuntime
from lightning_3d.tensor_parallel.random import RNGStatesTracker
from lightning_3d.zero.coordinator import ZeroCoordinator

if TYPE_CHECKING:
    from lightning_3d.plugins.precision import ThreeDPrecision


@dataclass
class ParallelSetup:
    """One rank after set-up: its part of the model, the ZeRO coordinator, the pipeline runtimes and
    (when training) the optimizers as ZeRO wrapped them."""

    module: nn.Module
    zero: ZeroCoordinator
    pipelines: list[PipelineRuntime] = field(default_factory=list)
    optimizers: list[Any] = field(default_factory=list)


def setup_parallel(
    module: nn.Module,
    topology: Topology,
    config: ParallelConfig,
    *,
    precision: "ThreeDPrecision",
    device: torch.device,
    rng_tracker: RNGStatesTracker,
    training: bool,
    grad_sync_blocker: Callable[[], AbstractContextManager[Any]],
    build_optimizers: Callable[[Parallelized], list[Optimizer]],
    zero: Optional[ZeroCoordinator] = None,
    master_weights: Optional[dict[int, Tensor]] = None,
) -> ParallelSetup:
    """Apply the layout (:func:`~lightning_3d.parallel.parallelize.parallelize`), then, when training,
    build this stage's optimizers (``build_optimizers(parallelized)``: Lightning's
    ``configure_optimizers`` through the strategy, which records the parallelized model first, or the
    module's own in the dry run), wrap them by ZeRO and hand over master weights a checkpoint loaded
    before the optimizers existed."""
    done = parallelize(
        module, topology, config,
        precision=precision, device=device, rng_tracker=rng_tracker, training=training,
        grad_sync_blocker=grad_sync_blocker, zero=zero,
    )
    optimizers: list[Any] = []
    if training:
        optimizers = done.zero.wrap_optimizers(done.module, build_optimizers(done))
        if master_weights:
            done.zero.load_dense_master_weights(master_weights)
    return ParallelSetup(done.module, done.zero, done.pipelines, optimizers)
