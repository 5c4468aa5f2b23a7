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


def test_a_full_disk_during_a_save_is_named_and_leaves_the_last_checkpoint(tmp_path, monkeypatch):
    """Issue 32: ENOSPC surfaced as an OSError buried mid-output; the save is staged, so the previous
    checkpoint is intact, and the message says both."""
    import errno

    import lightning_3d.checkpoint.sharded as sharded

    def full(path, tensors):  # noqa: ANN001
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sharded, "write_file", full)
    tmp = tmp_path / "step=4.ckpt.tmp-run.1"
    tmp.mkdir()
    with pytest.raises(sharded.CheckpointError, match=r"no space left on the device of .* while rank 3 wrote checkpoint step=4.ckpt: nothing of it was published"):
        sharded.write_rank_shard(tmp, sharded.RankShard(3))
