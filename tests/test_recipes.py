"""Named recipes: the full-size ones plan and validate against their clusters; their CPU-size
variants train on 8 CPU ranks, with the planner's per-rank memory prediction checked against the
run's measurement; ``parallel=auto`` trains with the planner's choice; SLURM submission composes."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from lightning_3d.core.compose import CONF_DIR, compose_config
from lightning_3d.core.config import ParallelConfig
from lightning_3d.planner import Planner, problem_from_config
from lightning_3d.planner.recipe_layout import layout_of, strategy_keywords
from tests.test_launchers import _run

ROOT = Path(__file__).resolve().parents[1]
FULL = {
    "bloom_176b": {"dp": 8, "tp": 4, "pp": 12},
    "mt_nlg_530b": {"dp": 8, "tp": 8, "pp": 35},
    "gpt3_175b": {"dp": 16, "tp": 4, "pp": 8},
    "llama3_70b": {"dp": 64, "tp": 8, "pp": 1},
}
TINY = {
    "bloom_176b_tiny": {"dp": 2, "tp": 2, "pp": 2, "cp": 1, "zero_stage": 1},
    "mt_nlg_530b_tiny": {"dp": 1, "tp": 2, "pp": 4, "cp": 1, "zero_stage": 1},
    "gpt3_175b_tiny": {"dp": 2, "tp": 2, "pp": 2, "cp": 1, "zero_stage": 1},
    "llama3_70b_tiny": {"dp": 4, "tp": 2, "pp": 1, "cp": 1, "zero_stage": 1},
    "long_context_tiny": {"dp": 2, "tp": 1, "pp": 1, "cp": 4, "zero_stage": 1},
}
SHORT_RUN = [
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=1",
    "trainer.enable_progress_bar=false",
    "data.max_bytes=300000",
]


@pytest.mark.parametrize("recipe", sorted(FULL))
def test_full_recipe_is_a_valid_plan_that_fits(recipe: str) -> None:
    """The strategy accepts the recipe's layout for its cluster, and the planner says it fits."""
    cfg = compose_config([f"recipe={recipe}"])
    world = cfg.cluster.num_nodes * cfg.cluster.devices_per_node
    config = ParallelConfig(**strategy_keywords(cfg.parallel))
    config.require_implemented()
    dims = config.check_world(world, cfg.cluster.devices_per_node)
    assert {"dp": dims.dp, "tp": dims.tp, "pp": dims.pp} == FULL[recipe]
    problem = problem_from_config(cfg, global_batch=cfg.data.global_batch_size * cfg.trainer.accumulate_grad_batches)
    estimate = Planner(problem).evaluate(layout_of(cfg, world))
    assert estimate.fits, estimate.why_not
    assert 0.2 < estimate.mfu < 0.7


def test_the_moe_recipe_is_a_layout_the_strategy_takes_for_its_cluster() -> None:
    """qwen3_235b_class: its layout is held to the strategy's rules for its 512 GPUs and to the model's
    shape (built on the meta device), and the planner, which counts the experts, says it fits (the dry
    run's test holds the planner's counts to the set-up's tensors)."""
    import torch
    from omegaconf import OmegaConf

    from lightning_3d.models.adapters.registry import adapter_for
    from lightning_3d.models.gpt import GPT, GPTConfig

    cfg = compose_config(["recipe=qwen3_235b_class"])
    world = cfg.cluster.num_nodes * cfg.cluster.devices_per_node
    config = ParallelConfig(**strategy_keywords(cfg.parallel))
    config.require_implemented()
    dims = config.check_world(world, cfg.cluster.devices_per_node)
    assert (dims.dp, dims.tp, dims.pp, dims.ep) == (128, 1, 4, 8)
    model_cfg = {k: v for k, v in OmegaConf.to_container(cfg.model).items() if k != "init_from"}
    gpt_config = GPTConfig(**model_cfg)
    assert 2.2e11 < gpt_config.num_parameters() < 2.4e11
    with torch.device("meta"):
        model = GPT(gpt_config)
    config.check_models([("model", adapter_for(model).dims(model))])
    from lightning_3d.planner import Planner, problem_from_config
    from lightning_3d.planner.recipe_layout import layout_of

    estimate = Planner(problem_from_config(cfg)).evaluate(layout_of(cfg, world))
    assert estimate.fits and 15 < estimate.memory["params"] / 2**30 < 18, estimate.memory
    assert estimate.comm["ep"]["ranks"] == 8 and estimate.comm["ep"]["nodes"] == 1  # the all-to-alls stay in a node


