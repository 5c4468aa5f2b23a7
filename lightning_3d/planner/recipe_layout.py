"""From a recipe config to the planner and back: ``parallel=auto`` and the predicted memory of
the layout a recipe runs (for the summary's predicted-vs-measured check)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf, open_dict

from lightning_3d.core.config import ParallelConfig, compile_refusals
from lightning_3d.pipeline.runtime import default_micro_batches
from lightning_3d.planner import Estimate, Layout, Planner, plan, problem_from_config

# ``cfg.parallel`` keys the planner decides (the others -- timeout, nvme_path, ... -- are kept):
# exactly what a layout sets, pipeline split points included.
PLANNED_KEYS = tuple(Layout(dp=1, tp=1, pp=1).strategy_kwargs(global_batch=1, split_points=[1]))
NOT_STRATEGY_KEYS = ("auto", "software")


def strategy_keywords(parallel: DictConfig) -> dict[str, Any]:
    """``cfg.parallel`` without the planner's own keys."""
    out: Any = OmegaConf.to_container(parallel, resolve=True)
    for key in NOT_STRATEGY_KEYS:
        out.pop(key, None)
    return out


def parallel_config(parallel: DictConfig) -> ParallelConfig:
    """The strategy's configuration for ``cfg.parallel`` (validated; not yet checked against what this
    version implements: the strategy and :func:`lightning_3d.apps.recipe.build_config` do that)."""
    return ParallelConfig(**strategy_keywords(parallel))


def apply_auto_layout(cfg: DictConfig) -> tuple[DictConfig, Optional[Estimate]]:
    """With ``parallel.auto: true``, replace the layout keys by the planner's best layout.

    The global batch stays ``data.global_batch_size x trainer.accumulate_grad_batches``; a plan
    with several micro-batches and no pipeline becomes gradient accumulation."""
    if not cfg.parallel.get("auto", False):
        return cfg, None
    cfg = cfg.copy()
    problem = problem_from_config(cfg, software=str(cfg.parallel.get("software", "lightning_3d")))
    global_batch = problem.global_batch
    result = plan(problem)
    compiled = ParallelConfig(compile=cfg.parallel.get("compile", False)).compile.blocks
    usable = [
        e for e in result.ranked
        if (e.layout.offload != "nvme" or cfg.parallel.get("nvme_path"))
        and not compile_refusals(compiled, pp=e.layout.pp, schedule=e.layout.schedule, tp=e.layout.tp, cp=e.layout.cp, ep=e.layout.ep)
    ]
    if not usable:
        raise ValueError(
            f"parallel=auto: no layout fits model={cfg.model} on cluster {cfg.cluster.name}; "
            f"add nodes or use a smaller model (lightning-3d plan ... shows why)."
        )
    return apply_layout(cfg, usable[0], global_batch), usable[0]


def apply_layout(cfg: DictConfig, best: Estimate, global_batch: int) -> DictConfig:
    """``cfg`` running ``best``'s layout (its keys replace the planned ``cfg.parallel`` keys); with
    several micro-batches and no pipeline, gradient accumulation. Modifies and returns ``cfg``."""
    kwargs = best.layout.strategy_kwargs(global_batch, best.split_points)
    m = best.layout.micro_batches(global_batch)
    with open_dict(cfg):
        for key in PLANNED_KEYS:
            cfg.parallel.pop(key, None)
        for key, value in kwargs.items():
            cfg.parallel[key] = value
        if best.layout.pp == 1 and m > 1:
            cfg.trainer.accumulate_grad_batches = m
            cfg.data.global_batch_size = global_batch // m
        else:
            cfg.trainer.accumulate_grad_batches = 1
            cfg.data.global_batch_size = global_batch
    return cfg


def layout_of(cfg: DictConfig, world_size: int) -> Layout:
    """The :class:`Layout` a recipe config runs, read through the strategy's own validation."""
    config = parallel_config(cfg.parallel)
    dims = config.dims.resolve(world_size)
    per_replica = int(cfg.data.global_batch_size) // dims.dp
    m = 1
    if dims.pp > 1:
        m = config.pipeline.micro_batches or default_micro_batches(per_replica, dims.pp, config.pipeline.schedule)
    zero3 = config.sharding.zero_stage == 3
    return Layout(
        dp=dims.dp,
        tp=dims.tp,
        pp=dims.pp,
        micro_batch_size=per_replica // m,
        schedule=config.pipeline.schedule if dims.pp > 1 else "1f1b",
        virtual_stages=config.pipeline.virtual_stages,
        zero_stage=config.sharding.zero_stage,
        sequence_parallel=config.layout.sequence_parallel,
        recompute=str(config.recompute.mode),
        offload=str(config.sharding.offload_params if zero3 else config.sharding.offload_optimizer),
        cp=dims.cp,
        context_parallel_mode=str(config.layout.context_parallel_mode),
        ep=dims.ep,
    )


def predicted_memory(cfg: DictConfig, world_size: int) -> dict[str, float]:
    """Bytes per device the planner predicts for the layout ``cfg`` runs (max over stages)."""
    layout = layout_of(cfg, world_size)
    problem = problem_from_config(cfg)
    if problem.cluster.world_size != world_size:  # e.g. cluster.devices_per_node overridden to 2
        problem = replace(problem, cluster=replace(problem.cluster, devices_per_node=world_size, num_nodes=1))
    return Planner(problem).evaluate(layout).memory
