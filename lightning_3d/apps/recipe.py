"""Turn a composed Hydra config (``lightning_3d/conf/``) into a Trainer run, and summarize it.

``recipes/train.py`` is a thin Hydra ``@main`` around :func:`train`; keeping the logic here
makes it importable and testable without Hydra's process handling.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Optional

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from omegaconf import DictConfig, OmegaConf

from lightning_3d.core import rank_zero
from lightning_3d.core.compose import compose_config
from lightning_3d.core.config import ParallelConfig
from lightning_3d.data import TextDataModule
from lightning_3d.models import GPTConfig, GPTModule
from lightning_3d.monitoring.callbacks import MemoryProbe, TokenThroughput
from lightning_3d.plugins.strategy import ThreeDParallelStrategy


log = logging.getLogger(__name__)
def check_command_line(argv: list[str]) -> Optional[str]:
    """The one-line error a recipe's overrides would meet in Hydra's composition (None if they compose):
    checked before Hydra runs, so a typo is one line and exit 2 instead of Hydra's traceback. Only a
    command line of plain overrides is checked: with any of Hydra's own flags (``-m``, ``-cn``,
    ``--config-dir``, ``--cfg``, ...) or a ``hydra.*`` override, what composes is Hydra's business."""
    if any(arg.startswith("-") or arg.lstrip("+~").startswith(("hydra.", "hydra/")) for arg in argv):
        return None
    try:
        compose_config(list(argv))
    except (ValueError, FileNotFoundError) as err:
        return " ".join(str(err).split())
    return None


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node


def build_strategy(parallel: DictConfig) -> ThreeDParallelStrategy:
    """``cfg.parallel`` keys are the strategy's keywords (plus the planner's ``auto``/``software``)."""
    from lightning_3d.planner.recipe_layout import strategy_keywords

    return ThreeDParallelStrategy(**strategy_keywords(parallel))


def build_config(parallel: DictConfig) -> ParallelConfig:
    """The strategy's configuration for ``cfg.parallel``, without a strategy (the dry run's), refused as
    the strategy refuses it (what this version does not implement included)."""
    from lightning_3d.planner.recipe_layout import parallel_config

    config = parallel_config(parallel)
    config.require_implemented()
    return config


def build_logger(cfg: DictConfig, out_dir: Path) -> Any:
    """The ``logger`` group (``conf/logger/``: csv, tensorboard, wandb) instantiated through its
    ``_target_`` with ``save_dir`` = the run directory; a config without the group gets the CSV logger;
    ``logger: null`` (a config of your own) runs without one."""
    if "logger" not in cfg:
        return CSVLogger(save_dir=str(out_dir), name="logs", version="")
    if cfg.logger is None or cfg.logger is False:
        return False
    from hydra.utils import instantiate

    return instantiate(cfg.logger, save_dir=str(out_dir))


def build_trainer(cfg: DictConfig, out_dir: Path, callbacks: list[L.Callback]) -> L.Trainer:
    cluster = cfg.cluster
    checkpoint = ModelCheckpoint(
        dirpath=out_dir / "checkpoints",
        filename="step{step:06d}",
        auto_insert_metric_name=False,
        every_n_train_steps=cfg.checkpoint_every,
        save_top_k=1,
        save_last=True,
    )
    return L.Trainer(
        accelerator=cluster.accelerator,
        devices=cluster.devices_per_node,
        num_nodes=cluster.num_nodes,
        strategy=build_strategy(cfg.parallel),
        logger=build_logger(cfg, out_dir),
        callbacks=[checkpoint, *callbacks],
        **_plain(cfg.trainer),
    )


def init_from(cfg: DictConfig) -> Optional[str]:
    """``model.init_from``: a Hugging Face model directory to fine-tune instead of building the GPT."""
    path = cfg.model.get("init_from")
    if not path:
        return None
    if not (Path(str(path)) / "config.json").is_file():
        raise FileNotFoundError(
            f"model.init_from={path}: not a Hugging Face model directory (no config.json). It takes what "
            f"save_pretrained() writes; to resume a lightning_3d checkpoint use ckpt_path=... instead."
        )
    if cfg.parallel.get("auto", False):
        raise ValueError(
            f"parallel=auto plans the GPT that model.* describes, not the checkpoint model.init_from={path} holds; "
            f"choose the layout yourself (e.g. parallel=3d parallel.tensor_parallel=2)."
        )
    return str(path)


