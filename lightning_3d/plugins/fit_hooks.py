"""The strategy's hooks around fitting: the checks before step 1, the callbacks it brings (SIGTERM
handling, the replica guard), a failure named once for the job, and the end-of-fit summary. A mixin
of :class:`~lightning_3d.plugins.strategy.ThreeDParallelStrategy`.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Trainer

from lightning_3d.core import rank_zero
from lightning_3d.core.topology import suspect_groups
from lightning_3d.data.sampler import accumulation_for, batches_done_this_epoch, recount_batches, with_global_cursor
from lightning_3d.plugins.checks import check_before_first_step
from lightning_3d.plugins.precision import ThreeDPrecision
from lightning_3d.resilience.fault import mark_failed
from lightning_3d.resilience.preemption import TrainingInterrupted


class FitHooks:
    """Lightning's fit hooks for the strategy (``_preemption``, ``_replica_guard``, ``_monitor``, ``_format``,
    ``_pipelines``, ``config`` and the Lightning attributes are the strategy's)."""

    _preemption: Any
    _replica_guard: Any
    _monitor: Any
    _format: Any
    _pipelines: Any
    config: Any
    model: Any
    topology: Any
    root_device: Any
    lightning_module: Any
    precision_plugin: Any
    distributed_sampler_kwargs: Any

    def on_train_start(self) -> None:
        """Before the first step: refuse a batch the configured micro-batch count cannot split, and
        say when the sampler will repeat samples."""
        if self.lightning_module is not None:
            check_before_first_step(self.lightning_module.trainer, self.config)

    def process_dataloader(self, dataloader: object) -> object:
        """A loader Lightning gave a ``DistributedSampler`` gets the global data cursor instead: the same
        sample order, and a checkpoint's position in the epoch that resumes in O(1) at any data-parallel
        size (lightning_3d/data/sampler.py)."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None:
            return dataloader
        keep = self.config.data.global_batch_size
        if keep is None:
            return with_global_cursor(dataloader, lambda: batches_done_this_epoch(trainer))
        loader = with_global_cursor(dataloader, lambda: batches_done_this_epoch(trainer), lambda saved, now: recount_batches(trainer, saved, now))
        if trainer.training:  # (the training loader: evaluation keeps its batches)
            replicas = int(self.distributed_sampler_kwargs["num_replicas"])  # (the data-parallel size, whatever the sampler)
            current = trainer.accumulate_grad_batches
            current = 1 if current == getattr(self, "_derived_accumulation", None) else current  # (ours, from an earlier fit)
            self._derived_accumulation = accumulation_for(keep, loader, replicas, current)
            trainer.accumulate_grad_batches = self._derived_accumulation
        return loader

    def _install_fit_callbacks(self, trainer: Trainer) -> None:
        """The callbacks the strategy brings while fitting: the SIGTERM handling (a checkpoint at the
        signal's step, every rank together) and the replica guard."""
        if self._preemption not in trainer.callbacks:
            trainer.callbacks.append(self._preemption)
        self._preemption.bind(self.root_device)
        guard = self._replica_guard
        if guard is None:
            return
        if guard not in trainer.callbacks:
            trainer.callbacks.append(guard)
        guard.bind(self.model, self.topology, self.config.sharding.zero_stage, self._pipelines, self.root_device)

    def on_exception(self, exception: BaseException) -> None:
        """Name the rank that failed, once for the job: a collective error here usually means a peer died
        (lightning_3d/resilience/fault.py: the first failure is claimed in the store; the others print one line)."""
        suspect_groups()  # messages may be left in flight on this fit's groups: a later fit makes new ones
        if isinstance(exception, TrainingInterrupted):
            return  # every rank stopped together at a scheduler's signal, after a checkpoint: not a failure
        mark_failed()
        if self._monitor is not None:
            self._monitor.report(exception)

    def finalize_checkpoint(self) -> None:
        """Commit an asynchronous save now (every rank; the SIGTERM / requeue handler's save before the job ends)."""
        self._format.finalize()

    def on_train_end(self) -> None:
        self._format.finalize()  # an asynchronous save is committed before fit returns
        precision = self.precision_plugin
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        line = precision.summarize_skipped(trainer.global_step if trainer is not None else 0) if isinstance(precision, ThreeDPrecision) else None
        if line:
            rank_zero.warn(line)
