"""Training progress worth watching: global tokens/s and peak memory on the progress bar."""

from __future__ import annotations

import resource
import time
from typing import Any, Optional

import lightning as L
import torch
import torch.distributed as dist


def peak_memory_mb(device: torch.device) -> float:
    """Peak GPU memory allocated by this process, or its peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def data_parallel_size(trainer: L.Trainer) -> int:
    """How many replicas consume distinct samples (tp/pp peers share theirs)."""
    kwargs = trainer.distributed_sampler_kwargs
    return int(kwargs["num_replicas"]) if kwargs else 1


class TokenThroughput(L.Callback):
    """Logs ``tokens_per_s`` (all data-parallel replicas together) and ``mem_mb`` every step.

    The first ``warmup`` steps are excluded from :attr:`mean_tokens_per_s` (allocator and
    autograd warm-up). ``peak_memory_mb`` is the maximum over all ranks at the end of fit.
    """

    def __init__(self, warmup: int = 3) -> None:
        self.warmup = warmup
        self._last: Optional[float] = None
        self._tokens = 0
        self._seconds = 0.0
        self._steps = 0
        self.peak_memory_mb: float = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if self._last is None:
            self._last = time.perf_counter()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        assert self._last is not None
        elapsed, self._last = now - self._last, now
        inputs = batch[0] if isinstance(batch, (tuple, list)) else batch
        tokens = inputs.numel() * data_parallel_size(trainer) if isinstance(inputs, torch.Tensor) else 0
        self._steps += 1
        if self._steps > self.warmup:
            self._tokens += tokens
            self._seconds += elapsed
        if tokens and elapsed > 0:
            pl_module.log("tokens_per_s", tokens / elapsed, prog_bar=True, on_step=True, on_epoch=False)
        pl_module.log("mem_mb", peak_memory_mb(pl_module.device), prog_bar=True, on_step=True, on_epoch=False)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last = None  # validation time is not training time

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        peak = torch.tensor(peak_memory_mb(pl_module.device), dtype=torch.float64, device=pl_module.device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        self.peak_memory_mb = float(peak)

    @property
    def mean_tokens_per_s(self) -> float:
        return self._tokens / self._seconds if self._seconds > 0 else float("nan")


class SavedTensorTracker:
    """Peak bytes of the tensors autograd keeps for backward, counted once per storage, weights
    excluded: the activation memory the planner predicts, measured the same way on any device.

    Use as the pair of ``torch.autograd.graph.saved_tensors_hooks``; a saved tensor stops counting
    when autograd frees it (after its backward), so the peak covers in-flight micro-batches."""

    def __init__(self, exclude: list[torch.Tensor]) -> None:
        self._exclude = {_storage_key(t) for t in exclude}
        self._live: dict[int, list[int]] = {}
        self.current = 0
        self.peak = 0

    def pack(self, tensor: torch.Tensor) -> Any:
        key = _storage_key(tensor)
        if key is None or key in self._exclude:
            return tensor
        entry = self._live.get(key)
        if entry is None:
            nbytes = tensor.untyped_storage().nbytes()
            self._live[key] = [1, nbytes]
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        else:
            entry[0] += 1
        return _Held(tensor, key, self)

    @staticmethod
    def unpack(held: Any) -> torch.Tensor:
        return held.tensor if isinstance(held, _Held) else held

    def release(self, key: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self._live[key]


class _Held:
    __slots__ = ("tensor", "key", "tracker")

    def __init__(self, tensor: torch.Tensor, key: int, tracker: SavedTensorTracker) -> None:
        self.tensor, self.key, self.tracker = tensor, key, tracker

    def __del__(self) -> None:
        self.tracker.release(self.key)


def _storage_key(tensor: torch.Tensor) -> Optional[int]:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    try:
        storage = local.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensors without storage (meta, some subclasses)
        return None
    return storage.data_ptr() if storage.nbytes() else None


class MemoryProbe(L.Callback):
    """Measures, on training step ``step``, what the planner predicts per rank: model states
    (``ThreeDParallelStrategy.memory_report``: parameters, gradients, optimizer state) and the peak
    of saved activations. :attr:`per_rank` holds every rank's numbers (bytes) after fit."""

    def __init__(self, step: int = 1) -> None:
        self.step = step
        self._tracker: Optional[SavedTensorTracker] = None
        self._hooks: Any = None
        self.measured: dict[str, float] = {}
        self.per_rank: list[dict[str, float]] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step != self.step or self._hooks is not None:
            return
        self._tracker = SavedTensorTracker(list(pl_module.parameters()))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._tracker.pack, self._tracker.unpack)
        self._hooks.__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._hooks is None or self._tracker is None or self.measured:
            return
        self._hooks.__exit__(None, None, None)
        report = trainer.strategy.memory_report() if hasattr(trainer.strategy, "memory_report") else {}
        self.measured = {
            "params": float(report.get("params", 0)),
            "grads": float(report.get("grads", 0)),
            "optimizer": float(report.get("master", 0) + report.get("optimizer_state", 0)),
            "activations": float(self._tracker.peak),
        }
        self.measured["total"] = sum(self.measured.values())

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        mine = self.measured or {"total": 0.0}
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            gathered: list[Any] = [None] * trainer.world_size
            dist.all_gather_object(gathered, mine)
            self.per_rank = gathered
        else:
            self.per_rank = [mine]
