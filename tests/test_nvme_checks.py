"""NVMe offload is refused before it can fail mid-training: the directory at construction (missing,
unwritable), the free space for all ranks sharing a filesystem (not each rank alone), and an
unwritable directory is named as such, not as "0 MiB free"."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from lightning_3d import ParallelConfig, ThreeDParallelStrategy
from lightning_3d.testing.harness import run_on_ranks
from lightning_3d.zero import offload
from lightning_3d.zero.offload import NVMeStateStore

ELEMENTS = 1 << 20  # per rank: 12 MiB of fp32 master + two Adam moments
NEED = ELEMENTS * 12


class _Usage:
    def __init__(self, free: int) -> None:
        self.total, self.used, self.free = 2 * free, free, free


def _fake_free_space(monkeypatch: Any, free: int) -> None:
    monkeypatch.setattr(offload.shutil, "disk_usage", lambda path: _Usage(free))


# -- construction ----------------------------------------------------------------------------------------------------
def test_nvme_path_that_does_not_exist_is_refused_at_construction(tmp_path):
    missing = tmp_path / "nvme"
    with pytest.raises(ValueError, match=f"nvme_path='{missing}' does not exist; create it .* `mkdir -p {missing}`"):
        ThreeDParallelStrategy(zero_stage=1, offload_optimizer="nvme", nvme_path=str(missing))
    afile = tmp_path / "file"
    afile.write_text("")
    with pytest.raises(ValueError, match="is a file"):
        ParallelConfig(zero_stage=2, offload_optimizer="nvme", nvme_path=str(afile))
    missing.mkdir()
    ParallelConfig(zero_stage=1, offload_optimizer="nvme", nvme_path=str(missing))
    ParallelConfig(zero_stage=1, offload_optimizer="cpu", nvme_path=str(tmp_path / "unused"))  # not offloading to NVMe


def test_nvme_path_that_is_not_writable_is_refused_at_construction(tmp_path, monkeypatch):
    # a directory where creating a file fails even for root (sysfs), whatever the permission bits say
    with pytest.raises(ValueError, match="nvme_path='/sys' is not writable: creating a file there failed"):
        ThreeDParallelStrategy(zero_stage=1, offload_optimizer="nvme", nvme_path="/sys")
    # the permission bits, as a non-root user meets them
    real_access = os.access
    monkeypatch.setattr(offload.os, "access", lambda path, mode: False if str(path) == str(tmp_path) else real_access(path, mode))
    with pytest.raises(ValueError, match=r"is not writable by this user \(uid \d+\); fix its permissions"):
        ParallelConfig(zero_stage=1, offload_optimizer="nvme", nvme_path=str(tmp_path))


# -- the store -----------------------------------------------------------------------------------------------------------
def test_nvme_unwritable_directory_is_not_reported_as_a_full_disk():
    """Before: "nvme_path='/sys' has 0 MiB free but rank 0's optimizer state needs 0 MiB"."""
    with pytest.raises(PermissionError) as info:
        NVMeStateStore("/sys", 0, [10])
    assert "is not writable" in str(info.value) and "MiB free" not in str(info.value)


def test_nvme_second_store_counts_what_the_first_has_yet_to_write(tmp_path, monkeypatch):
    """Files are sparse until written: a second optimizer's store must count the first one's bytes."""
    _fake_free_space(monkeypatch, NEED * 3 // 2)
    first = NVMeStateStore(str(tmp_path), 0, [ELEMENTS])
    try:
        with pytest.raises(OSError, match="rank 0's optimizer state needs 24 MiB"):
            NVMeStateStore(str(tmp_path), 0, [ELEMENTS])
    finally:
        first.close()
    NVMeStateStore(str(tmp_path), 0, [ELEMENTS]).close()  # a closed store reserves nothing


def stores_on_one_disk(directory: str, free: int, hosts: bool, bad_rank: int = -1) -> str:
    """Each rank builds a store needing ``NEED`` bytes on a disk reporting ``free`` bytes free;
    ``hosts``: every rank on its own host; ``bad_rank`` gets a directory that does not exist."""
    import socket

    import torch.distributed as dist

    rank = dist.get_rank()
    shutil.disk_usage = lambda path: _Usage(free)  # type: ignore[assignment,misc]  # this rank's process only
    if hosts:
        socket.gethostname = lambda: f"node{rank}"  # type: ignore[assignment]
    path = directory if rank != bad_rank else os.path.join(directory, "missing")
    try:
        NVMeStateStore(path, rank, [ELEMENTS]).close()
    except OSError as err:
        return f"{type(err).__name__}: {err}"
    return "ok"


def test_nvme_ranks_sharing_a_disk_are_checked_against_it_together(tmp_path):
    """Two ranks, 12 MiB each, on a disk with 18 MiB free: before, each rank checked its own
    12 MiB, passed, and the disk filled during training."""
    results = run_on_ranks(stores_on_one_disk, 2, str(tmp_path), NEED * 3 // 2, False, timeout=120)
    for result in results:
        assert result.startswith("OSError: [Errno 28] NVMe offload cannot start: "), result
        assert "has 18 MiB free but the 2 ranks writing there (ranks 0-1) need 24 MiB of optimizer state in total" in result
    assert list(Path(tmp_path).iterdir()) == []


def test_nvme_ranks_on_different_hosts_are_not_summed(tmp_path):
    assert run_on_ranks(stores_on_one_disk, 2, str(tmp_path), NEED * 3 // 2, True, timeout=120) == ["ok", "ok"]


def test_nvme_one_ranks_bad_directory_stops_every_rank(tmp_path):
    """A rank whose directory is missing raises; the others must too (not hang in the next collective)."""
    results = run_on_ranks(stores_on_one_disk, 2, str(tmp_path), NEED * 10, True, 1, timeout=120)
    assert results[1].startswith("FileNotFoundError: nvme_path=") and "does not exist" in results[1]
    assert "NVMe offload cannot start: rank 1 on host node1: nvme_path=" in results[0]
