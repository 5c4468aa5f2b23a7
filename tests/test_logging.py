"""One log line per event (rank-zero logging and warnings) and the Hydra ``logger`` group."""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import sys
import warnings
from collections import Counter
from pathlib import Path

import pytest
from hydra.utils import get_class
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger
from lightning_utilities.core.rank_zero import rank_zero_only

from lightning_3d.apps.recipe import build_logger
from lightning_3d.core import rank_zero
from lightning_3d.core.compose import compose_config
from lightning_3d.planner import problem_from_config
from tests.test_launchers import _run

ROOT = Path(__file__).resolve().parents[1]


# -- the logger group ---------------------------------------------------------------------------------------------
def test_default_logger_is_csv_in_the_run_directory(tmp_path: Path) -> None:
    logger = build_logger(compose_config([]), tmp_path)
    assert isinstance(logger, CSVLogger)
    assert Path(logger.log_dir).resolve() == (tmp_path / "logs").resolve()


@pytest.mark.parametrize(("choice", "cls"), [("csv", CSVLogger), ("tensorboard", TensorBoardLogger), ("wandb", WandbLogger)])
def test_logger_group_composes_to_its_target(choice: str, cls: type) -> None:
    cfg = compose_config([f"logger={choice}"])
    assert get_class(cfg.logger._target_) is cls
    if choice == "wandb":
        assert cfg.logger.offline is True


@pytest.mark.skipif(
    importlib.util.find_spec("tensorboard") is None and importlib.util.find_spec("tensorboardX") is None,
    reason="neither tensorboard nor tensorboardX is installed (the compose-only test above still runs)",
)
def test_logger_tensorboard_instantiates(tmp_path: Path) -> None:
    logger = build_logger(compose_config(["logger=tensorboard"]), tmp_path)
    assert isinstance(logger, TensorBoardLogger) and Path(logger.save_dir) == tmp_path


def test_config_without_the_logger_group_gets_csv(tmp_path: Path) -> None:
    cfg = compose_config(["~logger"])
    assert "logger" not in cfg and isinstance(build_logger(cfg, tmp_path), CSVLogger)


# -- rank zero ----------------------------------------------------------------------------------------------------
def test_rank_zero_helpers_are_silent_elsewhere(monkeypatch, caplog) -> None:
    log = logging.getLogger("lightning_3d.test")
    caplog.set_level(logging.INFO, logger="lightning_3d.test")
    monkeypatch.setattr(rank_zero_only, "rank", 1, raising=False)
    rank_zero.info(log, "lightning_3d: shared fact")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rank_zero.warn("shared warning")
    assert not caplog.records and not caught
    monkeypatch.setattr(rank_zero_only, "rank", 0, raising=False)
    rank_zero.info(log, "lightning_3d: shared fact %d", 1, once=True)
    rank_zero.info(log, "lightning_3d: shared fact %d", 1, once=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rank_zero.warn("shared warning", stacklevel=1)  # 1: this line, as warnings.warn counts
    assert [r.getMessage() for r in caplog.records] == ["lightning_3d: shared fact 1"]
    assert [str(w.message) for w in caught] == ["shared warning"] and caught[0].filename == __file__


def _events(output: str) -> Counter:
    """The lines that name an event: our log lines (Hydra's ``[time][lightning_3d.x][LEVEL] - msg``
    with the time dropped, or lines starting with ``lightning_3d``) and warnings (``file:line: msg``)."""
    lines = Counter()
    for line in output.splitlines():
        line = re.sub(r"^\[[0-9-]+ [0-9:,]+\]", "", line.strip())
        if line.startswith(("lightning_3d", "[lightning_3d")) or re.match(r"^/\S+\.py:\d+: ", line) or "Seed set" in line:
            lines[line] += 1
    return lines


def test_recipe_on_two_ranks_logs_each_line_once_and_reports_mfu(tmp_path: Path) -> None:
    """pp2 (2 ranks: a second rank is all a repeated line needs): every lightning_3d log line,
    warning and the seed line appear once in the combined output; summary.json has the planner's
    FLOPs per token and an MFU (against the CPU cluster config's peak)."""
    args = [
        "cluster.devices_per_node=2", "parallel.tensor_parallel=1", "trainer.max_steps=4", "trainer.val_check_interval=4", "trainer.limit_val_batches=1",
        "trainer.enable_progress_bar=false", "data.max_bytes=300000",
    ]
    proc = _run([sys.executable, str(ROOT / "recipes" / "train.py"), *args, f"hydra.run.dir={tmp_path}"], tmp_path)
    output = proc.stdout + proc.stderr
    events = _events(output)
    assert any("pipeline layout" in line for line in events), output[-3000:]
    assert any("Topology(" in line for line in events), output[-3000:]
    repeated = {line: n for line, n in events.items() if n > 1}
    assert not repeated, repeated
    summary = json.loads((tmp_path / "summary.json").read_text())
    cfg = compose_config(args)
    planner = problem_from_config(cfg).model.step_flops(1, 0.0) / cfg.model.block_size
    assert summary["flops_per_token"] == pytest.approx(planner, rel=0.01)
    assert summary["tflops_per_device"] > 0 and 0 < summary["mfu"] < 1
    assert summary["layout"] == {"dp": 1, "tp": 1, "pp": 2, "cp": 1, "zero_stage": 1}