# In `make test-slow` with the other tiny recipes; make test trains MoE at pp x ep in
# tests/test_expert_parallel.py (4 ranks) and in the composition matrix.
@pytest.mark.slow
def test_the_moe_tiny_recipe_trains_on_8_cpu_ranks(tmp_path: Path) -> None:
    proc = _run(
        [sys.executable, str(ROOT / "recipes" / "train.py"), "recipe=qwen3_235b_class_tiny", *SHORT_RUN, f"hydra.run.dir={tmp_path}"],
        tmp_path,
    )
    summary = _summary(proc.stdout)
    assert summary["layout"] == {"dp": 4, "tp": 1, "pp": 2, "cp": 1, "ep": 2, "zero_stage": 1} and summary["steps"] == 2
    assert math.isfinite(summary["train_loss"]) and summary["train_loss"] < 6.0


def _summary(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def _check_memory(summary: dict) -> None:
    memory = summary["memory_per_rank_bytes"]
    measured, predicted = memory["measured_max_rank"], memory["predicted"]
    assert measured["activations"] > 0 and measured["params"] > 0
    assert measured["total"] == pytest.approx(predicted["total"], rel=0.15), memory


# The tiny recipes run in `make test-slow`: each is 8 ranks started from scratch (about 40 s here).
# `make test` holds a recipe's measured memory to the plan at the planner's own layout
# (test_parallel_auto_trains_with_the_planners_layout below); dp x tp x pp, sequence parallelism and the
# Llama options run in `make test` elsewhere (the composition matrix, test_launchers' tp2-sp recipe,
# test_llama_style).
IN_MAKE_TEST: set[str] = set()


@pytest.mark.parametrize(
    "recipe", [r if r in IN_MAKE_TEST else pytest.param(r, marks=pytest.mark.slow) for r in sorted(TINY)]
)
def test_tiny_recipe_trains_and_memory_matches_the_plan(tmp_path: Path, recipe: str) -> None:
    proc = _run([sys.executable, str(ROOT / "recipes" / "train.py"), f"recipe={recipe}", *SHORT_RUN, f"hydra.run.dir={tmp_path}"], tmp_path)
    summary = _summary(proc.stdout)
    assert summary["layout"] == TINY[recipe] and summary["steps"] == 2
    assert math.isfinite(summary["train_loss"]) and summary["train_loss"] < 6.0
    _check_memory(summary)


def test_parallel_auto_trains_with_the_planners_layout(tmp_path: Path) -> None:
    proc = _run(
        [sys.executable, str(ROOT / "recipes" / "train.py"), "parallel=auto", "cluster.devices_per_node=2", *SHORT_RUN, f"hydra.run.dir={tmp_path}"],
        tmp_path,
    )
    summary = _summary(proc.stdout)
    planned = summary["planned"]["layout"]
    used = summary["layout"]
    assert f"dp={used['dp']} tp={used['tp']} pp={used['pp']}" in planned and f"zero={used['zero_stage']}" in planned
    _check_memory(summary)


def test_slurm_launcher_takes_its_sizes_from_the_cluster() -> None:
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["recipe=bloom_176b", "hydra/launcher=slurm"], return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        launcher = cfg.hydra.launcher
        assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
        assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (48, 8, 8)
    from hydra.utils import get_class

    assert get_class(launcher._target_).__name__ == "SlurmLauncher"
