"""Checkpoints: sharded directories that reshard across layouts (sharded.py, manager.py, formats.py), dense
single files saved atomically (atomic.py), consolidation and Hugging Face export (consolidate.py, hf_export.py)."""

from lightning_3d.checkpoint.atomic import AtomicCheckpointIO

__all__ = ["AtomicCheckpointIO"]
