"""``ThreeDParallelStrategy``: the Lightning glue around topology, gradient sync and friends.

This module only connects Lightning's hooks to the pieces that do the work; it holds no
parallel algorithm itself. Registered as ``"3d"`` when :mod:`lightning_3d` is imported.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.optim import Optimizer

from lightning_3d import rank_zero, strict_comm
from lightning_3d.callbacks import use_global_model_summary
from lightning_3d.checkpoint import AtomicCheckpointIO
from lightning_3d.checkpoint.formats import JobState
from lightning_3d.checkpoint.formats import checkpoint_format as checkpoint_format_for
from lightning_3d.checkpoint.manager import ShardedCheckpointer
from lightning_3d.collectives import current_compute_device
from lightning_3d.config import DEFAULT_TIMEOUT_S, ParallelConfig
from lightning_3d.fault import (
    HealthMonitor,
    apply_nccl_watchdog_defaults,
    destroy_process_group_at_exit,
    elastic_attempt_store,
    mark_failed,
    watch_launcher,
)
from lightning_3d.launch_guard import GuardedMultiProcessingLauncher, GuardedSubprocessScriptLauncher, note_checkpoint
from lightning_3d.parallelize import parallelize
from lightning_3d.pipeline.runtime import PipelineRuntime
from lightning_3d.precision import ThreeDPrecision, adopt_precision
from lightning_3d.preemption import PreemptionHandler, TrainingInterrupted
from lightning_3d.replica_guard import ReplicaGuard, parse_every
from lightning_3d.tensor_parallel.plans import TensorParallelPlan
from lightning_3d.tensor_parallel.random import RNGStatesTracker, agree_on_random_state, seed_tracker
from lightning_3d.topology import Degree, ParallelDims, Topology, use_topology
from lightning_3d.zero.buckets import DEFAULT_BUCKET_BYTES
from lightning_3d.zero.coordinator import ZeroCoordinator
from lightning_3d.zero.grad_reducer import GradientReducer
from lightning_3d.zero.memory import memory_report

log = logging.getLogger(__name__)


def _check_checkpoint_dirs_writable(trainer: Trainer) -> None:
    """Every rank writes its pieces of a sharded checkpoint: a directory that cannot be written is
    refused before step 1, not at the first save hours later. One rank per node tries (O(nodes) files
    on a shared filesystem), and the world agrees on the verdict, so every rank stops together."""
    import tempfile

    from lightning.pytorch.callbacks import ModelCheckpoint

    problem = ""
    if getattr(trainer, "local_rank", 0) == 0:
        for callback in getattr(trainer, "callbacks", []):
            directory = getattr(callback, "dirpath", None) if isinstance(callback, ModelCheckpoint) else None
            if not directory or "://" in str(directory):
                continue
            try:
                Path(directory).mkdir(parents=True, exist_ok=True)
                with tempfile.NamedTemporaryFile(dir=directory, prefix=".lightning_3d-write-check-"):
                    pass
            except OSError as err:
                problem = f"ModelCheckpoint(dirpath={str(directory)!r}) cannot be written ({err.strerror or err})"
                break
    rank = getattr(trainer, "global_rank", 0)
    first = rank if problem else None
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        flag = torch.tensor([rank if problem else world], device=current_compute_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        first = int(flag.item()) if int(flag.item()) < world else None
    if first is not None:
        what = problem if problem else f"rank {first} cannot write a ModelCheckpoint directory (see its message)"
        raise PermissionError(
            f"{what} (rank {first}); checkpoints would fail at the first save. Give a directory every node can write."
        )


def _warn_if_sampler_pads(sampler: Any) -> None:
    """A DistributedSampler without drop_last repeats samples so every replica gets as many: the
    epoch then differs from one process's. Say so once, with the numbers."""
    from torch.utils.data import DistributedSampler

    if not isinstance(sampler, DistributedSampler) or sampler.drop_last:
        return
    n, replicas = len(sampler.dataset), sampler.num_replicas  # type: ignore[arg-type]
    if n % replicas:
        rank_zero_warn(
            f"lightning_3d: the training set has {n} samples, which {replicas} data-parallel replicas do not "
            f"divide: the distributed sampler repeats {replicas - n % replicas} of them every epoch (one process "
            f"would not). Use a sample count divisible by {replicas}, or drop the remainder."
        )


