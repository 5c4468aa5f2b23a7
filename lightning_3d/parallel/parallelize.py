"""``parallelize``: the one place that turns a dense model into this rank's part of the layout.

The order is fixed and matters (DESIGN.md, "One training step"):

1. check the layout against the models' shapes (every reason at once, before anything is sharded);
2. tensor-parallel plan (built-in plans of the models found, or the user's plan);
3. context parallelism: the models' positions and attention (through their families' adapters);
4. regional compilation (each block, after TP and CP replaced its layers; their collectives stay
   eager) and activation checkpointing (wraps whole blocks or their attention, after TP replaced
   the layers; a full recompute reruns the compiled block);
5. pipeline split (keep this stage's blocks; the runtime takes over the forward);
6. loss normalization over data x context parallel (pp == 1: the pipeline runtime weighs its
   micro-batches) and a family's router loss from the whole batch's statistics, then the
   context-parallel input split around it all (outermost);
7. precision dtype;
8. materialize (the seam for meta-device models), device placement and replica sync;
9. expert parallelism, of ``lightning_3d.moe`` layers and of a family's own MoE blocks (each rank
   keeps its experts: after the sync, so every slice is cut from
   the same whole model, and before ZeRO, which shards the slices over their expert replicas);
10. ZeRO (stage 0's reducer, stages 1-2's flat buffers, stage 3's ``fully_shard``).

Each step is a small function, usable alone (tests, benchmarks). The strategy calls
:func:`parallelize` from its ``setup`` and keeps only Lightning's wiring around it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
from torch import nn

from lightning_3d.checkpoint.pretrained import has_pretrained, load_pretrained_, pretrained_models
from lightning_3d.context_parallel.apply import ContextParallel, shard_inputs, unshard_inputs
from lightning_3d.core import rank_zero
from lightning_3d.core.config import ParallelConfig
from lightning_3d.core.distributed import broadcast_module_state
from lightning_3d.core.topology import Topology
from lightning_3d.models.adapters.base import model_parallel_degrees
from lightning_3d.models.adapters.registry import find_models, find_sequences, known_names, models_in
from lightning_3d.moe.expert_parallel import apply_expert_parallel
from lightning_3d.moe.layer import MoE, bind_sequence_group
from lightning_3d.pipeline.runtime import PipelineConfig, PipelineRuntime, pipeline_model
from lightning_3d.tensor_parallel.plans import PARALLEL_LAYERS, PlanContext, TensorParallelPlan, apply_plan
from lightning_3d.tensor_parallel.random import RNGStatesTracker
from lightning_3d.tensor_parallel.replicas import broadcast_tensor_parallel_replicas
from lightning_3d.transforms.activation_checkpointing import attention_of, check_mode, checkpoint_blocks
from lightning_3d.transforms.compile import compile_blocks
from lightning_3d.transforms.loss_normalization import normalize_over_data_parallel
from lightning_3d.zero.coordinator import ZeroCoordinator

if TYPE_CHECKING:
    from lightning_3d.plugins.precision import ThreeDPrecision

log = logging.getLogger(__name__)

UserPlan = Union[TensorParallelPlan, dict[str, Any], None]


@dataclass
class Parallelized:
    """What the strategy keeps of set-up: the (possibly replaced) root module, the pipeline runtimes
    (one per pipelined model) and the ZeRO coordinator that owns gradients and optimizer wrapping."""

    module: nn.Module
    zero: ZeroCoordinator
    pipelines: list[PipelineRuntime] = field(default_factory=list)


def parallelize(
    module: nn.Module,
    topology: Topology,
    config: ParallelConfig,
    *,
    precision: ThreeDPrecision,
    device: torch.device,
    rng_tracker: RNGStatesTracker,
    training: bool,
    grad_sync_blocker: Callable[[], AbstractContextManager[Any]],
    zero: Optional[ZeroCoordinator] = None,
) -> Parallelized:
    """Apply the layout to ``module`` (the LightningModule) in place, in the order above.

    Args:
        precision: the strategy's ``ThreeDPrecision`` (dtype policy; its loss scale reaches the pipeline).
        training: fitting (loss normalization applies only to training).
        grad_sync_blocker: a context that suspends gradient communication (the pipeline runs many
            backwards per step and must reduce once).
        zero: the coordinator of an earlier set-up of the same module (``validate`` after ``fit``).
    """
    # the layout rules the planner uses too, on the models' shapes: every reason at once, before any sharding
    user_plan: UserPlan = config.layout.tensor_parallel_plan  # None: the built-in plans of the models found
    config.check_models(models_in(module), tensor_parallel_plan=user_plan is None)
    refuse_foreign_experts(module, config)
    remove_context_parallel(module)  # an earlier set-up's (validate before fit): rebuilt below, in order
    moe_layers = moe_layer_count(module)  # (before the pipeline keeps this stage's)
    if config.layout.tensor_parallel > 1:
        apply_tensor_parallel(module, topology, config, rng_tracker, user_plan)
    cp = context_parallel_of(topology, config)
    if cp is not None:
        apply_context_parallel(module, cp)
    if config.compile.enabled:
        apply_compile(module, config.compile.blocks)
    if config.recompute.mode != "none":
        apply_activation_checkpointing(module, config.recompute.mode, config.recompute.every_n_layers, rng_tracker)
    pipelines: list[PipelineRuntime] = []
    if config.layout.pipeline_parallel > 1:
        pipelines = apply_pipeline(
            module, topology, config,
            grad_sync_blocker=grad_sync_blocker,
            rng_tracker=rng_tracker,
            loss_scale=lambda: precision.scaler.scale if getattr(precision, "scaler", None) else 1.0,
        )
    if training and config.layout.pipeline_parallel == 1:  # (the pipeline runtime weighs its micro-batches itself)
        for _, model, sequence, _ in find_sequences(module):
            normalize_over_data_parallel(model, sequence, topology.dp_group)
        for _, model, adapter in find_models(module):  # (a router loss from batch statistics: the whole batch's)
            adapter.average_router_loss(model, topology.dp_group, config.layout.context_parallel)
    if cp is not None:
        for _, model, sequence, _ in find_sequences(module):
            shard_inputs(model, sequence, cp)
    precision.topology, precision.device_type = topology, device.type
    module = precision.convert_module(module)
    on_meta = _materialize(module, config, device)
    if not on_meta:  # a meta model is materialized shard by shard by ZeRO-3 below
        module.to(device)
        if zero is not None:
            zero.module_moved(module)  # FSDP2 re-creates its parameters when moved
        synchronize_replicas(module, topology, pipelines, device)
    apply_expert_parallelism(module, topology, model_has_experts=moe_layers > 0, sequence_parallel=config.layout.sequence_parallel)
    if zero is None:
        zero = ZeroCoordinator(
            config.sharding.zero_stage,
            topology,
            precision.compute_dtype,
            precision.master_dtype,
            config.sharding.bucket_bytes,
            offload_optimizer=config.sharding.offload_optimizer,
            offload_params=config.sharding.offload_params,
            nvme_path=config.sharding.nvme_path,
        )
    zero.prepare_module(module, device, initialize=_pretrained_initializer(module, device))
    if on_meta:  # each rank initialized its own chunks: tp peers' replicated chunks (and buffers) must agree
        synchronize_replicas(module, topology, pipelines, device)
    return Parallelized(module=module, zero=zero, pipelines=pipelines)


def context_parallel_of(topology: Topology, config: ParallelConfig) -> Optional[ContextParallel]:
    """This rank's :class:`ContextParallel` (``None`` at context_parallel=1)."""
    if config.layout.context_parallel == 1:
        return None
    return ContextParallel(
        topology.cp_group,
        topology.cp_size,
        topology.cp_rank,
        config.layout.context_parallel_mode,
        split_after=config.layout.tensor_parallel if config.layout.sequence_parallel else 1,
    )


