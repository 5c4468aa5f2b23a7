"""SIGTERM from a scheduler: a checkpoint at the step, then a non-zero exit that says so; never a hang.

SLURM and Kubernetes send SIGTERM before they kill a job (SLURM's grace is ``KillWait``, 30 s by
default; Kubernetes' ``terminationGracePeriodSeconds``, 30 s). Lightning's own handler broadcasts
from rank 0 *inside the signal handler* -- a collective that can interleave with the one the main
thread is in -- and decides from rank 0's flag alone, so a signal to one other rank, or to every
rank at once, could leave ranks waiting on each other (2 runs of 3 hung in the issue's probe).

Here the handler only records the signal. At every optimizer step the ranks agree on "did any rank
get one" with one MAX all-reduce of a single integer, issued asynchronously and read at the next
step (no wait on the device in the step). Once it says yes, every rank saves a checkpoint together
(``interrupted-stepNNNNNN.ckpt`` in the ModelCheckpoint's directory, or ``<default_root_dir>/
checkpoints``) and raises :class:`TrainingInterrupted`, which names the checkpoint to resume from.
The checkpoint is written within two optimizer steps of the signal plus one save; a grace period
shorter than that loses the job to SIGKILL like any crash, and the last complete checkpoint stays.
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

log = logging.getLogger(__name__)

EXIT_CODE = 128 + signal.SIGTERM  # what a shell reports for a process ended by SIGTERM


class TrainingInterrupted(RuntimeError):
    """Training stopped at a scheduler's signal after writing a checkpoint (``path``)."""

    def __init__(self, message: str, path: str, step: int) -> None:
        super().__init__(message)
        self.path, self.step = path, step


def interrupted_path(trainer: Any) -> Path:
    """Where the checkpoint at the signal goes: the ModelCheckpoint's directory, else the default root's."""
    callback = next((c for c in trainer.callbacks if isinstance(c, ModelCheckpoint) and c.dirpath), None)
    directory = Path(callback.dirpath) if callback is not None else Path(trainer.default_root_dir) / "checkpoints"
    return directory / f"interrupted-step{trainer.global_step:06d}.ckpt"  # (no '=': Hydra overrides take it unquoted)


class PreemptionHandler(Callback):
    """Installed by the strategy while fitting (see the module docstring)."""

    def __init__(self) -> None:
        self.received: Optional[int] = None
        self._pending: Optional[tuple[Any, torch.Tensor]] = None
        self._last_step = -1
        self._previous: Any = None
        self._chained: list[Any] = []
        self._device = torch.device("cpu")

    def bind(self, device: torch.device) -> None:
        self._device = device

    def _note(self, signum: int, frame: Any) -> None:  # a signal handler: no collectives, no I/O
        if self.received is None:
            self.received = signum
        for handler in self._chained:  # the user's own handlers, which Lightning had composed with its own
            handler(signum, frame)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # after Lightning registered its own handlers (Trainer._run): they are replaced for SIGTERM while
        # training (Lightning's broadcasts inside the handler); the user's handlers it composed still run
        self.received, self._pending, self._last_step = None, None, -1  # (a new fit starts clean)
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._note)
            handlers = getattr(self._previous, "signal_handlers", None)
            self._chained = [
                h for h in (handlers if isinstance(handlers, list) else [])
                if callable(h) and not type(getattr(h, "__self__", None)).__name__ == "_SignalConnector"
            ]

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._last_step:  # accumulating: no optimizer step yet
            return
        self._last_step = step
        if self._pending is not None:
            work, flag = self._pending
            self._pending = None
            work.wait()
            if int(flag.item()):
                self._stop(trainer)
        flag = torch.tensor([1 if self.received is not None else 0], dtype=torch.int32, device=self._device)
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), flag)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._finish()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._finish(wait=False)

    def _finish(self, wait: bool = True) -> None:
        if self._pending is not None and wait:
            self._pending[0].wait()
        self._pending = None
        if self._previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _stop(self, trainer: Any) -> None:
        path = interrupted_path(trainer)
        step = trainer.global_step
        trainer.save_checkpoint(str(path))  # every rank: they decided together
        what = f"signal {signal.Signals(self.received).name}" if self.received is not None else "a peer's SIGTERM"
        raise TrainingInterrupted(
            f"lightning_3d: training interrupted by {what} at step {step}; the checkpoint {path} is complete. "
            f"Resume with trainer.fit(..., ckpt_path={str(path)!r}) (recipes: ckpt_path={path}).",
            str(path), step,
        )
