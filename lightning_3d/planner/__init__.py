"""The 3D planner: which (dp, tp, pp) layout and options to train a model with on a cluster.

    from lightning_3d.planner import plan_from_config
    result = plan_from_config(cfg)          # a composed Hydra config: model, cluster, data, trainer
    best = result.ranked[0]                 # an Estimate: layout, memory breakdown, step time, MFU

Command line: ``lightning-3d plan model=bloom_176b cluster=jean_zay_bloom`` (see docs/planner.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from lightning_3d.core.model_shape import ModelShape
from lightning_3d.planner.hardware import ClusterSpec, DeviceSpec, load_cluster, with_nodes
from lightning_3d.planner.memory import (
    ActivationOptions,
    activation_bytes,
    activations_in_flight,
    layer_activation_bytes,
    zero_model_state_bytes,
)
from lightning_3d.planner.search import (
    SOFTWARE,
    Estimate,
    Layout,
    Planner,
    Problem,
    Software,
    best_completion,
    rank,
)

__all__ = [
    "ActivationOptions",
    "ClusterSpec",
    "DeviceSpec",
    "Estimate",
    "Layout",
    "ModelShape",
    "PlanResult",
    "Planner",
    "Problem",
    "SOFTWARE",
    "Software",
    "activation_bytes",
    "activations_in_flight",
    "best_completion",
    "layer_activation_bytes",
    "load_cluster",
    "plan",
    "plan_from_config",
    "problem_from_config",
    "rank",
    "with_nodes",
    "zero_model_state_bytes",
]

PLANNER_PRECISION = {"bf16-mixed": "bf16-mixed", "16-mixed": "16-mixed", "32-true": "32-true", "bf16-true": "bf16-mixed"}


@dataclass
class PlanResult:
    problem: Problem
    ranked: list[Estimate]  # feasible, fastest first (best per (dp, tp, pp) unless all_layouts)
    searched: int  # layouts estimated
    seconds: float  # search time


def problem_from_config(
    cfg: DictConfig,
    software: str = "lightning_3d",
    global_batch: Optional[int] = None,
    seq_len: Optional[int] = None,
    nodes: Optional[int] = None,
    precision: Optional[str] = None,
    cross_node_tp: bool = False,
    expert_imbalance: float = 1.0,
) -> Problem:
    """The planning problem a composed recipe config describes (model, cluster, precision, and the
    global batch: ``data.global_batch_size x trainer.accumulate_grad_batches`` sequences per step)."""
    if software not in SOFTWARE:
        raise ValueError(f"software={software!r}: choose one of {sorted(SOFTWARE)}.")
    model_cfg: Any = OmegaConf.to_container(cfg.model, resolve=True)
    cluster = with_nodes(load_cluster(cfg.cluster), nodes)
    accumulate = int(cfg.trainer.get("accumulate_grad_batches", 1) or 1)
    batch = global_batch or int(cfg.data.global_batch_size) * accumulate
    trainer_precision = str(precision or cfg.trainer.get("precision", "bf16-mixed"))
    if trainer_precision not in PLANNER_PRECISION:
        raise ValueError(f"precision={trainer_precision!r}: the planner knows {sorted(PLANNER_PRECISION)}.")
    return Problem(
        model=ModelShape.from_config(model_cfg, seq_len=seq_len),
        cluster=cluster,
        global_batch=batch,
        software=SOFTWARE[software],
        precision=PLANNER_PRECISION[trainer_precision],
        cross_node_tp=cross_node_tp,
        expert_imbalance=expert_imbalance,
    )


def plan(problem: Problem, all_layouts: bool = False) -> PlanResult:
    import time

    start = time.perf_counter()
    planner = Planner(problem)
    estimates = planner.search()
    ranked = rank(estimates, distinct_degrees=not all_layouts)
    return PlanResult(problem, ranked, len(estimates), time.perf_counter() - start)


def plan_from_config(cfg: DictConfig, **kwargs: Any) -> PlanResult:
    return plan(problem_from_config(cfg, **kwargs))
