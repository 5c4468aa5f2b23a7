"""SIGTERM from a scheduler: a checkpoint at the step, then a non-zero exit that says so; never a hang.

SLURM and Kubernetes send SIGTERM before they kill a job (SLURM's grace is ``KillWait``, 30 s by
default; Kubernetes' ``terminationGracePeriodSeconds``, 30 s). Lightning's own handler broadcasts
from rank 0 *inside the signal handler* -- a collective that can interleave with the one the main
thread is in -- and decides from rank 0's flag alone, so a signal to one other rank, or to every
rank at once, could leave ranks waiting on each other (2 runs of 3 hung in the issue's probe).

Here the handler only records the signal. At every optimizer step the ranks agree on "did any rank
get one" with one MAX all-reduce of a single integer, issued asynchronously and read at the next
step (no wait on the device in the step; on a GPU through a pinned copy and an event recorded after
it, so the read waits for that point only and never drains the next step's queue). Lightning's
own per-step broadcast of rank 0's SIGTERM flag is switched off meanwhile (while this handler holds
SIGTERM that flag stays unset). Once the ranks agree on yes, every rank saves a checkpoint together
(``last-interrupted-stepNNNNNN.ckpt`` in the ModelCheckpoint's directory, or ``<default_root_dir>/
checkpoints``) and raises :class:`TrainingInterrupted`, which names the checkpoint to resume from.
The checkpoint is written within two optimizer steps of the signal plus one save; a grace period
shorter than that loses the job to SIGKILL like any crash, and the last complete checkpoint stays.

SLURM requeue. Under SLURM with Lightning's auto-requeue (the default ``SLURMEnvironment``), the job
asks for a signal before its time limit (``#SBATCH --signal=USR1@90``). Lightning's handler saves a
checkpoint inside the signal handler, on whichever ranks got it: with collective checkpoints that
can hang or interleave with the step's collectives. While training, that handler is replaced (a
user's own handler for the signal is left alone, as Lightning leaves it): the signal is recorded like
SIGTERM and agreed at the step (the MAX of 2 for the requeue signal, 1 for SIGTERM); every rank
writes the same checkpoint as for SIGTERM and commits it (an asynchronous save too), then rank 0 runs
``scontrol requeue`` for the job and tells every rank the outcome before they stop. The requeued
job resumes with ``ckpt_path="last"``, which finds that checkpoint (``last-`` prefix). Lightning's own
``hpc_ckpt_N`` files are not used: Lightning finds the newest by the digits in every file name
holding ``hpc_ckpt_``, so a save cut off by the kill (its staging folder) would stop every restart.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

log = logging.getLogger(__name__)

EXIT_CODE = 128 + signal.SIGTERM  # what a shell reports for a process ended by SIGTERM
_NOTHING = object()


class TrainingInterrupted(RuntimeError):
    """Training stopped at a scheduler's signal after writing a checkpoint (``path``)."""

    def __init__(self, message: str, path: str, step: int) -> None:
        super().__init__(message)
        self.path, self.step = path, step


def interrupted_path(trainer: Any) -> Path:
    """Where the checkpoint at the signal goes: the ModelCheckpoint's directory, else the default root's."""
    callback = next((c for c in trainer.callbacks if isinstance(c, ModelCheckpoint) and c.dirpath), None)
    directory = Path(callback.dirpath) if callback is not None else Path(trainer.default_root_dir) / "checkpoints"
    # (no '=': Hydra overrides take it unquoted; "last-": Lightning's ckpt_path="last" takes the newest such file in
    # a ModelCheckpoint's directory, so a restarted job -- torchrun's --max-restarts -- resumes at the signal's step)
    return directory / f"last-interrupted-step{trainer.global_step:06d}.ckpt"


def slurm_requeue(trainer: Any) -> Optional[SLURMEnvironment]:
    """The SLURM environment when Lightning's auto-requeue is on (None otherwise)."""
    environment = getattr(trainer.strategy, "cluster_environment", None)
    return environment if isinstance(environment, SLURMEnvironment) and environment.auto_requeue else None


def slurm_job_id() -> str:
    """The job ``scontrol requeue`` takes: ``ARRAYJOB_TASK`` for an array task, else ``SLURM_JOB_ID``."""
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array}_{os.environ.get('SLURM_ARRAY_TASK_ID', '')}" if array else os.environ.get("SLURM_JOB_ID", "")
    if not re.fullmatch(r"[0-9]+(_[0-9]+)?", job):
        raise RuntimeError(f"SLURM requeue: no usable job id in the environment (SLURM_JOB_ID={job!r}).")
    return job


