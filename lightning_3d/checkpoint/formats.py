"""Checkpoint formats behind one interface: what the strategy's checkpoint hooks do.

* :class:`ShardedFormat` (``checkpoint_format="sharded"``): a directory; each rank writes the
  pieces it holds (``checkpoint/manager.py``); loads under any layout.
* :class:`ConsolidatedFormat` (``checkpoint_format="consolidated"``): one dense file, gathered
  (the fp32 masters under mixed precision, every pipeline stage's layers), written by rank 0
  through the strategy's ``CheckpointIO``; for small models.

Reading does not depend on the configured format: a directory (or a path that does not exist
yet: an interrupted save whose last good checkpoint is found) is read as sharded, a file as
consolidated. Restoring into the model and the optimizers is the same for both: the reader gives
dense tensors keyed by name, and each rank keeps its slices.

The strategy describes the running job with a :class:`JobState` on each call, so formats hold
no reference to the strategy (the layers never import it).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Optional

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.optimizer import _optimizer_to_device
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn

from lightning_3d.checkpoint.compatibility import check_compatible
from lightning_3d.checkpoint.dense_state import (
    _sharded_spec,
    full_optimizer_state,
    full_state_dict,
    keyed_by_index,
    keyed_by_name,
    load_sharded_optimizer_state,
    merge_optimizer_states,
    merge_over_group,
    parameter_names,
    shard_state_dict,
)
from lightning_3d.checkpoint.manager import ShardedCheckpointer
from lightning_3d.checkpoint.sharded import CheckpointError
from lightning_3d.core.config import CheckpointOptions
from lightning_3d.core.topology import Topology
from lightning_3d.tensor_parallel.spec import shard_like
from lightning_3d.zero.coordinator import ZeroCoordinator
from lightning_3d.zero.sharded_optimizer import ZeroOptimizer

FORMATS = ("sharded", "consolidated")


@dataclass
class JobState:
    """What a checkpoint format reads of the running job (the strategy builds one per call).

    Args:
        module: the LightningModule (after set-up: this rank's slices and pipeline stage).
        optimizers: the optimizers as the strategy holds them (ZeRO-wrapped; not LightningOptimizer).
        topology: the mesh; ``None`` before the processes started.
        zero: the ZeRO coordinator, ``None`` before set-up.
        layout: the degrees a sharded manifest records (resume decides on random streams with it).
        tied: groups of parameter names that are one tied weight across pipeline stages.
        rng_tracker: the tensor-parallel RNG tracker (its states go into sharded checkpoints).
        checkpoint_io: writes and reads single files (consolidated format).
        is_global_zero: rank 0 writes the consolidated file.
        pipeline_parallel: pipeline degree (stages' dense states are merged for one file).
        state_device: where a plain optimizer's state lives (with its parameters); asked only when loading.
        separate_masters_expected: mixed precision or optimizer offload: masters are a copy that
            must be loaded too (decides before the ZeRO optimizers exist).
    """

    module: Optional[nn.Module]
    optimizers: list[Any] = field(default_factory=list)
    topology: Optional[Topology] = None
    zero: Optional[ZeroCoordinator] = None
    layout: dict[str, Any] = field(default_factory=dict)
    tied: list[list[str]] = field(default_factory=list)
    rng_tracker: Any = None
    checkpoint_io: Optional[CheckpointIO] = None
    is_global_zero: bool = True
    pipeline_parallel: int = 1
    state_device: Callable[[], torch.device] = lambda: torch.device("cpu")
    separate_masters_expected: bool = False

    def aliases(self, names: dict[int, list[str]]) -> list[list[str]]:
        """Groups of names that are one tied weight: shared Parameters, and the two sides of a tie
        that pipeline stages hold separately (the runtimes remember the dense model's ties)."""
        return [group for group in names.values() if len(group) > 1] + [list(g) for g in self.tied]


class CheckpointFormat:
    """One checkpoint format: the dense or empty states Lightning asks for, how a checkpoint is
    written, and (shared by both) how one is read and restored.

    Holds the :class:`ShardedCheckpointer` (created on first use) under either format: a sharded
    checkpoint can be loaded whatever the format the job writes, and an asynchronous save must be
    committed (:meth:`finalize`) before the job ends or loads.
    """

    name: ClassVar[str]

    def __init__(self, async_save: bool = False, keep_last_k: Optional[int] = None) -> None:
        self.async_save, self.keep_last_k = async_save, keep_last_k
        self._checkpointer: Optional[ShardedCheckpointer] = None

    # -- what Lightning puts into the checkpoint dict --------------------------------------------------
    def model_state(self, job: JobState) -> dict[str, Any]:
        raise NotImplementedError

    def optimizer_state(self, job: JobState, optimizer: Any) -> dict[str, Any]:
        raise NotImplementedError

    def save(self, job: JobState, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        raise NotImplementedError

    # -- reading (either format) -----------------------------------------------------------------------
    def load(self, job: JobState, path: Path, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """``path`` as every rank agreed on it: a directory (or a missing path: an interrupted save, whose
        last good checkpoint is found) is sharded, a file is one dense checkpoint."""
        if path.is_dir() or not path.exists():
            checkpoint = self.checkpointer(job).load(str(path), weights_only=weights_only is not False, layout=job.layout)
            if job.module is not None:
                checkpoint["state_dict"] = LocalView(checkpoint["state_dict"], job.module)
            return checkpoint
        if path.suffix == ".safetensors" or (path.suffix == ".bin" and (path.parent / "config.json").is_file()):
            raise CheckpointError(
                f"ckpt_path={str(path)!r} holds Hugging Face weights, not a training checkpoint (no optimizer, step or "
                f"loop state to resume). To start from weights, build the model with lightning_3d.from_pretrained("
                f"{str(path.parent)!r}) (recipes: model.init_from={path.parent}, the CLI: --model.init_from=...), and "
                f"pass no ckpt_path."
            )
        assert job.checkpoint_io is not None
        torch.cuda.empty_cache()
        return job.checkpoint_io.load_checkpoint(path, weights_only=weights_only)

    def load_model_state(self, job: JobState, checkpoint: Mapping[str, Any], strict: bool = True) -> Optional[dict[int, Tensor]]:
        """Each rank loads its slices of the dense weights. Masters that are a copy (mixed precision:
        fp32; offload: host or NVMe) must be loaded too, or the first step would copy the stale master
        over the loaded weights: returns them (by parameter id) when the ZeRO optimizers do not exist
        yet, for the strategy to hand over once they do."""
        module = job.module
        assert module is not None
        check_compatible(module, checkpoint, strict)  # one clear message before any shard-shape error
        source = checkpoint["state_dict"]
        source = getattr(source, "dense", source)  # a sharded checkpoint: the dense tensors behind the local view
        dense = {k: source[k] for k in module.state_dict().keys() if k in source}  # other stages' layers skipped
        module.load_state_dict(shard_state_dict(module, dense), strict=strict)
        zero = job.zero
        built = zero is not None and bool(zero.zero_optimizers)
        if (built and zero.separate_masters) or (not built and job.separate_masters_expected):  # type: ignore[union-attr]
            by_param = {id(p): dense[n] for n, p in module.named_parameters() if n in dense}
            if not built:
                return by_param
            zero.load_dense_master_weights(by_param)  # type: ignore[union-attr]
        return None

    def load_optimizer_states(self, job: JobState, checkpoint: Mapping[str, Any]) -> None:
        """States keyed by parameter name -> each optimizer's own (ZeRO: its segments; plain: its slices)."""
        assert job.module is not None
        names = parameter_names(job.module)
        for optimizer, state in zip(job.optimizers, checkpoint["optimizer_states"]):
            state = keyed_by_index(state, optimizer, names)
            if isinstance(optimizer, ZeroOptimizer):
                optimizer.load_state_dict(state)
            else:
                load_sharded_optimizer_state(optimizer, state)
                _optimizer_to_device(optimizer, job.state_device())

    # -- the sharded machinery and its lifetime ----------------------------------------------------------
    def checkpointer(self, job: JobState) -> ShardedCheckpointer:
        if self._checkpointer is None:
            if job.topology is None:
                raise RuntimeError("sharded checkpoints need the topology: they exist only after the processes have started.")
            self._checkpointer = ShardedCheckpointer(job.topology, job.rng_tracker, self.async_save, self.keep_last_k)
        return self._checkpointer

    @property
    def started(self) -> Optional[ShardedCheckpointer]:
        """The sharded checkpointer if one was created (nothing to commit or close otherwise)."""
        return self._checkpointer

    def finalize(self) -> None:
        """Commit an asynchronous save (before ``fit`` returns)."""
        if self._checkpointer is not None:
            self._checkpointer.finalize()

    def close(self) -> None:
        if self._checkpointer is not None:
            self._checkpointer.close()
            self._checkpointer = None


class LocalView(Mapping):
    """What ``on_load_checkpoint`` hooks see as ``checkpoint["state_dict"]`` of a sharded checkpoint:
    keyed like this rank's ``module.state_dict()``, each value this rank's part of the checkpoint's
    tensor re-cut for the running layout (a tensor-parallel slice; under ZeRO-3 a DTensor of its row
    chunk), as ``on_save_checkpoint`` hooks saw it when saving. Built on access, one tensor at a time,
    without collectives (hooks may read any keys in any order); read-only. ``dense`` is the dense view
    the strategy restores from."""

    def __init__(self, dense: Mapping[str, Tensor], module: nn.Module) -> None:
        self.dense = dense
        self.checkpoint = getattr(dense, "checkpoint", None)  # the reader (compatibility checks read its manifest)
        self._local = module.state_dict(keep_vars=True)
        self._keys = [k for k in self._local if k in dense]

    def __getitem__(self, name: str) -> Any:
        if name not in self._local or name not in self.dense:
            raise KeyError(name)
        value, target = self.dense[name], self._local[name]
        if not isinstance(target, Tensor):
            return value
        spec = _sharded_spec(target)
        local = shard_like(value, spec) if spec is not None else value
        if hasattr(target, "device_mesh"):  # no scatter from rank 0: every rank cuts its own chunk
            from torch.distributed.tensor import distribute_tensor

            return distribute_tensor(local.to(target.device, target.dtype), target.device_mesh, target.placements, src_data_rank=None)
        return local.to(target.dtype)

    def __contains__(self, name: object) -> bool:
        return name in self._local and name in self.dense

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


class ShardedFormat(CheckpointFormat):
    """A directory; every rank writes its pieces. Lightning's dict carries this rank's local state dict
    for the ``on_save_checkpoint`` hooks (the writer reads the module and optimizers, not that dict)."""

    name = "sharded"

    def __init__(self, async_save: bool = False, keep_last_k: Optional[int] = None) -> None:
        super().__init__(async_save, keep_last_k)
        self._handed: Optional[tuple[dict[str, Any], dict[str, Any]]] = None

    def model_state(self, job: JobState) -> dict[str, Any]:
        """This rank's ``module.state_dict()``: its tensor-parallel slices, its pipeline stage's layers,
        its ZeRO-3 shards as DTensors -- references, nothing gathered or copied."""
        assert job.module is not None
        state = job.module.state_dict()
        self._handed = (state, dict(state))
        return state

    def optimizer_state(self, job: JobState, optimizer: Any) -> dict[str, Any]:
        return {}

    def save(self, job: JobState, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError("sharded checkpoints take no storage_options; use checkpoint_format='consolidated'.")
        assert job.module is not None
        self._warn_if_changed(checkpoint.get("state_dict"))
        names = parameter_names(job.module)
        self.checkpointer(job).save(checkpoint, str(filepath), job.module, job.optimizers, names, job.aliases(names), job.layout)


    def _warn_if_changed(self, given: Any) -> None:
        handed, self._handed = self._handed, None
        if handed is None:
            return
        state, items = handed
        if given is state and len(given) == len(items) and all(given.get(k) is v for k, v in items.items()):
            return
        rank_zero_warn(
            "lightning_3d: a hook changed checkpoint['state_dict'], which sharded checkpoints do not write (each rank "
            "writes its module's and optimizers' own pieces; the dict is this rank's local view, for reading). Save "
            "other weights under another key of the checkpoint (they are saved per rank), or load them into the "
            "module before saving."
        )


class ConsolidatedFormat(CheckpointFormat):
    """One dense file: weights and optimizer state gathered and keyed by name, so it loads under
    another layout (and into a plain module)."""

    name = "consolidated"

    def model_state(self, job: JobState) -> dict[str, Any]:
        """Dense weights (the fp32 masters under mixed precision), every pipeline stage's layers."""
        assert job.module is not None
        masters = job.zero.dense_master_weights() if job.zero is not None else {}
        state = full_state_dict(job.module, overrides=masters)
        if job.pipeline_parallel > 1:
            assert job.topology is not None
            state = merge_over_group(state, job.topology.pp_group)
        return state

    def optimizer_state(self, job: JobState, optimizer: Any) -> dict[str, Any]:
        """Dense and keyed by parameter name."""
        state = optimizer.dense_state_dict() if isinstance(optimizer, ZeroOptimizer) else full_optimizer_state(optimizer)
        assert job.module is not None
        params = [p for g in optimizer.param_groups for p in g["params"]]
        state = keyed_by_name(state, params, parameter_names(job.module))
        if job.pipeline_parallel > 1:
            assert job.topology is not None
            state = merge_optimizer_states(state, job.topology.pp_group)
        return state

    def save(self, job: JobState, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if job.is_global_zero:
            assert job.checkpoint_io is not None
            job.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)


def checkpoint_format(name: str, async_save: bool = False, keep_last_k: Optional[int] = None) -> CheckpointFormat:
    """The format for ``ThreeDParallelStrategy(checkpoint_format=name)`` (the options validated by
    :class:`~lightning_3d.core.config.CheckpointOptions`, as the strategy's are)."""
    options = CheckpointOptions(name, async_save, keep_last_k)
    formats: dict[str, type[CheckpointFormat]] = {"sharded": ShardedFormat, "consolidated": ConsolidatedFormat}
    return formats[options.format](options.async_save, options.keep_last_k)
