"""Checkpoint I/O. Today: atomic single-file saves; sharded, resharding checkpoints come later."""

from lightning_3d.checkpoint.atomic import AtomicCheckpointIO

__all__ = ["AtomicCheckpointIO"]
