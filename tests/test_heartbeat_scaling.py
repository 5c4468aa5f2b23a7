"""Issue 15, item 3: the heartbeat costs O(N) store requests per interval in total, and still names a
rank that stops beating.

Every test runs whole worlds of ``HealthMonitor`` threads in this process, on one HashStore (each
monitor takes its own clone, as it takes its own TCPStore connection on a cluster), through a
wrapper that counts every request. (An in-process TCPStore would do too, but here its server stalls
5 s on about every 25th connection.) The first version read every peer's key from every rank:
about 2 N requests per rank per interval, 2 N^2 in total; it fails the first test.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import Counter
from datetime import timedelta
from typing import Any, Callable, Optional

import pytest
import torch.distributed as dist

import lightning_3d.resilience.fault as fault

INTERVAL = 0.05
LOCAL = ("clone", "set_timeout", "timeout", "has_extended_api")  # no request reaches the store host


class CountingStore:
    """A ``torch.distributed`` store whose requests (set, get, check, add, compare_set, wait,
    multi_get, ...) are counted, by name, together with those of its clones."""

    def __init__(self, store: dist.Store, counts: Optional[Counter] = None, lock: Optional[threading.Lock] = None) -> None:
        self._store = store
        self.counts = counts if counts is not None else Counter()
        self._lock = lock if lock is not None else threading.Lock()

    def clone(self) -> "CountingStore":
        return CountingStore(self._store.clone(), self.counts, self._lock)

    def set_timeout(self, timeout: timedelta) -> None:
        self._store.set_timeout(timeout)

    def total(self) -> int:
        with self._lock:
            return sum(self.counts.values())

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)
        if name in LOCAL or not callable(method):
            return method

        def request(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.counts[name] += 1
            return method(*args, **kwargs)

        return request


@pytest.fixture
def world(monkeypatch):  # noqa: ANN201
    """Start ``world(n, ...)`` monitors on a fresh counting store; all are stopped at the end."""
    monkeypatch.delenv(fault.HEARTBEAT_TIMEOUT_ENV, raising=False)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # start() installs fault's hook
    started: list[fault.HealthMonitor] = []

    def start(n: int, timeout: float, on_failure: Callable[[int], Callable[[str], None]]):  # noqa: ANN202
        monkeypatch.setattr(fault, "_sessions", {})  # one job: every rank in the same session
        store = CountingStore(dist.HashStore())
        monitors = [
            fault.HealthMonitor(timedelta(seconds=timeout), INTERVAL, on_failure(r), rank=r, world=n, store=store)
            for r in range(n)
        ]
        for m in monitors:
            m.start()
        started.extend(monitors)
        return store, monitors

    yield start
    for m in started:
        m._stop.set()
    for m in started:
        if m._thread is not None:
            m._thread.join(timeout=5)


def _wait(condition: Callable[[], bool], limit: float, what: str) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _freeze(*monitors: fault.HealthMonitor) -> None:
    """Their heartbeats stop without a word (a SIGSTOP, as far as the store can tell)."""
    for m in monitors:
        m._stop.set()
    for m in monitors:
        m._thread.join()


def requests_per_rank_interval(world, n: int, intervals: int = 10) -> float:  # noqa: ANN001
    """Store requests per rank per heartbeat interval, in steady state, in a world of ``n`` ranks."""
    lines: list[str] = []
    store, monitors = world(n, 60.0, lambda r: lines.append)
    beats = lambda: sum(m._beats for m in monitors)  # noqa: E731
    _wait(lambda: all(m._beats >= 3 for m in monitors), 30, "the monitors did not start beating")
    requests0, beats0 = store.total(), beats()
    _wait(lambda: beats() - beats0 >= intervals * n, 60, "the monitors stopped beating")
    requests, beating = store.total() - requests0, beats() - beats0
    for m in reversed(monitors):  # a clean end: ranks n-1 .. 1 go first, their watchers walk on
        m.stop()
    assert not lines, lines
    return requests / beating


def test_heartbeat_requests_per_interval_grow_linearly_with_the_world(world):
    measured = {n: requests_per_rank_interval(world, n) for n in (8, 16, 32)}
    print("store requests per rank per interval:", {n: round(v, 2) for n, v in measured.items()})
    print("store requests per interval, all ranks:", {n: round(v * n) for n, v in measured.items()})
    # a constant per rank (own beat, two watched peers, the failure key, rank 0's end): ~5
    assert all(v <= 7 for v in measured.values()), measured
    assert measured[32] <= 1.25 * measured[8], measured  # reading every peer: ~65 vs ~17


def test_a_rank_that_stops_beating_is_named_by_its_watcher_and_every_other_rank_follows(world):
    n, timeout, lines = 8, 1.0, {}
    store, monitors = world(n, timeout, lambda r: lambda line: lines.setdefault(r, line))
    _wait(lambda: all(m._beats >= 3 and m.watching for m in monitors), 10, "the monitors did not start beating")
    assert monitors[3].watching == (4, 5) and monitors[4].watching == (5, 6)
    _freeze(monitors[5])
    frozen = time.monotonic()
    _wait(lambda: len(lines) == n - 1, timeout + 10, f"not every other rank ended: {lines}")
    claimant = [r for r, line in lines.items() if "rank 5 has not responded" in line]
    assert len(claimant) == 1 and claimant[0] in (3, 4), lines  # one of rank 5's two watchers
    assert time.monotonic() - frozen < timeout + 3
    for r, line in lines.items():
        if r != claimant[0]:
            assert f"rank {r} ends because rank(s) [5] stopped responding" in line, line
            assert f"noticed by rank {claimant[0]}" in line, line


def test_watchers_walk_past_ranks_that_ended_cleanly(world):
    """Ranks 4 and 5 finish; rank 6's two watchers are gone, so ranks 2 and 3 must watch it."""
    n, timeout, lines = 8, 1.0, {}
    store, monitors = world(n, timeout, lambda r: lambda line: lines.setdefault(r, line))
    _wait(lambda: all(m._beats >= 3 for m in monitors), 10, "the monitors did not start beating")
    monitors[4].stop()
    monitors[5].stop()
    _wait(lambda: monitors[3].watching == (6, 7) and monitors[2].watching == (3, 6), 5, "nobody took over rank 6")
    _freeze(monitors[6])
    _wait(lambda: len(lines) == n - 3, timeout + 10, f"not every running rank ended: {lines}")
    claimant = [r for r, line in lines.items() if "rank 6 has not responded" in line]
    assert len(claimant) == 1 and claimant[0] in (2, 3), lines
    assert set(lines) == {0, 1, 2, 3, 7}, lines  # the clean ones are not blamed, nor do they end twice
    assert not any("[4]" in line or "[5]" in line for line in lines.values()), lines


