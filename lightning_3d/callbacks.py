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
