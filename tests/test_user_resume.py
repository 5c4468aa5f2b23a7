"""A resume the way Lightning users do it (issue 32): ``ModelCheckpoint(save_last=True)`` while fitting,
then a fresh Trainer in a fresh process with ``fit(ckpt_path=".../last.ckpt")``.

The issue's report: ZeRO-3 + AdamW resumed this way gave NaN after the first step. It did not
reproduce here (fp32 and bf16-mixed, ZeRO-1 and ZeRO-3, even and uneven FSDP2 shards, fresh Trainer
and fresh process); this pins the path so the class cannot appear unseen: the resumed losses are
finite and equal the uninterrupted run's.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_3d import ThreeDParallelStrategy
from lightning_3d.testing.harness import run_on_ranks
from tests.helpers import LossRecorder, quiet_trainer, result_of, run_checks, tiny_data, tiny_gpt

CELLS = {"zero3-fp32": (3, "32-true"), "zero3-bf16": (3, "bf16-mixed"), "zero1-fp32": (1, "32-true")}
STEPS, SAVE_AT = 6, 3


def _fit(stage: int, precision: str, steps: int, callbacks: list[Any], ckpt_path: Any = None) -> list[float]:
    L.seed_everything(0)
    recorder = LossRecorder()
    trainer = quiet_trainer(
        max_steps=steps, limit_val_batches=0, callbacks=[recorder, *callbacks], enable_checkpointing=bool(callbacks),
        precision=precision, strategy=ThreeDParallelStrategy(zero_stage=stage),
    )
    model = tiny_gpt(vocab_size=257)  # an odd vocabulary: FSDP2's shards of the embedding are uneven
    model.hparams.decay_steps = STEPS  # the same schedule whether the run stops at SAVE_AT or not
    trainer.fit(model, tiny_data(global_batch_size=4), ckpt_path=ckpt_path)
    return recorder.losses


def first_world(root: str) -> dict[str, Any]:
    checks = {}
    for name, (stage, precision) in CELLS.items():
        directory = Path(root) / name
        checks[f"{name}/full"] = lambda s=stage, p=precision: _fit(s, p, STEPS, [])
        checks[f"{name}/first"] = lambda s=stage, p=precision, d=directory: _fit(
            s, p, SAVE_AT, [ModelCheckpoint(dirpath=d, save_last=True, every_n_train_steps=SAVE_AT)]
        )
    return run_checks(checks)


def resumed_world(root: str) -> dict[str, Any]:  # new processes: nothing of the first world survives
    return run_checks({
        name: (lambda s=stage, p=precision, n=name: _fit(s, p, STEPS, [], ckpt_path=str(Path(root) / n / "last.ckpt")))
        for name, (stage, precision) in CELLS.items()
    })


@pytest.fixture(scope="module")
def worlds() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    root = tempfile.mkdtemp(prefix="l3d-user-resume-")
    return run_on_ranks(first_world, 2, root, timeout=600), run_on_ranks(resumed_world, 2, root, timeout=600)


@pytest.mark.parametrize("name", list(CELLS))
def test_a_model_checkpoint_resume_in_a_fresh_process_continues_the_run(worlds, name):
    first, resumed = worlds
    for before, after in zip(first, resumed):
        full, losses = result_of(before, f"{name}/full"), result_of(after, name)
        assert len(losses) == STEPS - SAVE_AT and np.isfinite(losses).all(), losses
        np.testing.assert_allclose(losses, full[SAVE_AT:], rtol=1e-5)