def remove_context_parallel(root: nn.Module) -> None:
    """Undo an earlier set-up's context parallelism on the models inside ``root`` (input split and
    seams), so that the next set-up (``fit`` after ``validate``, another layout) rebuilds its
    wrappers in order: the loss normalization it may add must sit inside the input split."""
    for _, model, _, adapter in find_sequences(root):
        if unshard_inputs(model) and adapter is not None:
            adapter.context_parallel(model, None)
    bind_sequence_group(root, None)


def apply_context_parallel(root: nn.Module, cp: ContextParallel) -> int:
    """Give every model with a layer sequence inside ``root`` context-parallel attention and positions
    (through its family's adapter); returns how many models. The input wrapper comes later
    (``shard_inputs``), outside the loss normalization and the pipeline runtime."""
    found = find_sequences(root)
    if not found:
        raise ValueError(
            f"context_parallel={cp.size} found no model with a layer sequence in {type(root).__name__} (model families: "
            f"{known_names()}); build the model in configure_model(), or use context_parallel=1."
        )
    for name, model, _, adapter in found:
        if adapter is None:
            raise NotImplementedError(
                f"context_parallel={cp.size}: model {name or type(model).__name__!r} declares its own layer sequence, but "
                f"no model family adapter says where its positions and attention are, which context parallelism must "
                f"replace; use a registered family ({known_names()}) or context_parallel=1."
            )
        adapter.context_parallel(model, cp)
    bind_sequence_group(root, cp.group)
    return len(found)