def build_model(cfg: DictConfig) -> L.LightningModule:
    """The GPT that ``cfg.model`` describes, or -- with ``model.init_from`` -- the Hugging Face checkpoint
    there (each rank loads only its slices after the strategy laid it out)."""
    path = init_from(cfg)
    if path is not None:
        from lightning_3d.models.hf_module import HFCausalLMModule

        return HFCausalLMModule(init_from=path, **_plain(cfg.optim))
    model_cfg = _plain(cfg.model)
    model_cfg.pop("init_from", None)
    return GPTModule(config=GPTConfig(**model_cfg), **_plain(cfg.optim))


def build_data(cfg: DictConfig) -> TextDataModule:
    return TextDataModule(block_size=cfg.model.block_size, **_plain(cfg.data))


def _run_overrides(run_dir: Path) -> Optional[list[str]]:
    """The command-line overrides a Hydra run was started with (``.hydra/overrides.yaml``), without the
    ones that do not change what trains (``ckpt_path``, ``hydra.*``); None if unknown."""
    path = run_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return None
    try:
        overrides = OmegaConf.to_container(OmegaConf.load(path))
    except Exception:  # noqa: BLE001 - an unreadable record: not the same run
        return None
    if not isinstance(overrides, list):
        return None
    return sorted(str(o) for o in overrides if not str(o).lstrip("+~").startswith(("ckpt_path=", "hydra.", "hydra/")))


def resolve_ckpt_path(ckpt_path: Optional[str], out_dir: Path) -> Optional[str]:
    """What ``ckpt_path=last`` means for a recipe run: the newest complete checkpoint of this run's
    directory, else of an earlier run *of the same command* (the same overrides, ``.hydra/overrides.yaml``)
    beside it: Hydra gives every run a new ``outputs/<date>/<time>``, so Lightning's own "last" would
    look in an empty directory and start from step 0 in silence. A sweep job, another experiment or a
    run with other overrides is never taken; no checkpoint is an error naming where it looked and the
    checkpoints of other runs it found. Other values are returned unchanged."""
    if ckpt_path != "last":
        return ckpt_path
    from lightning_3d.checkpoint.sharded import complete_checkpoints, read_manifest

    def written(directory: Path) -> list[tuple[float, Path]]:  # (when written, path): sharded dirs and dense files
        sharded = [(float(read_manifest(c).get("created", 0.0)) or c.stat().st_mtime, c) for c, _ in complete_checkpoints(directory)]
        dense = [(f.stat().st_mtime, f) for f in directory.glob("*.ckpt") if f.is_file()] if directory.is_dir() else []
        return sharded + dense

    own = out_dir / "checkpoints"
    root = out_dir.parent.parent  # outputs/<date>/<time> -> outputs
    candidates = written(own)
    others: list[tuple[float, Path]] = []
    if not candidates:
        mine = _run_overrides(out_dir)
        for directory in sorted(root.glob("*/*/checkpoints")):
            if directory == own:
                continue
            same = mine is not None and _run_overrides(directory.parent) == mine
            (candidates if same else others).extend(written(directory))
    if not candidates:
        seen = f"; checkpoints of other runs (other overrides, not taken): {', '.join(str(p) for _, p in sorted(others)[-3:])}" if others else ""
        raise ValueError(
            f"ckpt_path=last: no complete checkpoint in this run's {own} nor in an earlier run of the same command under "
            f"{root}/*/*{seen}; start without ckpt_path, or pass ckpt_path=<a checkpoint directory>."
        )
    newest = max(candidates, key=lambda c: (c[0], str(c[1])))[1]
    rank_zero.info(
        log, "lightning_3d: ckpt_path=last resumes from %s (the newest complete checkpoint%s); pass ckpt_path=PATH for "
        "another.", newest, "" if newest.parent == own else f" of the same command's runs under {root}", once=True,
    )
    return str(newest)


def _final(metrics: dict[str, Any], key: str) -> Optional[float]:
    value = metrics.get(key)
    return None if value is None else round(float(value), 5)


