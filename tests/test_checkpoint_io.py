"""A save that dies half-way never damages the previous checkpoint."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_3d.checkpoint import AtomicCheckpointIO


class ExplodesWhenPickled:
    def __reduce__(self):
        raise RuntimeError("disk on fire")


def test_failed_save_leaves_the_previous_checkpoint_intact(tmp_path):
    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"step": 1, "w": torch.ones(1000)}, path)
    with pytest.raises(RuntimeError, match="disk on fire"):
        io.save_checkpoint({"step": 2, "w": torch.zeros(1000), "bad": ExplodesWhenPickled()}, path)
    loaded = io.load_checkpoint(path, weights_only=True)
    assert loaded["step"] == 1 and torch.equal(loaded["w"], torch.ones(1000))
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # no partial files left behind


def test_strategy_uses_atomic_io_unless_the_user_brings_one():
    trainer = L.Trainer(strategy="3d", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO)