def refuse_foreign_experts(root: nn.Module, config: ParallelConfig) -> None:
    """A model with experts that are not ``lightning_3d.moe`` layers (a Hugging Face MoE family runs
    transformers' own) is split only where its family's adapter knows how (transformers' stacked
    experts: :mod:`~lightning_3d.models.adapters.hf_moe`); anything else is refused here, naming why,
    before anything is sharded."""
    if not model_parallel_degrees(config.layout):
        return
    for name, model, adapter in find_models(root):
        experts = getattr(adapter.dims(model), "n_experts", 0)
        if not experts or any(isinstance(m, MoE) for m in model.modules()):
            continue
        why = adapter.expert_refusal(model, config.layout) if adapter.moe_blocks(model) else (
            f"its experts are not in blocks lightning_3d recognizes (a router 'gate' next to stacked 'experts') and the "
            f"{adapter.name!r} adapter does not split them; set {', '.join(model_parallel_degrees(config.layout))} to 1"
        )
        if why:
            raise NotImplementedError(
                f"model {name or type(model).__name__!r} has mixture-of-experts layers (n_experts={experts}): {why}."
            )


def moe_layer_count(root: nn.Module) -> int:
    """MoE layers in ``root``: ``lightning_3d.moe`` layers and the model families' own blocks."""
    own = sum(len(adapter.moe_blocks(model)) for _, model, adapter in find_models(root))
    return own + sum(isinstance(m, MoE) for m in root.modules())


def apply_expert_parallelism(
    root: nn.Module, topology: Topology, model_has_experts: Optional[bool] = None, sequence_parallel: bool = False
) -> int:
    """Split the experts of every ``lightning_3d.moe`` layer in ``root`` over the expert group and the
    tensor-parallel ranks (a no-op at expert_parallel=1, tensor_parallel=1); returns how many layers
    this rank holds. Under a pipeline a stage may hold none: ``model_has_experts`` (counted before
    the split, the same on every rank) decides whether a model without any is refused, so that
    every rank raises or none does; ``None``: this rank's layers decide (no pipeline)."""
    if topology.ep_size == 1 and topology.dims.tp == 1:
        return 0
    tp = topology.tp_group if topology.dims.tp > 1 else None
    split = dict(
        group=topology.expert_group, replica_mesh=topology.expert_replica_mesh, tp_group=tp, owners=topology.expert_tensor_group(),
        sequence_parallel=sequence_parallel,
    )
    found = apply_expert_parallel(root, **split)
    found += sum(adapter.apply_expert_parallel(model, **split) for _, model, adapter in find_models(root))
    anywhere = bool(found) if model_has_experts is None else model_has_experts
    if not anywhere and topology.ep_size > 1:
        raise NotImplementedError(
            f"expert_parallel={topology.ep_size} found no mixture-of-experts layer in {type(root).__name__}: expert "
            f"parallelism splits the experts of lightning_3d's MoE layers (the reference GPT with n_experts) and of "
            f"Hugging Face MoE families (transformers' stacked experts). Use expert_parallel=1."
        )
    return found


