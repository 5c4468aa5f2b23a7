"""From a recipe config to the planner and back: ``parallel=auto`` and the predicted memory of
the layout a recipe runs (for the summary's predicted-vs-measured check)."""

from __future__ import annotations

from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf, open_dict

from lightning_3d.pipeline.runtime import default_micro_batches
from lightning_3d.planner import Estimate, Layout, Planner, plan, problem_from_config

# ``cfg.parallel`` keys the planner decides; the others (timeout, nvme_path, ...) are kept.
PLANNED_KEYS = (
    "data_parallel",
    "tensor_parallel",
    "pipeline_parallel",
    "zero_stage",
    "sequence_parallel",
    "pipeline_schedule",
    "micro_batches",
    "virtual_stages",
    "activation_checkpointing",
    "offload_optimizer",
    "offload_params",
    "pipeline_partition",
)
NOT_STRATEGY_KEYS = ("auto", "software")


def strategy_keywords(parallel: DictConfig) -> dict[str, Any]:
    """``cfg.parallel`` without the planner's own keys."""
    out: Any = OmegaConf.to_container(parallel, resolve=True)
    for key in NOT_STRATEGY_KEYS:
        out.pop(key, None)
    return out


def apply_auto_layout(cfg: DictConfig) -> tuple[DictConfig, Optional[Estimate]]:
    """With ``parallel.auto: true``, replace the layout keys by the planner's best layout.

    The global batch stays ``data.global_batch_size x trainer.accumulate_grad_batches``; a plan
    with several micro-batches and no pipeline becomes gradient accumulation."""
    if not cfg.parallel.get("auto", False):
        return cfg, None
    cfg = cfg.copy()
    accumulate = int(cfg.trainer.get("accumulate_grad_batches", 1) or 1)
    global_batch = int(cfg.data.global_batch_size) * accumulate
    result = plan(problem_from_config(cfg, software=str(cfg.parallel.get("software", "lightning_3d")), global_batch=global_batch))
    usable = [e for e in result.ranked if e.layout.offload != "nvme" or cfg.parallel.get("nvme_path")]
    if not usable:
        raise ValueError(
            f"parallel=auto: no layout fits model={cfg.model} on cluster {cfg.cluster.name}; "
            f"add nodes or use a smaller model (lightning-3d plan ... shows why)."
        )
    best = usable[0]
    kwargs = best.layout.strategy_kwargs(global_batch, int(cfg.model.n_layer), best.split_points)
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
    return cfg, best


def layout_of(cfg: DictConfig, world_size: int) -> Layout:
    """The :class:`Layout` a recipe config runs, resolved against the world size."""
    par = cfg.parallel
    tp, pp = int(par.tensor_parallel), int(par.pipeline_parallel)
    dp = world_size // (tp * pp) if par.data_parallel in (None, "auto") else int(par.data_parallel)
    per_replica = int(cfg.data.global_batch_size) // dp
    schedule = str(par.get("pipeline_schedule", "1f1b")).replace("interleaved", "interleaved_1f1b").replace("_1f1b_1f1b", "_1f1b")
    if pp > 1:
        m = int(par.micro_batches) if par.get("micro_batches") else default_micro_batches(per_replica, pp, schedule)
    else:
        m = 1
    recompute = par.get("activation_checkpointing") or "none"
    offload = par.get("offload_params") if int(par.zero_stage) == 3 else par.get("offload_optimizer")
    return Layout(
        dp=dp,
        tp=tp,
        pp=pp,
        micro_batch_size=per_replica // m,
        schedule=schedule if pp > 1 else "1f1b",
        virtual_stages=int(par.get("virtual_stages", 1) or 1),
        zero_stage=int(par.zero_stage),
        sequence_parallel=bool(par.get("sequence_parallel", False)),
        recompute="full" if recompute is True else str(recompute),
        offload=str(offload or "none"),
    )


def predicted_memory(cfg: DictConfig, world_size: int) -> dict[str, float]:
    """Bytes per device the planner predicts for the layout ``cfg`` runs (max over stages)."""
    accumulate = int(cfg.trainer.get("accumulate_grad_batches", 1) or 1)
    layout = layout_of(cfg, world_size)
    problem = problem_from_config(cfg, global_batch=int(cfg.data.global_batch_size) * accumulate)
    if problem.cluster.world_size != world_size:
        from dataclasses import replace

        problem = replace(problem, cluster=replace(problem.cluster, devices_per_node=world_size, num_nodes=1))
    # one loader batch is one micro-batch group; accumulation repeats it
    layout = Layout(**{**layout.__dict__})
    return Planner(problem).evaluate(layout).memory
