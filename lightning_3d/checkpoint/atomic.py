"""Checkpoint files that are either complete or absent.

Lightning's default I/O stages a save in the system temp directory and moves it into place; when
that directory is on another filesystem the move is a plain copy onto the target name, so a
crash mid-copy truncates the previous ``last.ckpt``. Here the bytes go to a temporary file in the
target's own directory, are flushed to disk, and replace the target with one ``os.replace``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _PATH


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` with crash-safe local writes (remote filesystems use Lightning's path)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options (got {storage_options!r}).")
        if not isinstance(get_filesystem(path), LocalFileSystem):
            return super().save_checkpoint(checkpoint, path)
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp_name, target)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise
        fsync_directory(target.parent)


def fsync_directory(directory: Path) -> None:
    """Make the rename itself durable (POSIX); harmless where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_directory(tmp: Path, final: Path, aside: Path) -> None:
    """Put the complete directory ``tmp`` at ``final``: ``tmp`` is synced, whatever stood at ``final``
    moves to ``aside`` and is removed only after the rename is durable, so a crash leaves either the
    old or the new one in place, never neither."""
    fsync_directory(tmp)
    replaced = None
    if final.exists():
        replaced = aside
        os.replace(final, replaced)
    os.replace(tmp, final)
    fsync_directory(final.parent)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True) if replaced.is_dir() else replaced.unlink(missing_ok=True)
