"""``ThreeDParallelStrategy``: the Lightning glue around topology, gradient sync and friends.

This module only connects Lightning's hooks to the pieces that do the work; it holds no parallel
algorithm itself. Registered as ``"3d"`` when Lightning is imported (``plugins/registration.py``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_3d.checkpoint import AtomicCheckpointIO
from lightning_3d.checkpoint.formats import checkpoint_format as checkpoint_format_for
from lightning_3d.core import STRATEGY_NAME, rank_zero
from lightning_3d.core.config import (
    DEFAULT_BUCKET_MB,
    DEFAULT_TIMEOUT_S,
    KEYWORDS,
    ElasticPolicy,
    ParallelConfig,
    check_accumulation,
    check_world_size_variable,
)
from lightning_3d.core.distributed import share_cpu_threads
from lightning_3d.core.topology import Degree, ParallelDims, Topology, use_topology
from lightning_3d.monitoring.callbacks import use_global_model_summary
from lightning_3d.parallel.parallelize import Parallelized
from lightning_3d.parallel.setup import setup_parallel
from lightning_3d.pipeline.runtime import PipelineRuntime
from lightning_3d.plugins.checkpoint_hooks import CheckpointHooks
from lightning_3d.plugins.checks import empty_stage_error
from lightning_3d.plugins.data_parallel_sync import DataParallelCollectives
from lightning_3d.plugins.fit_hooks import FitHooks
from lightning_3d.plugins.precision import MODES, ThreeDPrecision, adopt_precision
from lightning_3d.plugins.replica_guard import ReplicaGuard
from lightning_3d.plugins.zero_hooks import ZeroHooks
from lightning_3d.resilience.fault import (
    HealthMonitor,
    apply_nccl_watchdog_defaults,
    destroy_process_group_at_exit,
    form_process_group,
    watch_launcher,
)
from lightning_3d.resilience.launch_guard import GuardedMultiProcessingLauncher, GuardedSubprocessScriptLauncher
from lightning_3d.resilience.preemption import PreemptionHandler
from lightning_3d.tensor_parallel.plans import TensorParallelPlan
from lightning_3d.tensor_parallel.random import RNGStatesTracker, agree_on_random_state, seeded_tracker
from lightning_3d.testing import strict_comm
from lightning_3d.zero.coordinator import ZeroCoordinator


class ThreeDParallelStrategy(CheckpointHooks, DataParallelCollectives, FitHooks, ZeroHooks, ParallelStrategy):
    """Data x tensor x pipeline parallel training with ZeRO, behind ``Trainer(strategy=...)``.

    Args:
        data_parallel: replicas of the model; ``"auto"`` uses every rank that tp and pp leave.
        tensor_parallel: ranks that split each layer (Megatron style); stays within a node.
        pipeline_parallel: stages the layer sequence is cut into.
        context_parallel: ranks that split each sequence (load-balanced causal chunks) for long contexts;
            they hold the same weights, so gradients and ZeRO state span data x context parallel.
        context_parallel_mode: ``"ring"`` (K/V blocks passed around the cp ring, overlapped with attention)
            or ``"all_to_all"`` (DeepSpeed-Ulysses: heads sharded over cp for the attention).
        expert_parallel: ranks that split MoE layers' experts, taken from data x context parallel (docs/moe.md).
        zero_stage: 0 (plain data parallel), 1 (optimizer state), 2 (+ gradients), 3 (+ parameters).
        sequence_parallel: shard layer norms/dropout activations along the sequence (needs tp > 1).
        pipeline_schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, ``"zb_h1"``, ``"zb_v"``, ``"dualpipe_v"``.
        micro_batches: micro-batches per step and pipeline; ``None`` picks a divisor of the batch.
        virtual_stages: model chunks per pipeline rank (interleaved 1F1B).
        activation_checkpointing: ``None``, ``"full"`` (recompute whole blocks) or ``"selective"``
            (recompute the attention core only).
        checkpoint_every_n_layers: checkpoint blocks 0, n, 2n, ... (1: every block).
        offload_optimizer: ``None``, ``"cpu"`` or ``"nvme"`` (ZeRO >= 1).
        offload_params: ``None``, ``"cpu"`` or ``"nvme"`` (ZeRO 3).
        nvme_path: directory for NVMe offload files.
        timeout: seconds (or ``timedelta``) any collective may take before the job fails.
        tensor_parallel_plan: module-name patterns -> styles (:mod:`lightning_3d.tensor_parallel.plans`); ``None``
            uses the plan of each model a registered family knows (our GPT, any HF causal LM with a tp plan).
        pipeline_partition: ``"uniform"``, ``"parameters"`` or the block indices where stages 2.. start.
        checkpoint_format: ``"sharded"`` (each rank writes its pieces; loads under any layout) or ``"consolidated"``.
        async_checkpoint: write shards from a background thread (committed at the next save, load or fit's end).
        keep_last_k: keep only the newest k complete checkpoints in a checkpoint directory.
        health_check: a heartbeat watchdog that ends the job, naming the rank, when a peer dies or freezes.
        replica_check_every: check that replicated parameters (tp, tied, dp copies) stay equal every N steps
            and at each checkpoint; ``"auto"``: under 1% of training; ``None``: off (:mod:`~lightning_3d.plugins.replica_guard`).
        bucket_size_mb: size of gradient communication buckets.
        process_group_backend: defaults to ``nccl`` on GPUs and ``gloo`` on CPUs.
        start_method: how Lightning starts local ranks: ``"popen"`` (re-run the script, like ``ddp``),
            or ``"spawn"``/``"fork"``/``"forkserver"``. Ignored under torchrun or SLURM.
        global_batch_size: samples per optimizer step at any data-parallel size: the accumulation is derived (docs/elastic.md).
        elastic: what a restart may change (``ElasticPolicy`` or a dict: ``min_data_parallel``, ``may_change``).
        compile: ``torch.compile`` each block after the layout: ``True``, a backend, or its keywords (docs/compile.md).
    """

    strategy_name = STRATEGY_NAME
    supported_precision = tuple(MODES)  # Trainer(precision=...) values; others are refused before Lightning builds them

    def __init__(
        self,
        data_parallel: Degree = "auto",
        tensor_parallel: int = 1,
        pipeline_parallel: int = 1,
        context_parallel: int = 1,
        context_parallel_mode: str = "ring",
        expert_parallel: int = 1,
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
        bucket_size_mb: float = DEFAULT_BUCKET_MB,
        process_group_backend: Optional[str] = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        global_batch_size: Optional[int] = None,
        elastic: Optional[Union[ElasticPolicy, dict[str, Any]]] = None,
        compile: Union[bool, str, dict[str, Any], None] = False,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        keywords = {name: value for name, value in locals().items() if name in KEYWORDS}  # every keyword above but Lightning's
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io or AtomicCheckpointIO(), precision_plugin=precision_plugin,
        )
        self.config = ParallelConfig(**keywords)  # validated there, before any process starts
        self.config.require_implemented()
        checkpoint = self.config.checkpoint
        self._format = checkpoint_format_for(checkpoint.format, checkpoint.async_save, checkpoint.keep_last_k)
        every = self.config.runtime.replica_check_every
        self._replica_guard = ReplicaGuard(every) if every else None
        self._preemption = PreemptionHandler()
        self._monitor: Optional[HealthMonitor] = None
        self._pipelines: list[PipelineRuntime] = []
        self._rng_tracker: Optional[RNGStatesTracker] = None
        self._process_group_backend = self.config.runtime.process_group_backend
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
            environment = self.cluster_environment
            external = environment is not None and environment.creates_processes_externally  # torchrun / SLURM read it themselves
            check_world_size_variable(None if external else os.environ.get("WORLD_SIZE"), self.num_processes, self.num_nodes)
            self._dims = self.config.check_world(self.num_nodes * self.num_processes, self.num_processes)

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        # Lightning's launchers, whose children end with the launcher (lightning_3d/resilience/launch_guard.py)
        if self.config.runtime.start_method == "popen":
            self._launcher = GuardedSubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = GuardedMultiProcessingLauncher(self, start_method=self.config.runtime.start_method)

    def setup_environment(self) -> None:
        super().setup_environment()
        share_cpu_threads(self.root_device, self.num_processes)
        reset_seed()
        self.set_world_ranks()
        if self.config.runtime.health_check:
            watch_launcher(self.global_rank)  # a rank whose launcher dies ends at once, with one line
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        if self._process_group_backend == "nccl":
            apply_nccl_watchdog_defaults(self.config.runtime.timeout)  # torch's NCCL watchdog + flight recorder; before the group exists
        assert self.cluster_environment is not None
        form_process_group(
            self.cluster_environment, self._process_group_backend, self.config.runtime.timeout, self.root_device,
            nodes=self.num_nodes, per_node=self.num_processes, rank=self.global_rank, node=self.node_rank,
        )
        strict_comm.enable_from_env()  # LIGHTNING_3D_STRICT_COMM=1: fail on CPU where NCCL would
        self._topology = Topology.build(self.parallel_dims, self.root_device)
        base_seed = agree_on_random_state(self._topology, self.root_device)
        self._rng_tracker = seeded_tracker(self.root_device.type, self._topology.tp_rank, self._topology.pp_rank, base_seed)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._topology.mesh
        rank_zero.info(logging.getLogger(__name__), "lightning_3d: %r", self._topology, once=True)
        rank_zero.quiet_deprecations_off_zero()
        destroy_process_group_at_exit()
        if self.config.runtime.health_check and self._monitor is None:
            self._monitor = HealthMonitor(self.config.runtime.timeout)
            self._monitor.start()

    def setup(self, trainer: Trainer) -> None:
        """Lightning's side of set-up around :func:`~lightning_3d.parallel.parallelize.parallelize` (which applies
        the layout in order: plan -> recompute -> pipeline -> precision -> placement -> ZeRO), then the
        optimizers, wrapped by ZeRO."""
        assert self.accelerator is not None and self.model is not None and self._rng_tracker is not None
        check_accumulation(trainer.accumulate_grad_batches)
        self.accelerator.setup(trainer)
        use_global_model_summary(trainer)  # whole-model parameter counts, not this rank's shards
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        precision = self.precision_plugin
        assert isinstance(precision, ThreeDPrecision)

        def build_optimizers(done: Parallelized) -> list[Optimizer]:  # Lightning's configure_optimizers, on this stage
            self.model, self._zero, self._pipelines = done.module, done.zero, done.pipelines  # kept if it raises
            self._setup_optimizers_on_this_stage(trainer)
            return self.optimizers

        done = setup_parallel(
            self.model, self.topology, self.config, precision=precision, device=self.root_device,
            rng_tracker=self._rng_tracker, training=fitting, grad_sync_blocker=self.block_backward_sync,
            build_optimizers=build_optimizers, zero=self._zero, master_weights=self._pending_master,
        )
        self.model, self._zero, self._pipelines = done.module, done.zero, done.pipelines
        if fitting:
            self.optimizers, self._pending_master = done.optimizers, None
        self._point_metrics_at_dp_group()
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self._optimizer_state_device())
            self._install_fit_callbacks(trainer)

    def _setup_optimizers_on_this_stage(self, trainer: Trainer) -> None:
        """``configure_optimizers`` sees only this pipeline stage's parameters; a stage may hold none of
        a group (a middle stage: no embedding, no head), which torch refuses as an empty list."""
        try:
            self.setup_optimizers(trainer)
        except ValueError as err:
            better = empty_stage_error(err, self.topology.pp_rank, self.config.layout.pipeline_parallel)
            if better is None:
                raise
            raise better from err

    @property
    def pipelines(self) -> list[PipelineRuntime]:
        """The pipeline runtimes (per-step busy/idle statistics live in ``runtime.history``)."""
        return self._pipelines

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model()`` runs here: tensor-parallel layers built in it find the tp group."""
        if self._topology is None:
            yield
            return
        with use_topology(self._topology):
            yield

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
