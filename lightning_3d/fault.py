"""Never hang: a heartbeat watchdog that ends a rank whose peer died or froze, naming the peer.

Collectives already fail after the strategy's ``timeout``; this covers what they cannot see and
says who is to blame. Every rank bumps a counter in the rendezvous store (the TCPStore the process
group was created with) every few seconds from a daemon thread, so a rank busy computing still
beats; a peer whose counter has not moved for ``timeout`` seconds is dead or frozen. Staleness is
judged on the local clock only (no clock skew between nodes). If the store itself is unreachable,
the rank hosting it (global rank 0) is gone. Either way the rank prints which rank failed and
exits, so the launcher (Lightning, torchrun, SLURM) ends or restarts the job.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from datetime import timedelta
from typing import Callable, Optional

import torch.distributed as dist

PREFIX = "lightning_3d/heartbeat/"
DONE = "done"
FAILED = "failed"


def _default_store() -> Optional[dist.Store]:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store (single process, custom init): no watchdog
        return None


class HealthMonitor:
    def __init__(
        self,
        timeout: timedelta,
        interval: Optional[float] = None,
        on_failure: Optional[Callable[[str], None]] = None,
    ) -> None:
        self.timeout = timeout.total_seconds()
        self.interval = interval if interval is not None else max(0.5, min(5.0, self.timeout / 6))
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.store = _default_store()
        self.on_failure = on_failure or _exit_with
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._beats = 0
        self._seen: dict[int, tuple[int, float]] = {}

    def start(self) -> None:
        if self.store is None or self.world == 1 or self._thread is not None:
            return
        self._beat()
        self._thread = threading.Thread(target=self._run, name="lightning_3d-health", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """A clean end: peers must not take this rank's silence for a failure."""
        if self._thread is not None:
            self.stop_beating(DONE)

    def _beat(self) -> None:
        self._beats += 1
        self.store.set(f"{PREFIX}{self.rank}", str(self._beats))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat()
                self.check()
            except Exception as err:  # noqa: BLE001 - the store went away with its host
                if self._stop.is_set():
                    return
                self.on_failure(
                    f"lightning_3d: rank {self.rank} lost the rendezvous store hosted by rank 0 ({err}); rank 0 is dead "
                    f"or unreachable. Ending rank {self.rank}; restart with ckpt_path='last' to resume."
                )
                return

    def check(self) -> None:
        now = time.monotonic()
        keys = [f"{PREFIX}{r}" for r in range(self.world)]
        present = [r for r, k in enumerate(keys) if self.store.check([k])]
        for r in present:
            if r == self.rank:
                continue
            value = self.store.get(keys[r])
            if value in (DONE.encode(), FAILED.encode()):
                self._seen.pop(r, None)
                continue
            count = int(value)
            last_count, since = self._seen.get(r, (-1, now))
            if count != last_count:
                self._seen[r] = (count, now)
            elif now - since > self.timeout:
                self.on_failure(
                    f"lightning_3d: rank {r} has not responded for {now - since:.0f} s (timeout {self.timeout:.0f} s): "
                    f"it died or froze. Ending rank {self.rank} instead of hanging; restart with ckpt_path='last' to resume."
                )
                return


    def diagnose(self, wait: Optional[float] = None) -> list[int]:
        """After an error on this rank: which peers went silent? Marks this rank as failed (not
        dead), then watches for ``wait`` seconds; a peer that neither beats nor marks itself is dead
        or frozen."""
        if self.store is None or self.world == 1:
            return []
        self.stop_beating(FAILED)
        wait = wait if wait is not None else 2.5 * self.interval + 1.0
        first = self._counters()
        time.sleep(wait)
        second = self._counters()
        return [r for r in range(self.world) if r != self.rank and first.get(r) is not None and first.get(r) == second.get(r)]

    def stop_beating(self, state: str) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval * 2)
            self._thread = None
        try:
            self.store.set(f"{PREFIX}{self.rank}", state)
        except Exception:  # noqa: BLE001
            pass

    def _counters(self) -> dict[int, Optional[str]]:
        out: dict[int, Optional[str]] = {}
        for r in range(self.world):
            try:
                key = f"{PREFIX}{r}"
                value = self.store.get(key).decode() if self.store.check([key]) else None
            except Exception:  # noqa: BLE001 - the store host is gone
                value = None
            out[r] = None if value in (DONE, FAILED) else value
        return out


def _exit_with(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    os._exit(1)


def elastic_attempt_store(timeout: timedelta) -> Optional[dist.Store]:
    """Under torchrun restarts, a rendezvous store private to this attempt.

    torchrun's agent keeps one store across restarts; a restarted process group would read the
    previous attempt's peer addresses from it and fail to connect. Prefixing every key with the
    restart count keeps attempts apart. ``None`` when not running under torchrun's agent store.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return None
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout
    )
    return dist.PrefixStore(f"lightning_3d/attempt_{attempt}/", client)


_exit_cleanup = {"registered": False, "failed": False}


def destroy_process_group_at_exit() -> None:
    """Destroy the process group while the interpreter is still whole.

    Without it, gloo's worker threads may still hold finished work (tensors with Python
    references) when the interpreter finalizes, and the process dies with SIGABRT
    ("terminate called without an active exception") after a successful run. Skipped after a
    failure: destroying a group whose peers are stuck in a collective can itself block."""
    if _exit_cleanup["registered"]:
        return
    _exit_cleanup["registered"] = True

    def _cleanup() -> None:
        if not _exit_cleanup["failed"] and dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - exiting anyway
                pass

    atexit.register(_cleanup)


def mark_failed() -> None:
    """Record that this process is ending on an error, so exit cleanup leaves the group alone."""
    _exit_cleanup["failed"] = True

