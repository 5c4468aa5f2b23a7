"""The strategy's gradient and ZeRO hooks: Lightning asks, the ZeRO coordinator
(:mod:`lightning_3d.zero.coordinator`) answers -- gradient communication after backward and held
back while accumulating, the module's moves (FSDP2 re-creates its parameters), where optimizer state
lives, and the per-rank memory report. A mixin of
:class:`~lightning_3d.plugins.strategy.ThreeDParallelStrategy`.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_3d.zero.grad_reducer import GradientReducer
from lightning_3d.zero.memory_report import memory_report


class ZeroHooks:
    """Lightning's gradient hooks for the strategy (``_zero``, ``model``, ``optimizers``, ``topology`` and
    ``root_device`` are the strategy's)."""

    _zero: Any
    model: Any
    optimizers: Any
    topology: Any
    root_device: torch.device

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)
        if self._zero is not None:
            self._zero.module_moved(self.model)  # FSDP2 re-creates its parameters when moved

    def post_backward(self, closure_loss: Tensor) -> None:
        if self._zero is not None:
            self._zero.after_backward()

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient accumulation: no gradient communication until the last micro-step."""
        if self._zero is None:
            yield
            return
        with self._zero.no_sync():
            yield

    @property
    def grad_reducer(self) -> Optional[GradientReducer]:
        """The stage-0 gradient reducer (``None`` under ZeRO 1-3 or mixed precision)."""
        return self._zero.reducer if self._zero is not None else None

    def memory_report(self) -> dict[str, Any]:
        """Per-rank bytes of parameters, gradients, master weights and optimizer state, with the
        ZeRO formula for this layout next to them (see :func:`lightning_3d.zero.memory_report.memory_report`)."""
        assert self.model is not None and self._zero is not None
        return memory_report(self.model, self.optimizers, self._zero, self.topology)

    def _optimizer_state_device(self) -> torch.device:
        """Where a plain optimizer's state lives: with its parameters. Under ZeRO-3's CPU offload FSDP2
        keeps the sharded parameters, and runs the step, on the host: state moved to the GPU would
        meet host parameters in the step."""
        zero = self._zero
        if zero is not None and zero.stage == 3 and "cpu" in (zero.offload_optimizer, zero.offload_params):
            return torch.device("cpu")
        return self.root_device
