"""``lightning-3d plan --measure K``: run the planner's top ``K`` layouts here for a few steps and put the
measured step time and model state next to the predicted ones -- the check to make before booking a
cluster, on the machine the plan was made for (issue 37).

Each layout runs our Trainer on CPU processes over gloo (one thread each), with the recipe's model,
optimizer and data (``apps.recipe.build_model`` / ``build_data``). The time is the median optimizer step after a warm-up; a layout whose
micro-batches are not a pipeline's accumulates them (``accumulate_grad_batches``), as a recipe would.
GPU clusters are refused: measure those on the cluster itself.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

from lightning_3d.planner.search import Estimate, Problem

WARMUP_STEPS = 3


def timed_fit(
    strategy: Any, model: Any, data: Any, steps: int, warmup: int, accumulate: int = 1, callbacks: Sequence[Any] = ()
) -> float:
    """Fit ``model`` on ``data`` under ``strategy`` on this world's CPU ranks for ``warmup + steps``
    optimizer steps (no validation, logger, checkpoints, bar or summary; the module's own callbacks
    and ``callbacks`` stay): the median of the ``steps`` after the warm-up. Runs on every rank."""
    import lightning as L
    import torch.distributed as dist

    ends: list[float] = []

    class Clock(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if (batch_idx + 1) % accumulate == 0:  # the last micro-batch of an optimizer step
                ends.append(time.perf_counter())

    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=dist.get_world_size(), max_steps=warmup + steps,
        accumulate_grad_batches=accumulate, limit_val_batches=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[Clock(), *callbacks],
    )
    L.seed_everything(0, verbose=False)
    trainer.fit(model, data)
    return statistics.median(b - a for a, b in zip(ends[warmup - 1 :], ends[warmup:]))


def measure_layout(strategy_kwargs: dict[str, Any], recipe: dict[str, Any], micro_batches: int, steps: int) -> dict[str, float]:
    """Runs on every rank: the recipe's model, optimizer and data (``recipe``: the composed config as a
    plain dict) under ``strategy_kwargs``; the median optimizer step of ``steps`` after
    ``WARMUP_STEPS``, and the most model state this rank holds at once (parameters, gradients, optimizer state)."""
    import lightning as L
    from omegaconf import OmegaConf

    from lightning_3d.apps.recipe import build_data, build_model
    from lightning_3d.plugins.strategy import ThreeDParallelStrategy

    accumulate = 1 if strategy_kwargs.get("pipeline_parallel", 1) > 1 else micro_batches
    cfg = OmegaConf.create(recipe)
    cfg.data.global_batch_size = int(cfg.data.global_batch_size) // accumulate  # per loader batch
    state = {"mb": 0.0}

    class PeakState(L.Callback):
        """The model state at its peak: just before an optimizer step, when this rank holds its gradients
        (ZeRO-2 frees its reduced slice after the step) and, from the second step on, the optimizer state;
        also read at the end, before teardown releases anything. Read in the warm-up only: the
        report walks every tensor, which the timed steps must not pay."""

        def _read(self, trainer: L.Trainer) -> None:
            state["mb"] = max(state["mb"], trainer.strategy.memory_report()["total"] / 2**20)

        def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
            if trainer.global_step < WARMUP_STEPS:
                self._read(trainer)

        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self._read(trainer)

    step_s = timed_fit(
        ThreeDParallelStrategy(**strategy_kwargs), build_model(cfg), build_data(cfg), steps, WARMUP_STEPS, accumulate, [PeakState()]
    )
    return {"step_s": step_s, "model_state_mb": state["mb"]}


def measure(problem: Problem, estimates: list[Estimate], recipe: dict[str, Any], steps: int) -> list[dict[str, Any]]:
    """Each estimate's layout run here: predicted and measured step and model state (rank 0's time, the
    heaviest rank's state), in the estimates' order."""
    from lightning_3d.testing.harness import run_on_ranks

    rows = []
    for estimate in estimates:
        layout = estimate.layout
        kwargs = layout.strategy_kwargs(problem.global_batch, estimate.split_points)
        per_rank = run_on_ranks(
            measure_layout, layout.world, kwargs, recipe, layout.micro_batches(problem.global_batch), steps, timeout=900, strict=False,
        )
        predicted_state = sum(estimate.memory.get(k, 0.0) for k in ("params", "grads", "optimizer")) / 2**20
        state = max(r["model_state_mb"] for r in per_rank)
        rows.append({
            "layout": layout.short(), "ranks": layout.world,
            "predicted_step_s": estimate.step_seconds, "measured_step_s": per_rank[0]["step_s"],
            # the planner counts device memory; with offload the report also counts host state
            "predicted_state_mb": predicted_state, "measured_state_mb": state if layout.offload == "none" else None,
        })
    return rows


def check_measurable(problem: Problem, estimates: list[Estimate], recipe: dict[str, Any]) -> None:
    """Refuse, before anything runs, what cannot be measured here: GPU clusters, a Hugging Face
    checkpoint (the plan is the GPT that ``model.*`` describes), and far more processes than cores."""
    import os

    cluster = problem.cluster
    if cluster.accelerator != "cpu":
        raise ValueError(
            f"--measure runs the layouts here, on CPU processes; cluster {cluster.name!r} is {cluster.world_size} "
            f"{cluster.accelerator.upper()}s. Measure on that cluster, or plan with a profiled one (lightning-3d profile)."
        )
    if recipe.get("model", {}).get("init_from"):
        raise ValueError("--measure trains the GPT that model.* describes, as the plan does; drop model.init_from.")
    cores = os.cpu_count() or 1
    worst = max((e.layout.world for e in estimates), default=1)
    if worst > 4 * cores:
        raise ValueError(f"--measure: a layout needs {worst} processes and this machine has {cores} cores; plan for fewer ranks.")


def format_measured(rows: list[dict[str, Any]]) -> str:
    """The predicted-vs-measured table ``plan --measure`` prints."""
    lines = [f"{'#':>3} {'layout':<40} {'ranks':>5} | {'predicted s':>11} {'measured s':>10} {'error':>6} | {'state MiB':>9} {'measured':>8}"]
    for i, r in enumerate(rows, 1):
        error = r["predicted_step_s"] / r["measured_step_s"] - 1
        measured_state = "-" if r["measured_state_mb"] is None else f"{r['measured_state_mb']:.2f}"
        lines.append(
            f"{i:>3} {r['layout']:<40} {r['ranks']:>5} | {r['predicted_step_s']:>11.4f} {r['measured_step_s']:>10.4f} "
            f"{error:>+6.0%} | {r['predicted_state_mb']:>9.2f} {measured_state:>8}"
        )
    return "\n".join(lines)