def _materialize(module: nn.Module, config: ParallelConfig, device: torch.device) -> bool:
    """Where a model built on the meta device gets real memory, before ZeRO.

    A model from :func:`lightning_3d.from_pretrained` is allocated on ``device`` and filled here at
    ZeRO stages 0-2: after the plan, recompute and pipeline split, so each rank reads only its
    slices of its stage's weights. Returns True when the model stays on the meta device for ZeRO-3
    to materialize shard by shard (``ZeroCoordinator.prepare_module``: random init, or the
    pretrained weights of each rank's chunks); any other stage refuses a meta model -- unless the
    target device is the meta device itself: a dry run (:mod:`lightning_3d.apps.dry_run`) sets up every
    stage on meta tensors, and the model stays there.
    """
    on_meta = any(p.is_meta for p in module.parameters())
    if on_meta and config.sharding.zero_stage != 3 and has_pretrained(module):
        load_pretrained_(module, device)
        on_meta = any(p.is_meta for p in module.parameters())
    if on_meta and config.sharding.zero_stage != 3 and device.type != "meta":
        raise ValueError(
            f"the model was built on the meta device, which only zero_stage=3 materializes (shard by shard); "
            f"got zero_stage={config.sharding.zero_stage}. Build it on a real device, or use zero_stage=3."
        )
    return on_meta


def _pretrained_initializer(module: nn.Module, device: torch.device) -> Optional[Callable[[], list[nn.Module]]]:
    """ZeRO-3: what fills a ``from_pretrained`` model's shards instead of ``reset_parameters()``
    (returning the models it filled: modules outside them are still reset)."""
    if not has_pretrained(module):
        return None

    def load_pretrained_weights() -> list[nn.Module]:
        load_pretrained_(module, device)
        return pretrained_models(module)

    return load_pretrained_weights


def apply_tensor_parallel(
    root: nn.Module, topology: Topology, config: ParallelConfig, rng_tracker: RNGStatesTracker, plan: UserPlan = None
) -> None:
    """The user's plan on ``root``, or the built-in plan of every known model inside it."""
    ctx = PlanContext(topology.tp_group, config.layout.sequence_parallel, rng_tracker)
    if plan is not None:
        apply_plan(root, plan if isinstance(plan, TensorParallelPlan) else TensorParallelPlan(styles=dict(plan)), ctx)
        return
    found = find_models(root)
    if not found and not any(isinstance(m, PARALLEL_LAYERS) for m in root.modules()):
        raise ValueError(
            f"tensor_parallel={config.layout.tensor_parallel}, but {type(root).__name__} contains no model with a "
            f"built-in plan (model families: {known_names()}) and no tensor-parallel layers. {_plan_hint(root)}"
        )
    for _, model, adapter in found:
        apply_plan(model, adapter.tp_plan(model), ctx)


def _plan_hint(root: nn.Module) -> str:
    """How to give a plan for the model at hand: its linear layers as plan patterns (layer indices as ``*``)."""
    patterns = list(dict.fromkeys(
        ".".join("*" if part.isdigit() else part for part in name.split("."))
        for name, m in root.named_modules() if isinstance(m, nn.Linear)
    ))
    if not patterns:
        return (
            "It has no linear layers yet: build the model in __init__ or configure_model(), then pass "
            "ThreeDParallelStrategy(tensor_parallel_plan={module pattern: style}) (docs/tensor_parallel.md)."
        )
    shown = ", ".join(f"'{p}': ..." for p in patterns[:6]) + (", ..." if len(patterns) > 6 else "")
    return (
        f"Pass ThreeDParallelStrategy(tensor_parallel_plan={{{shown}}}) with a style for each layer to split ('column' "
        f"for q/k/v and MLP inputs, 'row' for the attention and MLP outputs, 'vocab' / 'vocab_head' for the embedding "
        f"and head; docs/tensor_parallel.md), or register an adapter for the model's family "
        f"(lightning_3d.models.adapters.register_adapter)."
    )