def requeue(job: str) -> tuple[int, str]:
    """``scontrol requeue JOB``: (its exit code, what it said); 127 when there is no ``scontrol``."""
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as err:
        return 127, str(err)
    return done.returncode, (done.stderr or done.stdout).strip()


def _composed(handler: Any) -> list[Any]:
    """The handlers Lightning composed into ``handler`` (``[]``: not Lightning's composition)."""
    handlers = getattr(handler, "signal_handlers", None)
    return handlers if isinstance(handlers, list) else []


def _from_lightning(handler: Any) -> bool:
    """Whether ``handler`` is one of Lightning's own (bound to its signal connector)."""
    return type(getattr(handler, "__self__", None)).__name__ == "_SignalConnector"


def _lightnings(handler: Any) -> bool:
    """Whether ``handler`` is Lightning's composed signal handler and nothing of the user's."""
    handlers = _composed(handler)
    return bool(handlers) and all(_from_lightning(h) for h in handlers)


class PreemptionHandler(Callback):
    """Installed by the strategy while fitting (see the module docstring)."""

    def __init__(self) -> None:
        self.received: Optional[int] = None
        self._requeue_signal: Optional[int] = None
        self._pending: Optional[tuple[Any, torch.Tensor, Any]] = None  # (work or device flag, flag or its host copy, CUDA event)
        self._last_step = -1
        self._previous: Any = None
        self._chained: list[Any] = []
        self._device = torch.device("cpu")
        self._epoch_loop: Any = None  # whose per-step SIGTERM broadcast is switched off while ours runs
        self._replaced: Any = _NOTHING
        self._side: Any = None  # (a CUDA stream: where the agreed flag is read back)
        self._host_flag: Optional[torch.Tensor] = None  # (pinned host memory it lands in, reused: read before rewritten)

    def bind(self, device: torch.device) -> None:
        self._device = device

    def _note(self, signum: int, frame: Any) -> None:  # a signal handler: no collectives, no I/O
        if self.received is None or signum == self._requeue_signal:  # (a requeue request outranks a SIGTERM)
            self.received = signum
        for handler in self._chained if signum == signal.SIGTERM else ():  # the user's own, which Lightning had composed
            handler(signum, frame)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # after Lightning registered its own handlers (Trainer._run): they are replaced for SIGTERM while
        # training (Lightning's broadcasts inside the handler); the user's handlers it composed still run
        self.received, self._pending, self._last_step = None, None, -1  # (a new fit starts clean)
        slurm = slurm_requeue(trainer)
        self._requeue_signal = slurm.requeue_signal if slurm is not None else None
        if threading.current_thread() is threading.main_thread():
            self._previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, self._note)}
            self._chained = [h for h in _composed(self._previous[signal.SIGTERM]) if callable(h) and not _from_lightning(h)]
            current = signal.getsignal(self._requeue_signal) if self._requeue_signal not in (None, signal.SIGTERM) else None
            if current is not None and _lightnings(current):  # (it saves inside the signal handler; a user's own stays)
                self._previous[self._requeue_signal] = signal.signal(self._requeue_signal, self._note)
            else:
                self._requeue_signal = None
        self._quiet_lightnings_broadcast(trainer)  # (after ours holds SIGTERM: no signal can reach Lightning's in between)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._take_over_lightnings_flag(trainer)  # every batch: Lightning checks it at the end of each
        step = trainer.global_step
        if step == self._last_step:  # accumulating: no optimizer step yet
            return
        self._last_step = step
        if self._pending is not None:  # (read at a fixed step, the same on every rank: they stop together)
            agreed = self._read_pending()
            if agreed:
                self._stop(trainer, requeue_job=agreed == 2)
        code = 0 if self.received is None else 2 if self.received == self._requeue_signal else 1
        # (torch.full: a fill on the device; torch.tensor([code], device=cuda) copies from pageable memory and
        # synchronizes the stream, which would wait for the whole step's queue)
        flag = torch.full((1,), code, dtype=torch.int32, device=self._device)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True)
        if flag.is_cuda:
            # read back through a side stream: it waits for the all-reduce (the compute stream does not, so the
            # next step's kernels do not queue behind a collective across the world), copies into pinned memory
            # and records an event, which the next step's read waits for
            if self._side is None:
                self._side = torch.cuda.Stream(device=flag.device)
                self._host_flag = torch.empty(1, dtype=torch.int32, device="cpu", pin_memory=True)
            host = self._host_flag
            self._side.wait_stream(torch.cuda.current_stream(flag.device))
            with torch.cuda.stream(self._side):
                work.wait()
                host.copy_(flag, non_blocking=True)
                landed = torch.cuda.Event()
                landed.record(self._side)
            self._pending = (flag, host, landed)  # (flag held until read: the side stream still uses it)
        else:
            self._pending = (work, flag, None)

    def _read_pending(self) -> int:
        """The agreed flag of the last step's all-reduce. On a GPU the wait is for the event recorded
        after its copy on the side stream, a step ago: the device passed it long since, and the step
        queued since keeps running (``flag.item()`` on the device tensor waited for that whole queue,
        so the GPU idled while the host launched the next step's first kernels)."""
        first, value, landed = self._pending  # type: ignore[misc]
        if landed is not None:
            landed.synchronize()  # (the rule before a host read of a non_blocking copy)
        else:
            first.wait()
        self._pending = None
        return int(value.item())

    def _take_over_lightnings_flag(self, trainer: Any) -> None:
        """A SIGTERM Lightning's own handler recorded (before ours held the signal, or in a thread where
        ours is not installed) becomes ours, agreed at the step; Lightning would act on it on this rank
        alone (raise at the end of the batch, its per-step broadcast being off)."""
        connector = getattr(trainer, "_signal_connector", None)  # (where Trainer.received_sigterm reads from)
        if getattr(connector, "received_sigterm", False):
            if self.received is None:
                self.received = signal.SIGTERM
            connector.received_sigterm = False

    def _quiet_lightnings_broadcast(self, trainer: Any) -> None:
        """Lightning's training loop broadcasts rank 0's ``received_sigterm`` at every step of a
        multi-rank run and reads it on the host (a world-wide collective and a host sync per step).
        While this handler holds SIGTERM, that flag is never set (and one set anyway is taken over at
        each batch), so the broadcast only costs: it is switched off for the fit; ours agrees instead."""
        loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
        if loop is None or not callable(getattr(loop, "_broadcast_sigterm_tensor", None)):
            return
        self._take_over_lightnings_flag(trainer)
        self._replaced = loop.__dict__.get("_broadcast_sigterm_tensor", _NOTHING)  # (someone else's patch, kept)
        loop._broadcast_sigterm_tensor = lambda: None
        self._epoch_loop = loop

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._finish()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._finish(wait=False)

    def _finish(self, wait: bool = True) -> None:
        if self._pending is not None and wait:
            self._read_pending()
        self._pending = None
        if self._epoch_loop is not None:  # Lightning's own again (or what was on the instance before us)
            if self._replaced is _NOTHING:
                self._epoch_loop.__dict__.pop("_broadcast_sigterm_tensor", None)
            else:
                self._epoch_loop._broadcast_sigterm_tensor = self._replaced
            self._epoch_loop = None
        if self._previous is not None and threading.current_thread() is threading.main_thread():
            for signum, previous in self._previous.items():
                signal.signal(signum, previous)
            self._previous = None

    def _agreed(self, value: int) -> int:
        """The largest of every rank's ``value`` (one all-reduce on the device)."""
        flag = torch.tensor([value], dtype=torch.int32, device=self._device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def _stop(self, trainer: Any, requeue_job: bool = False) -> None:
        step = trainer.global_step
        path = interrupted_path(trainer)
        job = slurm_job_id() if requeue_job else ""  # (before the save: a missing id fails on every rank alike)
        trainer.save_checkpoint(str(path))  # every rank: they decided together
        finalize = getattr(trainer.strategy, "finalize_checkpoint", None)
        if callable(finalize):
            finalize()  # an asynchronous save committed before anything else (the requeue ends the job)
        what = f"signal {signal.Signals(self.received).name}" if self.received is not None else "a peer's signal"
        if requeue_job:
            code, said = requeue(job) if trainer.is_global_zero else (0, "")
            code = self._agreed(code)  # every rank waits for rank 0's requeue, and knows how it went
            outcome = (
                f"SLURM job {job} is requeued: it resumes from this checkpoint with ckpt_path=\"last\"." if code == 0
                else f"`scontrol requeue {job}` failed (exit {code}{': ' + said if said else ''}); resubmit the job, which "
                f"resumes from this checkpoint with ckpt_path=\"last\" (or ckpt_path={str(path)!r})."
            )
            raise TrainingInterrupted(
                f"lightning_3d: training interrupted by {what} (SLURM requeue) at step {step}; the checkpoint {path} is "
                f"complete. {outcome}", str(path), step,
            )
        raise TrainingInterrupted(
            f"lightning_3d: training interrupted by {what} at step {step}; the checkpoint {path} is complete. "
            f"Resume with trainer.fit(..., ckpt_path={str(path)!r}) or ckpt_path=\"last\" (recipes: ckpt_path={path}).",
            str(path), step,
        )
