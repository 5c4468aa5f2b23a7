"""Training progress worth watching: global tokens/s, TFLOP/s per device, MFU and peak memory.

FLOPs come from the model family's adapter (``flops_per_token``: the planner's count, forward +
backward, recompute excluded, so the MFU is model FLOPs utilization, not hardware FLOPs), times the
tokens of the *global* batch. Only data-parallel replicas consume distinct samples: tensor- and
pipeline-parallel peers share one, so nothing here multiplies by the world size (Lightning's
``ThroughputMonitor`` does, which over-counts by tp x pp under this strategy).
"""

from __future__ import annotations

import math
import resource
import time
from dataclasses import dataclass
from typing import Any, Optional

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelSummary as ModelSummaryCallback
from lightning.pytorch.callbacks import RichModelSummary
from lightning.pytorch.utilities.model_summary import ModelSummary

from lightning_3d.core.param_meta import is_pipeline_duplicate
from lightning_3d.core.saved_tensors import SavedBytes
from lightning_3d.tensor_parallel.spec import get_spec


def peak_memory_mb(device: torch.device) -> float:
    """Peak GPU memory allocated by this process, or its peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def data_parallel_size(trainer: L.Trainer) -> int:
    """How many replicas consume distinct samples (tp/pp peers share theirs)."""
    kwargs = trainer.distributed_sampler_kwargs
    return int(kwargs["num_replicas"]) if kwargs else 1


def model_flops_per_token(module: Any, seq_len: int) -> Optional[float]:
    """Training FLOPs per token of the first model a registered family recognizes inside ``module``
    (its adapter's ``flops_per_token``, from the model's config: the same before and after sharding),
    or ``None`` if no family matches."""
    from lightning_3d.models.adapters.registry import find_models

    found = find_models(module)
    if not found:
        return None
    _, model, adapter = found[0]
    try:
        return float(adapter.flops_per_token(model, seq_len))
    except NotImplementedError:
        return None


def compute_dtype(trainer: L.Trainer) -> torch.dtype:
    """The dtype the matrix multiplies run in, for the peak-FLOPs table."""
    plugin = trainer.precision_plugin
    dtype = getattr(plugin, "compute_dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    from lightning.pytorch.callbacks.throughput_monitor import _plugin_to_compute_dtype

    return _plugin_to_compute_dtype(plugin)


def device_peak_flops(trainer: L.Trainer) -> Optional[float]:
    """Peak FLOP/s of one device for the run's compute dtype from Lightning's table
    (``get_available_flops``); ``None`` on CPU (no well-defined peak) or for an unknown GPU."""
    from lightning.fabric.utilities.throughput import get_available_flops

    device = trainer.strategy.root_device
    if device.type != "cuda":
        return None
    peak = get_available_flops(device, compute_dtype(trainer))
    return float(peak) if peak else None


@dataclass
class _Window:
    """The training steps between two clock reads of :class:`TokenThroughput`."""

    after_warmup: bool = False
    batches: int = 0
    tokens: int = 0
    samples: int = 0
    flops: float = 0.0
    seconds: float = 0.0

    def add(self, tokens: int, samples: int, flops: float) -> None:
        self.batches += 1
        self.tokens += tokens
        self.samples += samples
        self.flops += flops


def writes_logs_now(trainer: L.Trainer) -> bool:
    """Whether Lightning hands this training batch's logged values to the loggers (the optimizer step
    every ``log_every_n_steps``, the step that stops training, every step under ``fast_dev_run``; not
    the micro-batches an accumulating step runs before its last).

    A ``self.log`` call costs far more than the value it records (0.5-1.5 ms of host time on a 2-core
    CPU: Lightning's result collection, a tensor per value): a callback that logs many values every
    step pays that on every step while the loggers keep only one step in ``log_every_n_steps``."""
    module = trainer.lightning_module
    if module is not None and module.automatic_optimization and trainer.fit_loop._should_accumulate():
        return False  # (Lightning writes at the micro-batch that steps: update_train_step_metrics)
    if trainer.fast_dev_run:
        return True
    connector = getattr(trainer, "_logger_connector", None)  # what Lightning's own ThroughputMonitor asks
    return bool(connector.should_update_logs) if connector is not None else True


class TokenThroughput(L.Callback):
    """Logs the global throughput and the model FLOPs utilization at the loggers' cadence.

    Progress bar: ``tokens_per_s`` (all data-parallel replicas together), ``tflops`` (model TFLOP/s
    per device), ``mfu`` (when a peak is known) and ``mem_mb``. Logger, under the names Lightning's
    ``ThroughputMonitor`` uses: ``train/batches_per_sec``, ``train/samples_per_sec``,
    ``train/items_per_sec`` (tokens), ``train/flops_per_sec`` (global), ``train/device/items_per_sec``,
    ``train/device/flops_per_sec`` (global / world size) and ``train/device/mfu``.

    Values are logged on the steps whose logs Lightning writes (``Trainer(log_every_n_steps=...)``), as
    rates over the steps since the previous log: per-step ``self.log`` calls cost more host time than
    a small model's step on a CPU, and the loggers drop the steps in between anyway. The clock is read
    (after a CUDA synchronize) only where a window closes -- a logging step, the end of warm-up, the
    start of validation and the end of each epoch (neither is training time) -- never every step, so the host keeps
    queueing work ahead of the GPU.

    ``peak_flops``: FLOP/s of one device to compute MFU against. ``None`` takes the LightningModule's
    ``peak_flops`` attribute if it has one (the recipe sets it on CPU from the cluster config's
    ``device.peak_tflops``), else Lightning's table for the GPU and compute dtype
    (``get_available_flops``); on CPU there is no well-defined peak, so without either MFU is not
    logged (and :attr:`mfu` is ``None``). The first ``warmup`` steps are excluded from the means
    (:attr:`mean_tokens_per_s`, :attr:`tflops_per_device`, :attr:`mfu`). ``peak_memory_mb`` is the
    maximum over all ranks at the end of fit.
    """

    def __init__(self, warmup: int = 3, peak_flops: Optional[float] = None) -> None:
        self.warmup = warmup
        self.peak_flops_arg = peak_flops
        self.peak_flops: Optional[float] = peak_flops
        self.flops_per_token: Optional[float] = None
        self._seq_len: Optional[int] = None
        self._last: Optional[float] = None  # when the open window started; None: no window open
        self._window = _Window()
        self._tokens = 0
        self._flops = 0.0
        self._seconds = 0.0
        self._steps = 0
        self._world_size = 1
        self.peak_memory_mb: float = 0.0
        self.last_metrics: dict[str, float] = {}  # what the last logging step logged

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._world_size = trainer.world_size
        self.peak_flops = self.peak_flops_arg or getattr(pl_module, "peak_flops", None) or device_peak_flops(trainer)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # (a second fit with this instance warms up, counts its own model's FLOPs and averages afresh; a
        # window a failed fit left open is dropped)
        self._steps, self._tokens, self._flops, self._seconds, self._last = 0, 0, 0.0, 0.0, None
        self._seq_len, self.flops_per_token, self.last_metrics = None, None, {}

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if self._last is None:
            self._synchronize(pl_module)
            self._last = time.perf_counter()
            self._window = _Window(after_warmup=self._steps >= self.warmup)

    @staticmethod
    def _synchronize(pl_module: L.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._last is None:  # (a batch the dataloader gave as None: Lightning skipped its start hook)
            return
        inputs = batch[0] if isinstance(batch, (tuple, list)) else batch
        if not isinstance(inputs, torch.Tensor):
            inputs = None
        dp = data_parallel_size(trainer)
        tokens = inputs.numel() * dp if inputs is not None else 0
        samples = (inputs.shape[0] if inputs.dim() else 1) * dp if inputs is not None else 0
        if inputs is not None and inputs.dim() >= 2 and inputs.shape[-1] != self._seq_len:
            self._seq_len = int(inputs.shape[-1])
            self.flops_per_token = model_flops_per_token(pl_module, self._seq_len)
        flops = tokens * self.flops_per_token if self.flops_per_token is not None else 0.0
        self._steps += 1
        self._window.add(tokens, samples, flops)
        logs = writes_logs_now(trainer)
        # the step that ends training closes here, before the epoch-end hooks of callbacks listed before this one
        closed = None
        if logs or self._steps == self.warmup or trainer.fit_loop.epoch_loop._is_training_done:
            closed = self._close_window(pl_module)
        if not logs or closed is None:
            return
        # CPU tensors: a float is logged as a tensor on the module's device, which Lightning reads back (a
        # device sync) at every later batch's metric update
        pl_module.log("mem_mb", torch.tensor(peak_memory_mb(pl_module.device)), prog_bar=True, on_step=True, on_epoch=False)
        metrics, bar = self._rates(closed)
        if not metrics:
            return
        self.last_metrics = {**metrics, **bar}
        for name, value in bar.items():
            pl_module.log(name, torch.tensor(value), prog_bar=True, on_step=True, on_epoch=False)
        for name, value in metrics.items():
            pl_module.log(name, torch.tensor(value), on_step=True, on_epoch=False)

    def _close_window(self, pl_module: L.LightningModule) -> Optional[_Window]:
        """Reads the clock for the steps since the window opened and returns them (None: no step was
        open); a new window opens at once."""
        if self._last is None or not self._window.batches:
            return None
        self._synchronize(pl_module)
        now = time.perf_counter()
        window, window.seconds = self._window, now - self._last
        if window.after_warmup:
            self._tokens += window.tokens
            self._flops += window.flops
            self._seconds += window.seconds
        self._last, self._window = now, _Window(after_warmup=self._steps >= self.warmup)
        return window

    def _rates(self, window: _Window) -> tuple[dict[str, float], dict[str, float]]:
        """The logger's and the progress bar's values for one closed window (empty without tokens)."""
        if not window.tokens or window.seconds <= 0:
            return {}, {}
        elapsed, world = window.seconds, self._world_size
        metrics = {
            "train/batches_per_sec": window.batches / elapsed,
            "train/samples_per_sec": window.samples / elapsed,
            "train/items_per_sec": window.tokens / elapsed,
            "train/device/items_per_sec": window.tokens / elapsed / world,
        }
        bar = {"tokens_per_s": window.tokens / elapsed}
        if window.flops:
            per_device = window.flops / elapsed / world
            metrics["train/flops_per_sec"] = window.flops / elapsed
            metrics["train/device/flops_per_sec"] = per_device
            bar["tflops"] = per_device / 1e12
            if self.peak_flops:
                metrics["train/device/mfu"] = per_device / self.peak_flops
                bar["mfu"] = per_device / self.peak_flops
        return metrics, bar

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._close_window(pl_module)  # validation time is not training time
        self._last = None

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # before the epoch's checkpoint saves (Lightning runs checkpoint callbacks after the others), and
        # before hooks that stop training late in the step (Timer, EarlyStopping): none is training time
        self._close_window(pl_module)
        self._last = None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._close_window(pl_module)
        self._last = None
        peak = torch.tensor(peak_memory_mb(pl_module.device), dtype=torch.float64, device=pl_module.device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        self.peak_memory_mb = float(peak)

    @property
    def mean_tokens_per_s(self) -> float:
        return self._tokens / self._seconds if self._seconds > 0 else float("nan")

    @property
    def tflops_per_device(self) -> Optional[float]:
        """Mean model TFLOP/s per device after warm-up (``None`` without a FLOP count or steps)."""
        if self.flops_per_token is None or self._seconds <= 0:
            return None
        return self._flops / self._seconds / self._world_size / 1e12

    @property
    def mfu(self) -> Optional[float]:
        """Mean model FLOPs utilization after warm-up; ``None`` without a peak (CPU) or a FLOP count."""
        tflops = self.tflops_per_device
        if tflops is None or not self.peak_flops:
            return None
        return tflops * 1e12 / self.peak_flops


SavedTensorTracker = SavedBytes  # peak bytes autograd keeps for backward, weights excluded (lightning_3d.core.saved_tensors)


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


# -- ModelSummary with global parameter counts -------------------------------------------------------------------------
def global_numel(param: torch.Tensor) -> int:
    """Elements of ``param``'s dense (whole-model) tensor: a tensor-parallel slice counts its full shape
    (its spec's ``full_shape``, vocabulary padding excluded), a DTensor (ZeRO-3) its global shape; the last
    pipeline stage's copy of a weight tied to the first stage's counts 0 (one weight, counted there)."""
    if is_pipeline_duplicate(param):
        return 0
    spec = get_spec(param)
    if spec is not None:
        return math.prod(spec.full_shape)
    return param.numel()  # a DTensor's numel is the global one


def global_parameter_table(module: torch.nn.Module, group: Optional[Any] = None) -> dict[str, tuple[int, bool]]:
    """``{name: (dense elements, trainable)}`` for every parameter of the whole model, gathered over
    ``group``: each pipeline stage contributes its own names; tensor- and data-parallel peers hold the
    same names with the same dense sizes, so the pipeline group (one rank per stage) is enough, and
    each rank receives pp tables, not one per rank of the world (at 10,000 ranks that would be
    gigabytes). ``None``: the default group. A collective over ``group``: every member must call it."""
    mine = {name: (global_numel(p), bool(p.requires_grad)) for name, p in module.named_parameters()}
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return mine
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    table: dict[str, tuple[int, bool]] = {}
    for rank_table in gathered:
        for name, (numel, trainable) in rank_table.items():
            if table.get(name, (0, trainable))[0] == 0:  # a tied duplicate (0) never replaces the counted weight
                table[name] = (numel, trainable)
    return table


def _pipeline_group(model: L.LightningModule) -> Optional[Any]:
    """The pipeline group of the strategy training ``model`` (``None``: the default group)."""
    trainer = getattr(model, "_trainer", None)
    topology = getattr(getattr(trainer, "strategy", None), "_topology", None)
    return topology.pp_group if topology is not None else None


class GlobalSummary(ModelSummary):
    """Lightning's :class:`~lightning.pytorch.utilities.model_summary.ModelSummary` with the whole
    model's parameter counts (:func:`global_parameter_table`) instead of this rank's shards; the same
    numbers as one process would print. Building it is a collective under a process group."""

    def __init__(self, model: L.LightningModule, max_depth: int = 1) -> None:
        self._table = global_parameter_table(model, _pipeline_group(model))
        super().__init__(model, max_depth=max_depth)

    @property
    def param_nums(self) -> list[int]:
        return [
            sum(n for name, (n, _) in self._table.items() if name.startswith(layer + "."))
            for layer in self._layer_summary
        ]

    @property
    def total_parameters(self) -> int:
        return sum(n for n, _ in self._table.values())

    @property
    def trainable_parameters(self) -> int:
        return sum(n for n, trainable in self._table.values() if trainable)


class _GlobalSummaryMixin:
    _max_depth: int

    def _summary(self, trainer: L.Trainer, pl_module: L.LightningModule) -> GlobalSummary:
        return GlobalSummary(pl_module, max_depth=self._max_depth)


class GlobalModelSummary(_GlobalSummaryMixin, ModelSummaryCallback):
    """The ``ModelSummary`` callback printing :class:`GlobalSummary` (computed on every rank, printed by
    rank zero). ``ThreeDParallelStrategy`` puts it in place of Lightning's default one."""


class GlobalRichModelSummary(_GlobalSummaryMixin, RichModelSummary):
    """:class:`GlobalModelSummary` drawn by ``rich`` (Lightning's default when rich is installed)."""


def use_global_model_summary(trainer: L.Trainer) -> None:
    """Make ``trainer``'s ``ModelSummary`` / ``RichModelSummary`` callback (Lightning's default, or one
    the user passed, same settings) print :class:`GlobalSummary`; the user's own subclasses are left
    alone."""
    for callback in trainer.callbacks:
        if type(callback) is ModelSummaryCallback:
            callback.__class__ = GlobalModelSummary
        elif type(callback) is RichModelSummary:
            callback.__class__ = GlobalRichModelSummary
