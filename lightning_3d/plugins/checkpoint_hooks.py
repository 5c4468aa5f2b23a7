"""The strategy's checkpoint hooks: Lightning asks, the checkpoint format (sharded or consolidated,
:mod:`lightning_3d.checkpoint.formats`) does the work.

A mixin of :class:`~lightning_3d.plugins.strategy.ThreeDParallelStrategy`: it reads the running
job's state (model, optimizers, topology, ZeRO) from the strategy and hands it over as one
:class:`~lightning_3d.checkpoint.formats.JobState`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

from lightning.pytorch.core.optimizer import LightningOptimizer
from torch.optim import Optimizer

from lightning_3d.checkpoint.formats import JobState
from lightning_3d.checkpoint.manager import ShardedCheckpointer
from lightning_3d.data.sampler import reload_loader_built_before_restore
from lightning_3d.pipeline.runtime import PipelineRuntime, pipeline_runtime_of
from lightning_3d.resilience.launch_guard import note_checkpoint


class CheckpointHooks:
    """Lightning's checkpoint hooks for the strategy (``_format``, ``_zero``, ``_topology``, ``_dims`` and
    ``config`` are the strategy's)."""

    _format: Any
    _zero: Any
    _topology: Any
    _dims: Any
    _pending_master: Any
    config: Any

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Restore into the parallelized model: each rank then reads only the tensors it holds."""
        return True

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self._format.model_state(self._job())

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return self._format.optimizer_state(self._job(), optimizer)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        self._format.save(self._job(), checkpoint, filepath, storage_options)
        note_checkpoint(filepath)  # failure lines may now advise resuming

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        loaded = self._format.load(self._job(), Path(self.broadcast(str(checkpoint_path))), weights_only)
        policy, saved = self.config.data.elastic, loaded.get("lightning_3d_layout")
        why = policy.refusal(saved, self._job().layout) if policy is not None and saved is not None else None
        if why:  # (every rank reads the same manifest: they all stop here, before any state is restored)
            raise ValueError(f"{why} (checkpoint {checkpoint_path})")
        note_checkpoint(checkpoint_path)
        return loaded

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pending = self._format.load_model_state(self._job(), checkpoint, strict=strict)
        if pending is not None:  # the ZeRO optimizers do not exist yet: hand the masters over at set-up
            self._pending_master = pending

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        self._format.load_optimizer_states(self._job(), checkpoint)
        if self._zero is not None:  # the saved groups replaced ours: their kernel choice may be another layout's
            self._zero.optimizers_loaded(self._job().optimizers)
        if self.lightning_module is not None:  # (Lightning restores the loops just before the optimizers)
            reload_loader_built_before_restore(self.lightning_module.trainer)

    @property
    def checkpointer(self) -> ShardedCheckpointer:
        return self._format.checkpointer(self._job())

    def _job(self) -> JobState:
        """The running job as a checkpoint format sees it."""
        d = self._dims
        tied = [[f"{prefix}{n}" for n in group] for prefix, runtime in self._pipeline_prefixes() for group in runtime.tied_groups]
        return JobState(
            module=self.lightning_module,
            optimizers=[o._optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers],
            topology=self._topology,
            zero=self._zero,
            layout={} if d is None else {
                "dp": int(d.dp), "tp": d.tp, "pp": d.pp, "cp": d.cp, "ep": d.ep, "zero_stage": self.config.sharding.zero_stage,
                "virtual_stages": self.config.pipeline.virtual_stages,
            },
            tied=tied,
            rng_tracker=self._rng_tracker,
            checkpoint_io=self.checkpoint_io,
            is_global_zero=self.is_global_zero,
            pipeline_parallel=self.config.layout.pipeline_parallel,
            state_device=self._optimizer_state_device,
            separate_masters_expected=self.precision_plugin.mixed or self.config.sharding.offload_optimizer != "none",
        )

    def _pipeline_prefixes(self) -> list[tuple[str, PipelineRuntime]]:
        module = self.lightning_module
        out = []
        for name, sub in module.named_modules() if module is not None else []:
            runtime = pipeline_runtime_of(sub)
            if runtime is not None:
                out.append((f"{name}." if name else "", runtime))
        return out