def apply_pipeline(
    root: nn.Module,
    topology: Topology,
    config: ParallelConfig,
    *,
    grad_sync_blocker: Callable[[], AbstractContextManager[Any]] = nullcontext,
    rng_tracker: Optional[RNGStatesTracker] = None,
    loss_scale: Callable[[], Any] = lambda: 1.0,
) -> list[PipelineRuntime]:
    """Cut every pipelinable model inside ``root`` into this rank's stage; returns their runtimes."""
    found = find_sequences(root)
    if not found:
        raise ValueError(
            f"pipeline_parallel={config.layout.pipeline_parallel}, but {type(root).__name__} contains no model the "
            f"pipeline can split (model families: {known_names()}). Give your model a "
            f"`pipeline_sequence()` method returning a lightning_3d.pipeline.LayerSequence (from lightning_3d.pipeline "
            f"import LayerSequence)."
        )
    for name, model, _, adapter in found:
        why = adapter.pipeline_refusal(model) if adapter is not None and not callable(getattr(model, "pipeline_sequence", None)) else None
        if why:
            raise ValueError(f"pipeline_parallel={config.layout.pipeline_parallel}: {why}")
    pipeline_config = PipelineConfig(
        schedule=config.pipeline.schedule,
        virtual_stages=config.pipeline.virtual_stages,
        micro_batches=config.pipeline.micro_batches,
        partition=config.pipeline.partition,
    )
    runtimes = [
        pipeline_model(
            model, sequence, topology, pipeline_config,
            grad_sync_blocker=grad_sync_blocker, rng_tracker=rng_tracker, loss_scale=loss_scale,
        )
        for _, model, sequence, _ in found
    ]
    for runtime in runtimes:
        rank_zero.info(log, "lightning_3d pipeline layout:\n%s", runtime.layout, once=True)  # the same on every rank
    return runtimes


def apply_activation_checkpointing(
    root: nn.Module, mode: str, every_n_layers: int = 1, tracker: Optional[RNGStatesTracker] = None
) -> int:
    """Checkpoint the blocks of every model with a layer sequence inside ``root`` (``"selective"``:
    their family's recompute target); returns how many modules now recompute."""
    check_mode(mode, every_n_layers)
    found = find_sequences(root)
    if not found:
        raise ValueError(
            f"activation_checkpointing={mode!r} found no model with a layer sequence in {type(root).__name__} "
            f"(model families: {known_names()}; or a model with pipeline_sequence())."
        )
    count = 0
    for _, _, sequence, adapter in found:
        target = adapter.recompute_target if adapter is not None else attention_of
        count += checkpoint_blocks(sequence.blocks, mode, every_n_layers, tracker, target)
    return count


def apply_compile(root: nn.Module, options: dict[str, Any]) -> int:
    """``torch.compile(**options)`` on each block of every model with a layer sequence inside ``root``;
    returns how many blocks."""
    found = find_sequences(root)
    if not found:
        raise ValueError(
            f"compile={options!r} compiles each transformer block, and found no model with a layer sequence in "
            f"{type(root).__name__} (model families: {known_names()}; or a model with pipeline_sequence()). Use "
            f"compile=False and call torch.compile on your model yourself in configure_model()."
        )
    if options.get("fullgraph") and moe_layer_count(root):
        raise ValueError(
            f"compile={options!r}: fullgraph=True, but the model has mixture-of-experts layers, which run eagerly (their "
            f"routing decides the expert exchange's sizes), so a block cannot be one graph; use fullgraph=False."
        )
    return sum(compile_blocks(sequence.blocks, options) for _, _, sequence, _ in found)


def synchronize_replicas(module: nn.Module, topology: Topology, pipelines: list[PipelineRuntime], device: torch.device) -> None:
    """Every copy of one weight starts equal, whatever the user seeded on each rank: tensors that
    tensor-parallel ranks hold whole come from tp rank 0, the last pipeline stage's copy of a tied
    embedding from the first stage, and each model replica from data-parallel rank 0."""
    broadcast_tensor_parallel_replicas(module, topology.tp_group, src=topology.tp_source_rank(), device=device)
    for runtime in pipelines:
        runtime.broadcast_tied()
    broadcast_module_state(module, topology.dp_group, src=topology.dp_source_rank(), device=device)