def test_a_watcher_that_dies_with_the_rank_it_watches_leaves_no_gap(world):
    """Rank 5 freezes, and its nearest watcher, rank 4, half a second later: rank 3, its other
    watcher, names rank 5 (with one watcher each, nobody would, and rank 4 would be blamed)."""
    n, timeout, lines = 8, 1.0, {}
    store, monitors = world(n, timeout, lambda r: lambda line: lines.setdefault(r, line))
    _wait(lambda: all(m._beats >= 3 and m.watching for m in monitors), 10, "the monitors did not start beating")
    _freeze(monitors[5])
    time.sleep(timeout / 2)
    _freeze(monitors[4])
    _wait(lambda: len(lines) == n - 2, timeout + 10, f"not every other rank ended: {lines}")
    failure = monitors[0].failure
    assert failure is not None and (failure.by, failure.kind, failure.ranks) == (3, fault.SILENT, (5,)), failure
    assert "rank 5 has not responded" in lines[3], lines


def test_nccl_watchdog_defaults_keep_what_the_user_set_under_either_name(monkeypatch, tmp_path):
    names = (
        "TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_ENABLE_MONITORING",
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE",
        "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
    )
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k not in names})  # none leaks out
    monkeypatch.setenv("NCCL_ASYNC_ERROR_HANDLING", "1")  # the old name of TORCH_NCCL_ASYNC_ERROR_HANDLING
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "0")  # the old name of TORCH_FR_BUFFER_SIZE
    applied = fault.apply_nccl_watchdog_defaults(timedelta(seconds=30), dump_dir=str(tmp_path / "fr"))
    assert applied == {
        "TORCH_NCCL_ENABLE_MONITORING": "1",
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "60",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "fr" / "rank_"),  # torch >= 2.8 (the venv has 2.13)
    }
    assert (tmp_path / "fr").is_dir()
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ and "TORCH_FR_BUFFER_SIZE" not in os.environ
    assert fault.apply_nccl_watchdog_defaults() == {}  # all set now
    assert fault.nccl_watchdog_environment(timedelta(hours=1))["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == "480"