class ThreeDParallelStrategy(ParallelStrategy):
    """Data x tensor x pipeline parallel training with ZeRO, behind ``Trainer(strategy=...)``.

    Args:
        data_parallel: replicas of the model; ``"auto"`` uses every rank that tp and pp leave.
        tensor_parallel: ranks that split each layer (Megatron style); stays within a node.
        pipeline_parallel: stages the layer sequence is cut into.
        context_parallel: ranks that split each sequence (load-balanced causal chunks) for long contexts;
            they hold the same weights, so gradients and ZeRO state span data x context parallel.
        context_parallel_mode: ``"ring"`` (K/V blocks passed around the cp ring, overlapped with attention)
            or ``"all_to_all"`` (DeepSpeed-Ulysses: heads sharded over cp for the attention).
        zero_stage: 0 (plain data parallel), 1 (optimizer state), 2 (+ gradients), 3 (+ parameters).
        sequence_parallel: shard layer norms/dropout activations along the sequence (needs tp > 1).
        pipeline_schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, ``"zb_h1"``, ``"zb_v"`` or
            ``"dualpipe_v"`` (docs/pipeline.md).
        micro_batches: micro-batches per step and pipeline; ``None`` picks a divisor of the batch.
        virtual_stages: model chunks per pipeline rank (interleaved 1F1B).
        activation_checkpointing: ``None``, ``"full"`` (recompute whole blocks) or ``"selective"``
            (recompute the attention core only).
        checkpoint_every_n_layers: checkpoint blocks 0, n, 2n, ... (1: every block).
        offload_optimizer: ``None``, ``"cpu"`` or ``"nvme"`` (ZeRO >= 1).
        offload_params: ``None``, ``"cpu"`` or ``"nvme"`` (ZeRO 3).
        nvme_path: directory for NVMe offload files.
        timeout: seconds (or ``timedelta``) any collective may take before the job fails.
        tensor_parallel_plan: module-name patterns -> styles (see :mod:`lightning_3d.tensor_parallel.plans`),
            applied to the LightningModule; ``None`` uses the built-in plan of every model inside it
            that a registered family knows (``lightning_3d.models.adapters``: our GPT, HF GPT-2, any HF causal
            LM whose config carries transformers' ``base_model_tp_plan``).
        pipeline_partition: how layers are cut into stages: ``"uniform"``, ``"parameters"`` or a list of the
            block indices where stages 2.. start.
        checkpoint_format: ``"sharded"`` (a directory, each rank writes its pieces; loads under any layout)
            or ``"consolidated"`` (one dense file, gathered; for small models).
        async_checkpoint: write shards from a background thread; the checkpoint is committed at the next
            checkpoint, at the end of training, or before a load.
        keep_last_k: keep only the newest k complete checkpoints in a checkpoint directory.
        health_check: a heartbeat watchdog that ends the job, naming the rank, when a peer dies or freezes.
        replica_check_every: compare the copies of replicated parameters (tp-replicated norms and biases,
            tied embeddings across stages, dp replicas) every N optimizer steps and at each checkpoint, and
            stop naming them when they differ; ``"auto"`` spaces checks to cost under 1% of training,
            ``None`` turns it off (:mod:`lightning_3d.replica_guard`).
        bucket_size_mb: size of gradient communication buckets.
        process_group_backend: defaults to ``nccl`` on GPUs and ``gloo`` on CPUs.
        start_method: how Lightning starts local ranks: ``"popen"`` (re-run the script, like ``ddp``),
            or ``"spawn"``/``"fork"``/``"forkserver"``. Ignored under torchrun or SLURM.
    """

    strategy_name = "3d"

    def __init__(
        self,
        data_parallel: Degree = "auto",
        tensor_parallel: int = 1,
        pipeline_parallel: int = 1,
        context_parallel: int = 1,
        context_parallel_mode: str = "ring",
        zero_stage: int = 0,
        sequence_parallel: bool = False,
        pipeline_schedule: str = "1f1b",
        micro_batches: Optional[int] = None,
        virtual_stages: int = 1,
        activation_checkpointing: Optional[Union[str, bool]] = None,
        offload_optimizer: Optional[Union[str, bool]] = None,
        offload_params: Optional[Union[str, bool]] = None,
        nvme_path: Optional[str] = None,
        checkpoint_every_n_layers: int = 1,
        timeout: Union[float, int, timedelta, None] = DEFAULT_TIMEOUT_S,
        tensor_parallel_plan: Optional[Union[TensorParallelPlan, dict[str, Any]]] = None,
        pipeline_partition: Union[str, list[int]] = "uniform",
        checkpoint_format: Literal["sharded", "consolidated"] = "sharded",
        async_checkpoint: bool = False,
        keep_last_k: Optional[int] = None,
        health_check: bool = True,
        replica_check_every: Union[int, str, None] = "auto",
        bucket_size_mb: float = DEFAULT_BUCKET_BYTES / 2**20,
        process_group_backend: Optional[str] = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io or AtomicCheckpointIO(),
            precision_plugin=precision_plugin,
        )
        self.config = ParallelConfig(
            data_parallel=data_parallel,
            tensor_parallel=tensor_parallel,
            pipeline_parallel=pipeline_parallel,
            context_parallel=context_parallel,
            context_parallel_mode=context_parallel_mode,
            zero_stage=zero_stage,
            sequence_parallel=sequence_parallel,
            pipeline_schedule=pipeline_schedule,
            micro_batches=micro_batches,
            virtual_stages=virtual_stages,
            activation_checkpointing=activation_checkpointing,
            offload_optimizer=offload_optimizer,
            offload_params=offload_params,
            nvme_path=nvme_path,
            checkpoint_every_n_layers=checkpoint_every_n_layers,
            timeout=timeout,
        )
        self.config.require_implemented()
        if bucket_size_mb <= 0:
            raise ValueError(f"bucket_size_mb={bucket_size_mb!r} is invalid: it must be positive.")
        if start_method not in ("popen", "spawn", "fork", "forkserver"):
            raise ValueError(f"start_method={start_method!r} is invalid: use popen, spawn, fork or forkserver.")
        self._bucket_bytes = int(bucket_size_mb * 2**20)
        self._tp_plan = tensor_parallel_plan
        self._pp_partition = pipeline_partition
        self._format = checkpoint_format_for(checkpoint_format, async_checkpoint, keep_last_k)
        self._health_check = health_check
        self._replica_guard = ReplicaGuard(replica_check_every) if parse_every(replica_check_every) else None
        self._preemption = PreemptionHandler()
        self._monitor: Optional[HealthMonitor] = None
        self._pipelines: list[PipelineRuntime] = []
        self._rng_tracker: Optional[RNGStatesTracker] = None
        self._process_group_backend = process_group_backend
        self._start_method = start_method
        self._num_nodes = 1
        self._dims: Optional[ParallelDims] = None
        self._topology: Optional[Topology] = None
        self._zero: Optional[ZeroCoordinator] = None
        self._pending_master: Optional[dict[int, Tensor]] = None

    # -- Lightning wiring -----------------------------------------------------------------
    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else ThreeDPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        """Lightning hands us the plugin for ``Trainer(precision=...)``; we use ours where we can."""
        self._precision_plugin = adopt_precision(plugin)

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def topology(self) -> Topology:
        if self._topology is None:
            raise RuntimeError("The topology exists only after the processes have started (setup_environment).")
        return self._topology

    @property
    def parallel_dims(self) -> ParallelDims:
        """The resolved degrees (known from Trainer construction on, before processes start)."""
        if self._dims is None:
            raise RuntimeError("The degrees are resolved when the Trainer is constructed.")
        return self._dims

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Samples are split over data-parallel replicas only: tp, pp and cp peers see the same batch
        # (cp peers then keep their chunks of each sequence: lightning_3d/context_parallel/apply.py).
        dims = self.parallel_dims
        coords = dims.coordinates(self.global_rank)
        return {"num_replicas": int(dims.dp), "rank": coords.dp}

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    def set_world_ranks(self) -> None:
        """Called at Trainer construction: this is where a bad layout fails, before any process starts."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank
        if self.num_processes > 0:
            self._check_world_size_variable(self.num_nodes * self.num_processes)
            self._dims = self.config.check_world(self.num_nodes * self.num_processes, self.num_processes)

    def _check_world_size_variable(self, world: int) -> None:
        """A hand-set WORLD_SIZE that disagrees with devices x num_nodes was ignored in silence: the job
        ran at another size than the one asked for. Refused, naming both (launchers set it to the world)."""
        given = os.environ.get("WORLD_SIZE")
        environment = self.cluster_environment
        if given is None or (environment is not None and environment.creates_processes_externally):
            return  # torchrun / SLURM: their environment reads WORLD_SIZE itself
        if not given.isdigit() or int(given) != world:
            raise ValueError(
                f"WORLD_SIZE={given} is set in the environment, but this Trainer starts devices x num_nodes = "
                f"{self.num_processes} x {self.num_nodes} = {world} processes and would ignore it; unset WORLD_SIZE, "
                f"or set devices / num_nodes to match (under torchrun or SLURM their variables decide)."
            )

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        # Lightning's launchers, whose children end with the launcher (lightning_3d/launch_guard.py)
        if self._start_method == "popen":
            self._launcher = GuardedSubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = GuardedMultiProcessingLauncher(self, start_method=self._start_method)

    def setup_environment(self) -> None:
        super().setup_environment()
        self._limit_cpu_threads()
        reset_seed()
        self.set_world_ranks()
        if self._health_check:
            watch_launcher(self.global_rank)  # a rank whose launcher dies ends at once, with one line
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        if self._process_group_backend == "nccl":
            apply_nccl_watchdog_defaults(self.config.timeout)  # torch's NCCL watchdog + flight recorder; before the group exists
        assert self.cluster_environment is not None
        kwargs: dict[str, Any] = {"timeout": self.config.timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        store = elastic_attempt_store(self.config.timeout)
        if store is not None and not _distributed_is_initialized():
            kwargs["store"] = store
        try:
            _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)
        except (RuntimeError, dist.DistError) as err:
            if "timeout" not in str(err).lower() and "timed out" not in str(err).lower():
                raise
            world, per_node = self.num_nodes * self.num_processes, self.num_processes
            cause = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
            raise RuntimeError(
                f"lightning_3d: the job did not form within timeout={self.config.timeout.total_seconds():.0f} s ({cause}): it "
                f"expects {world} ranks (num_nodes={self.num_nodes} x devices={per_node}), and not all of them joined "
                f"{os.environ.get('MASTER_ADDR', 'localhost')}:{os.environ.get('MASTER_PORT', '?')} (this is rank "
                f"{self.global_rank}, node {self.node_rank}). Start the same command on every node (SLURM: srun, or "
                f"torchrun per node), or set num_nodes to the nodes you have."
            ) from None
        strict_comm.enable_from_env()  # LIGHTNING_3D_STRICT_COMM=1: fail on CPU where NCCL would
        self._topology = Topology.build(self.parallel_dims, device_type=self.root_device.type)
        self._rng_tracker = RNGStatesTracker(self.root_device.type)
        base_seed = agree_on_random_state(self._topology, self.root_device)
        seed_tracker(self._rng_tracker, self._topology.tp_rank, self._topology.pp_rank, base_seed)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._topology.mesh
        rank_zero.info(log, "lightning_3d: %r", self._topology, once=True)
        rank_zero.quiet_deprecations_off_zero()
        destroy_process_group_at_exit()
        if self._health_check and self._monitor is None:
            self._monitor = HealthMonitor(self.config.timeout)
            self._monitor.start()

    def _limit_cpu_threads(self) -> None:
        """On CPU, share the cores among the local ranks instead of oversubscribing them."""
        if self.root_device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, self.num_processes)))

    def setup(self, trainer: Trainer) -> None:
        """Lightning's side of set-up around :func:`~lightning_3d.parallelize.parallelize` (which applies
        the layout in order: plan -> recompute -> pipeline -> precision -> placement -> ZeRO), then the
        optimizers, wrapped by ZeRO."""
        assert self.accelerator is not None and self.model is not None and self._rng_tracker is not None
        accumulate = trainer.accumulate_grad_batches
        if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
            raise ValueError(
                f"Trainer(accumulate_grad_batches={accumulate!r}) is invalid: it is the number of batches whose "
                f"gradients make one optimizer step, a whole number >= 1 (1: no accumulation)."
            )
        self.accelerator.setup(trainer)
        use_global_model_summary(trainer)  # whole-model parameter counts, not this rank's shards
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        precision = self.precision_plugin
        assert isinstance(precision, ThreeDPrecision)
        done = parallelize(
            self.model,
            self.topology,
            self.config,
            precision=precision,
            device=self.root_device,
            rng_tracker=self._rng_tracker,
            training=fitting,
            bucket_bytes=self._bucket_bytes,
            grad_sync_blocker=self.block_backward_sync,
            tensor_parallel_plan=self._tp_plan,
            pipeline_partition=self._pp_partition,
            zero=self._zero,
        )
        self.model, self._zero, self._pipelines = done.module, done.zero, done.pipelines
        self._point_metrics_at_dp_group()
        if fitting:
            self._setup_optimizers_on_this_stage(trainer)
            self.optimizers = self._zero.wrap_optimizers(self.model, self.optimizers)
            if self._pending_master:
                self._zero.load_dense_master_weights(self._pending_master)
            self._pending_master = None
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self._optimizer_state_device())
            self._install_fit_callbacks(trainer)

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
        guard.bind(self.model, self.topology, self.config.zero_stage, self._pipelines, self.root_device)

    def _setup_optimizers_on_this_stage(self, trainer: Trainer) -> None:
        """``configure_optimizers`` sees only this pipeline stage's parameters; a stage may hold none of
        a group (a middle stage: no embedding, no head), which torch refuses as an empty list."""
        try:
            self.setup_optimizers(trainer)
        except ValueError as err:
            if "empty parameter list" not in str(err) or self.config.pipeline_parallel == 1:
                raise
            raise ValueError(
                f"{err} on pipeline rank {self.topology.pp_rank} of {self.config.pipeline_parallel}: configure_optimizers "
                f"runs after the model is cut into stages, and this stage holds no parameter of one of its optimizers "
                f"or groups (the embedding and head live on the first and last stage; under a V both on rank 0). Pass "
                f"parameters as groups, e.g. torch.optim.SGD([{{'params': [...]}}], ...), which torch accepts empty."
            ) from err

    def memory_report(self) -> dict[str, Any]:
        """Per-rank bytes of parameters, gradients, master weights and optimizer state, with the
        ZeRO formula for this layout next to them (see :func:`lightning_3d.zero.memory.memory_report`)."""
        assert self.model is not None and self._zero is not None
        return memory_report(self.model, self.optimizers, self._zero, self.topology)

    @property
    def pipelines(self) -> list[PipelineRuntime]:
        """The pipeline runtimes (per-step busy/idle statistics live in ``runtime.history``)."""
        return self._pipelines

    def on_train_start(self) -> None:
        """Before the first step: refuse a batch the configured micro-batch count cannot split, and
        say when the sampler will repeat samples."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        loader = trainer.fit_loop._combined_loader if trainer is not None else None
        loaders = loader.flattened if loader is not None else []
        m = self.config.micro_batches
        if m is not None and self.config.pipeline_parallel > 1:
            for size in [getattr(dl, "batch_size", None) for dl in loaders]:
                self.config.check_batch(size)  # the planner's rule too (layout_rules.batch_refusals)
        for dl in loaders:
            _warn_if_sampler_pads(getattr(dl, "sampler", None))
        if trainer is not None:
            _check_checkpoint_dirs_writable(trainer)

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model()`` runs here: tensor-parallel layers built in it find the tp group."""
        if self._topology is None:
            yield
            return
        with use_topology(self._topology):
            yield

    # -- checkpoints: the format (lightning_3d/checkpoint/formats.py) does the work --------------------
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
        note_checkpoint(checkpoint_path)
        return loaded

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pending = self._format.load_model_state(self._job(), checkpoint, strict=strict)
        if pending is not None:  # the ZeRO optimizers do not exist yet: hand the masters over at set-up
            self._pending_master = pending

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        self._format.load_optimizer_states(self._job(), checkpoint)

    def _optimizer_state_device(self) -> torch.device:
        """Where a plain optimizer's state lives: with its parameters. Under ZeRO-3's CPU offload FSDP2
        keeps the sharded parameters, and runs the step, on the host: state moved to the GPU would
        meet host parameters in the step."""
        zero = self._zero
        if zero is not None and zero.stage == 3 and "cpu" in (zero.offload_optimizer, zero.offload_params):
            return torch.device("cpu")
        return self.root_device

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
                "dp": int(d.dp), "tp": d.tp, "pp": d.pp, "cp": d.cp, "zero_stage": self.config.zero_stage,
                "virtual_stages": self.config.virtual_stages,
            },
            tied=tied,
            rng_tracker=self._rng_tracker,
            checkpoint_io=self.checkpoint_io,
            is_global_zero=self.is_global_zero,
            pipeline_parallel=self.config.pipeline_parallel,
            state_device=self._optimizer_state_device,
            separate_masters_expected=self.precision_plugin.mixed or self.config.offload_optimizer != "none",
        )

    def _pipeline_prefixes(self) -> list[tuple[str, PipelineRuntime]]:
        module = self.lightning_module
        out = []
        for name, sub in module.named_modules() if module is not None else []:
            runtime = getattr(sub, "pipeline_runtime", None)
            if isinstance(runtime, PipelineRuntime):
                out.append((f"{name}." if name else "", runtime))
        return out

    def _point_metrics_at_dp_group(self) -> None:
        """torchmetrics sync over the world by default; tp/pp/cp peers hold copies of the same samples
        (the step code sees whole sequences; only the model's forward splits them over cp)."""
        try:
            from torchmetrics import Metric
        except ImportError:  # pragma: no cover - torchmetrics is a dependency
            return
        assert self.model is not None
        for module in self.model.modules():
            if isinstance(module, Metric) and module.process_group is None:
                module.process_group = self.topology.sample_group

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)
        if self._zero is not None:
            self._zero.module_moved(self.model)  # FSDP2 re-creates its parameters when moved

    # -- gradients ------------------------------------------------------------------------
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

    # -- collectives: logging and metrics reduce over the data-parallel group ------------------
    def _default_group(self, group: Optional[Any], per_sample: bool = False) -> Optional[Any]:
        """dp x cp (every rank holding the same weights: a cp rank's training loss is its tokens'
        share, whose mean over dp x cp is the batch's), or dp alone for per-sample values (sums,
        gathers: cp peers hold copies of the same samples). At cp=1 both are the dp group."""
        if group is not None or self._topology is None:
            return group
        return self._topology.sample_group if per_sample else self._topology.dp_group

    def reduce(
        self, tensor: Union[Tensor, Any], group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean"
    ) -> Union[Tensor, Any]:
        """Reduce over the data-parallel group (tp and pp peers already agree); sums over dp only,
        means over dp x cp (see :meth:`_default_group`)."""
        if isinstance(tensor, Tensor):
            summed = str(reduce_op).lower().endswith("sum")  # "sum", ReduceOp.SUM
            return _sync_ddp_if_available(tensor, self._default_group(group, per_sample=summed), reduce_op=reduce_op)
        return tensor

    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        """Gather from every data-parallel replica (one copy of each sample)."""
        return super().all_gather(tensor, group=self._default_group(group, per_sample=True), sync_grads=sync_grads)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Decisions (early stopping, checkpointing) are agreed by the whole world."""
        if not _distributed_is_initialized():
            return decision
        flag = torch.tensor(int(decision), device=self.root_device)
        dist.all_reduce(flag, op=dist.ReduceOp.SUM)
        return bool(flag == dist.get_world_size()) if all else bool(flag > 0)

    def barrier(self, name: Optional[str] = None) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    # -- lifecycle -----------------------------------------------------------------------------
    def on_exception(self, exception: BaseException) -> None:
        """Name the rank that failed, once for the job: a collective error here usually means a peer died
        (lightning_3d/fault.py: the first failure is claimed in the store; the others print one line)."""
        if isinstance(exception, TrainingInterrupted):
            return  # every rank stopped together at a scheduler's signal, after a checkpoint: not a failure
        mark_failed()
        if self._monitor is not None:
            self._monitor.report(exception)

    def on_train_end(self) -> None:
        self._format.finalize()  # an asynchronous save is committed before fit returns
        precision = self.precision_plugin
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        line = precision.summarize_skipped(trainer.global_step if trainer is not None else 0) if isinstance(precision, ThreeDPrecision) else None
        if line:
            rank_zero.warn(line)

    def teardown(self) -> None:
        self._format.close()
        if self._zero is not None:  # kept: ZeRO-3's sharding stays applied for a later validate/test
            self._zero.remove()
        if self._monitor is not None:
            self._monitor.stop()
            self._monitor = None
        super().teardown()
        if self._zero is not None and self.model is not None:
            self._zero.module_moved(self.model)  # a checkpoint saved after fit must still know the shards