def train(cfg: DictConfig, out_dir: Path) -> Optional[dict[str, Any]]:
    """Fit, validate, plot; return the summary on global rank 0 (``None`` elsewhere).

    With ``parallel=auto`` the planner picks the layout first (every rank computes the same plan).
    """
    from lightning_3d.planner.recipe_layout import apply_auto_layout, predicted_memory

    cfg, planned = apply_auto_layout(cfg)
    L.seed_everything(cfg.seed, workers=True, verbose=rank_zero.is_global_zero())  # one "Seed set" line
    probe = MemoryProbe(step=1)
    model, data = build_model(cfg), build_data(cfg)
    # GPTModule.configure_callbacks brings its own TokenThroughput: passing one too makes Lightning
    # say so (once per fit and validate); pass ours only to models that do not.
    peak = cfg.cluster.get("device", {}).get("peak_tflops") if cfg.cluster.accelerator == "cpu" else None
    if peak:  # CPU has no peak-FLOPs table: MFU against the cluster config's (the planner's) figure
        model.peak_flops = float(peak) * 1e12
    own = model.configure_callbacks()
    brings = any(isinstance(cb, TokenThroughput) for cb in ([own] if isinstance(own, L.Callback) else own or []))
    trainer = build_trainer(cfg, out_dir, [probe] if brings else [TokenThroughput(), probe])
    trainer.fit(model, datamodule=data, ckpt_path=resolve_ckpt_path(cfg.get("ckpt_path"), out_dir))
    # GPTModule.configure_callbacks may have replaced ours: read the one the Trainer used.
    throughput = next(cb for cb in trainer.callbacks if isinstance(cb, TokenThroughput))
    train_loss = _final(trainer.callback_metrics, "train_loss")
    validated = trainer.validate(model, datamodule=data, verbose=False)
    if not trainer.is_global_zero:
        return None
    val_loss = _final(validated[0], "val_loss") if validated else None
    strategy = trainer.strategy
    assert isinstance(strategy, ThreeDParallelStrategy)
    dims = strategy.parallel_dims
    summary: dict[str, Any] = {
        "train_loss": train_loss,
        "val_loss": val_loss,
        "tokens_per_s": None if math.isnan(throughput.mean_tokens_per_s) else round(throughput.mean_tokens_per_s, 1),
        "world_size": trainer.world_size,
        "layout": {
            "dp": dims.dp, "tp": dims.tp, "pp": dims.pp, "cp": dims.cp, **({"ep": dims.ep} if dims.ep > 1 else {}),
            "zero_stage": strategy.config.sharding.zero_stage,
        },
        "flops_per_token": throughput.flops_per_token,  # model FLOPs (fwd + bwd, no recompute): the planner's count
        "tflops_per_device": None if throughput.tflops_per_device is None else round(throughput.tflops_per_device, 4),
        "mfu": None if throughput.mfu is None else round(throughput.mfu, 4),  # None on CPU: no peak to divide by
        "peak_memory_mb": round(throughput.peak_memory_mb, 1),
        "steps": trainer.global_step,
        "checkpoint": str(out_dir / "checkpoints" / "last.ckpt"),
    }
    if planned is not None:
        summary["planned"] = {"layout": planned.layout.short(), "predicted_step_seconds": round(planned.step_seconds, 4)}
    measured = [r for r in probe.per_rank if r.get("total")]
    try:  # clusters for running only (local_gpu: "all visible GPUs") have nothing to plan with
        # (an init_from checkpoint is not the GPT the planner would describe: no prediction for it)
        predicted = predicted_memory(cfg, trainer.world_size) if measured and init_from(cfg) is None else None
    except ValueError as err:
        rank_zero.info(log, "lightning_3d: no memory prediction for this run: %s", err)
        predicted = None
    if measured and predicted is not None:
        keys = ("params", "grads", "optimizer", "activations")
        worst = max(measured, key=lambda r: r["total"])
        summary["memory_per_rank_bytes"] = {
            "measured_max_rank": {k: int(worst[k]) for k in (*keys, "total")},
            "predicted": {**{k: int(predicted[k]) for k in keys}, "total": int(sum(predicted[k] for k in keys))},
        }
    metrics_csv = out_dir / "logs" / "metrics.csv"
    if metrics_csv.is_file():
        from lightning_3d.apps.plotting import plot_loss_curve

        summary["loss_curve"] = plot_loss_curve(metrics_csv, out_dir / "loss_curve.png")
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def end_multirun_job(wait_s: float = 120.0) -> None:
    """Ready this process for the next job of a Hydra multirun: its ranks reaped, its process group
    closed, its launch variables unset (:func:`~lightning_3d.resilience.launch_guard.release_job_ranks`)
    and the fault monitor's sessions forgotten (the next job's ranks are new processes: their
    monitors count from zero)."""
    from lightning_3d.resilience import fault, launch_guard

    try:
        launch_guard.release_job_ranks(wait_s)
    finally:
        fault.reset_sessions()

