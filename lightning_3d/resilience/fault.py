"""Never hang, never outlive the job, and say once who is to blame.

Collectives already fail after the strategy's ``timeout``; this covers what they cannot see and
says who is to blame. Every rank bumps a counter in the rendezvous store (the TCPStore the process
group was created with) every few seconds from a daemon thread, so a rank busy computing still
beats; a peer whose counter has not moved for ``timeout`` seconds (``$LIGHTNING_3D_HEARTBEAT_TIMEOUT``
overrides it for the heartbeats alone) is dead or frozen. Staleness is judged on the local clock
only (no clock skew between nodes). If the store itself is unreachable, the rank hosting it
(global rank 0) is gone.

Who watches whom: a ring with two watchers per rank. Rank r reads the counters of the next
``WATCHED`` (2) live ranks after it, (r+1) % N and (r+2) % N, skipping ranks whose key says DONE or
FAILED (they ended cleanly, or are ending on an error they report themselves). Every live rank is
therefore watched by its two nearest live predecessors, so

- a dead rank is noticed within the timeout (plus one interval) by a rank next to it, which with
  tp innermost usually runs on the same host and can SIGKILL it;
- a watcher that dies together with the rank it watches leaves no gap: any two dead ranks are
  both watched by a live rank (three or more dead in a row: the first two are named; the job still
  ends on that verdict);
- a watched rank that finishes cleanly hands its watcher on to the next live one: the walk over
  finished ranks happens every interval, so nobody is left unwatched when its neighbours are done.

Cost per interval, per rank: one ``set`` (its own beat), one ``get`` per watched rank (two; a
``check`` first only until a key exists), one ``check`` of the failure key and one of the key rank 0
leaves when it ends cleanly: about five requests, 5 N in total, whatever N is. Reading every peer
instead (the first version) cost about 2 N per rank, 2 N^2 in total: at the default 5 s interval
~100k requests/s at 512 ranks and ~2M/s at 2,240, enough to overwhelm rank 0's store. Finished ranks are walked over by at most two live ranks each,
so the total stays O(N) while ranks end. A ring rather than one watcher per node or a tree: it
needs no knowledge of the host layout, the work is the same on every rank (no hot spot), and
rebuilding it when ranks finish is a walk, not an election. (Tested with a counting store:
tests/test_heartbeat_scaling.py.)

The first rank to know what went wrong claims it in one store key (``compare_set``: the first
writer wins): "rank k raised X" or "ranks [k] stopped responding". Every other rank reads that one
key each interval instead of judging for itself, so each names the same culprit with one line, and
only the rank that raised prints a traceback (after it, the others' lines; see ``_excepthook``). A
rank known to be frozen is SIGKILLed by a peer on its host (its pid is in the store; every rank
that learns the verdict tries), and the launcher kills stopped children at its exit
(``launch_guard``), so a frozen process never outlives the job. Rank 0 hosts the store: when it
ends on a failure it waits a moment for the others to read the claim. After a collective fails,
only one rank runs ``diagnose`` (which reads every counter twice: once per job, not per interval)
and the others wait for its verdict.

With NCCL, torch's own watchdog covers what this heartbeat cannot see (``apply_nccl_watchdog_defaults``,
called by the strategy before the process group exists): a collective that never completes on the
GPU (a peer never joined it; the CPU side of a rank may keep beating while its stream is stuck) is
torn down after the collective timeout, a watchdog thread stuck in a CUDA/NCCL call aborts the
process, and the flight recorder dumps each rank's last collectives for the post-mortem. The
heartbeat stays on under NCCL too: it covers gloo, a rank that dies or freezes between collectives
(in the data loader, in Python, in a checkpoint write), a lost store host or launcher, and it names
the culprit once for the whole job, which torch's watchdog does not.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional

import torch.distributed as dist

from lightning_3d.resilience import launch_guard
from lightning_3d.resilience.launch_guard import KILLED, ProcessRecord, kill_if_here, launcher_died, process_record, restart_hint

PREFIX = "lightning_3d/heartbeat/"
PROCESS = "lightning_3d/process/"
DONE = "done"
FAILED = "failed"
ERROR, SILENT = "error", "silent"
HEARTBEAT_TIMEOUT_ENV = "LIGHTNING_3D_HEARTBEAT_TIMEOUT"
WATCHED = 2  # each rank reads the counters of the next WATCHED live ranks in the ring
_COMMUNICATION_WORDS = ("gloo", "NCCL", "Connection closed", "Connection reset", "Broken pipe", "Timed out waiting")


def _default_store() -> Optional[dist.Store]:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store (single process, custom init): no watchdog
        return None


def _private_client(store: dist.Store, timeout: float) -> dist.Store:
    """A connection of our own whose operations give up after the heartbeat timeout: a frozen store
    host then counts as silent like any other rank, instead of blocking for the collective timeout."""
    try:
        client = store.clone()
        client.set_timeout(timedelta(seconds=max(timeout, 1.0)))
        return client
    except Exception:  # noqa: BLE001 - a store without clone (HashStore, FileStore, a test double)
        return store


@dataclass(frozen=True)
class Failure:
    """The job's first failure: rank ``by`` raised (ERROR), or noticed that ``ranks`` went silent (SILENT)."""

    by: int
    kind: str
    ranks: tuple[int, ...]
    what: str

    def encode(self) -> str:
        return json.dumps({"by": self.by, "kind": self.kind, "ranks": list(self.ranks), "what": self.what})

    @classmethod
    def decode(cls, text: bytes) -> "Failure":
        d = json.loads(text)
        return cls(d["by"], d["kind"], tuple(d["ranks"]), d["what"])

    def line_for(self, rank: int) -> str:
        """What a rank that did not fail first prints: one line, naming the culprit and the fix."""
        if self.kind == SILENT:
            return (
                f"lightning_3d: rank {rank} ends because rank(s) {list(self.ranks)} stopped responding (dead or "
                f"frozen; noticed by rank {self.by}). {restart_hint()}"
            )
        return (
            f"lightning_3d: rank {rank}: ended because rank {self.by} failed: {self.what}; see rank {self.by}'s "
            f"traceback above. {restart_hint()}"
        )


def summarize(exception: BaseException) -> str:
    text = str(exception).strip().splitlines()
    first = text[0] if text else ""
    line = f"{type(exception).__name__}: {first}" if first else type(exception).__name__
    return line if len(line) <= 200 else line[:197] + "..."


def is_communication_error(exception: BaseException) -> bool:
    """A collective or store failed: usually the consequence of a peer's failure, not a cause."""
    seen: Optional[BaseException] = exception
    while seen is not None:
        if isinstance(seen, dist.DistError):
            return True
        if isinstance(seen, RuntimeError) and any(word in str(seen) for word in _COMMUNICATION_WORDS):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


_sessions: dict[int, int] = {}  # rank -> monitors created: every rank creates its monitors in the same order


def reset_sessions() -> None:
    """Forget the monitors created so far: a new job in this process (the next job of a Hydra
    multirun) starts counting with its freshly launched ranks, which count from zero."""
    _sessions.clear()


class HealthMonitor:
    def __init__(
        self,
        timeout: timedelta,
        interval: Optional[float] = None,
        on_failure: Optional[Callable[[str], None]] = None,
        *,
        rank: Optional[int] = None,
        world: Optional[int] = None,
        store: Optional[dist.Store] = None,
    ) -> None:
        override = os.environ.get(HEARTBEAT_TIMEOUT_ENV)
        self.timeout = float(override) if override else timeout.total_seconds()
        self.interval = interval if interval is not None else max(0.5, min(5.0, self.timeout / 6))
        self.rank = dist.get_rank() if rank is None else rank
        self.world = dist.get_world_size() if world is None else world
        base = store if store is not None else _default_store()
        self.store = _private_client(base, self.timeout) if base is not None else None
        # Under torchrun's agent store the agent hosts it; otherwise rank 0 does.
        self.hosts_store = self.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        self.on_failure = on_failure or _exit_with
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._beats = 0
        self._seen: dict[int, tuple[Optional[str], float]] = {}  # watched rank -> (last counter, when it changed)
        self._present: set[int] = set()  # ranks whose key exists: read without a check first
        self.watching: tuple[int, ...] = ()  # the ranks this one watched at its last check
        self._records: dict[int, ProcessRecord] = {}
        self._rank0_done = False
        self._ending = threading.Lock()
        self._store_dead = False
        session = _sessions[self.rank] = _sessions.get(self.rank, -1) + 1
        self._keys = {name: f"lightning_3d/{name}/{session}" for name in ("failure", "diagnosis", "reported", "ended", "done", "host_done")}
        self.failure: Optional[Failure] = None  # the job's first failure, once this rank knows it

    # -- running ------------------------------------------------------------------------------------------
    def start(self) -> None:
        if self.store is None or self.world == 1 or self._thread is not None:
            return
        self.store.set(f"{PROCESS}{self.rank}", process_record().encode())
        self._beat()
        _install_excepthook()
        self._thread = threading.Thread(target=self._run, name="lightning_3d-health", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """A clean end: peers must not take this rank's silence for a failure, and the launcher may
        now exit before this rank without taking it along."""
        if self._thread is not None:
            if self.rank == 0:  # the others need not read rank 0's key to know its store may go away
                try:
                    self.store.set(self._keys["host_done"], DONE)
                except Exception:  # noqa: BLE001
                    pass
            self.stop_beating(DONE)
            launch_guard.unwatch_launcher()
            self._count_out("done", self.world)  # rank 0 keeps the store up until every rank has stopped beating

    def _beat(self) -> None:
        self._beats += 1
        self.store.set(f"{PREFIX}{self.rank}", str(self._beats))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            line = launcher_died()
            if line is not None:  # no store operations: the store may have gone with the launcher
                self.on_failure(line)
                return
            try:
                self._beat()
                self._record(0)  # kept: if rank 0 freezes, so does the store that holds its pid
                failure = self.read_failure()
                if failure is not None and failure.by != self.rank and failure.kind == SILENT:
                    self._end(failure.line_for(self.rank), failure.ranks)
                    return
                if not self._rank0_done and self.rank != 0:
                    self._rank0_done = self.store.check([self._keys["host_done"]])
                self.check()
            except Exception as err:  # noqa: BLE001 - the store went away with its host
                if self._stop.is_set() or self._rank0_done:
                    return  # we are ending anyway, or rank 0 finished and took its store along
                self._store_lost(err)
                return

    def _store_lost(self, err: BaseException) -> None:
        self._store_dead = True
        if self.failure is not None and self.failure.by != self.rank:
            self.on_failure(self.failure.line_for(self.rank))
            return
        note = self._kill_note(self._kill((0,)))
        self.on_failure(
            f"lightning_3d: rank {self.rank} lost the rendezvous store hosted by rank 0 ({summarize(err)}); rank 0 is "
            f"dead, frozen or unreachable{note}. Ending rank {self.rank}. {restart_hint()}"
        )

    def check(self) -> None:
        """One interval's look at the ring: the next ``WATCHED`` live ranks after this one (module
        docstring). A rank whose key is still absent (its monitor has not started) is watched too, and
        counts as silent once absent for the timeout."""
        now = time.monotonic()
        watched: list[int] = []
        silent: list[tuple[int, float]] = []
        for step in range(1, self.world):
            r = (self.rank + step) % self.world
            value = self._read_beat(r)
            if value in (DONE, FAILED):  # ended cleanly, or reporting its own error: not our business
                self._rank0_done = self._rank0_done or (r == 0 and value == DONE)
                self._seen.pop(r, None)
                continue
            watched.append(r)
            last, since = self._seen.get(r, ("", now))
            if value != last:
                self._seen[r] = (value, now)
            elif now - since > self.timeout:
                silent.append((r, now - since))
            if len(watched) == WATCHED:
                break
        self.watching = tuple(watched)
        if silent:
            self._peers_silent(silent)

    def _read_beat(self, r: int) -> Optional[str]:
        """Rank ``r``'s counter, DONE or FAILED; None while its key does not exist (one ``check``, then
        one ``get`` per read once it does: a ``get`` of a missing key would block)."""
        key = f"{PREFIX}{r}"
        if r not in self._present:
            if not self.store.check([key]):
                return None
            self._present.add(r)
        return self.store.get(key).decode()

    def _peers_silent(self, silent: list[tuple[int, float]]) -> None:
        ranks = tuple(r for r, _ in silent)
        silent_s = max(s for _, s in silent)
        who = f"rank {ranks[0]} has" if len(ranks) == 1 else f"ranks {list(ranks)} have"
        # kill first, claim second: a rank that reads our claim kills the silent ranks on its host too,
        # and could do it between our claim and our kill. Another watcher of the same ranks may still
        # kill them first: our line then says their processes here have ended.
        killed = self._kill(ranks)
        failure = self.claim(Failure(self.rank, SILENT, ranks, f"{who} not responded for {silent_s:.0f} s"))
        if failure.by != self.rank:  # another rank was first: say what it found
            self._end(failure.line_for(self.rank), failure.ranks)
            return
        note = self._kill_note(killed)
        self._end(
            f"lightning_3d: {who} not responded for {silent_s:.0f} s (timeout {self.timeout:.0f} s): "
            f"{'it' if len(ranks) == 1 else 'they'} died or froze{note}. Ending rank {self.rank} instead of hanging. "
            f"{restart_hint()}",
            ranks,
            killed=True,
        )

    def _end(self, line: str, silent: tuple[int, ...] = (), killed: bool = False) -> None:
        """End this rank on a failure found by its heartbeat thread: kill the silent ranks that run here,
        say so, and, as the store's host, give the others a moment to read the claim first."""
        if not self._ending.acquire(blocking=False):
            return
        self._stop.set()
        if not killed:
            self._kill(silent)
        self._finish(expected=self.world - len(silent))
        self.on_failure(line)

    # -- the first failure ------------------------------------------------------------------------------
    def claim(self, mine: Failure) -> Failure:
        """Record ``mine`` as the job's first failure unless one is recorded; return the one that is."""
        self.failure = Failure.decode(self.store.compare_set(self._keys["failure"], "", mine.encode()))
        return self.failure

    def read_failure(self) -> Optional[Failure]:
        if self.failure is None and self.store.check([self._keys["failure"]]):
            self.failure = Failure.decode(self.store.get(self._keys["failure"]))
        return self.failure

    def report(self, exception: BaseException) -> None:
        """On an exception in this rank (``on_exception``): decide, once for the job, whose fault it is.

        A communication error is most likely the echo of a peer's failure: the claim names it, or the
        heartbeats show who went silent. Any other error is this rank's own and is claimed at once.
        Attaches the one-line verdict to the exception (a note) for ranks that did not fail first; if
        the exception ends the process, ``_excepthook`` prints that line instead of the traceback."""
        if self.store is None or self.world == 1:
            return
        line = launcher_died()
        if line is not None:
            self.on_failure(line)
            return
        communication = is_communication_error(exception)
        try:
            self.stop_beating(FAILED)
            if self.read_failure() is None:
                if not communication:
                    self.claim(Failure(self.rank, ERROR, (self.rank,), summarize(exception)))
                elif self._lead_diagnosis():  # one rank watches the heartbeats; the others wait for its verdict
                    silent = self.diagnose()
                    if self.failure is None:
                        self.claim(
                            Failure(self.rank, SILENT, tuple(silent), f"rank(s) {silent} stopped responding")
                            if silent
                            else Failure(self.rank, ERROR, (self.rank,), summarize(exception))
                        )
                else:
                    self._await_failure()
                    if self.failure is None:  # the diagnosing rank is gone too
                        self.claim(Failure(self.rank, ERROR, (self.rank,), summarize(exception)))
        except Exception:  # noqa: BLE001 - the store is gone: go by what this rank already knew
            self._store_dead = True
        failure = self.failure
        if failure is None:
            if not communication:
                return  # this rank's own error, and nobody to tell: its traceback says it all
            line = (
                f"lightning_3d: rank {self.rank}: lost contact with the job ({summarize(exception)}) and with the "
                f"rendezvous store hosted by rank 0: rank 0 is dead or unreachable. {restart_hint()}"
            )
        elif failure.by == self.rank and failure.kind == ERROR:
            line = None  # this rank failed first: its traceback is the one to read
        elif failure.by == self.rank:
            note = self._kill_note(self._kill(failure.ranks))
            line = (
                f"lightning_3d: rank(s) {list(failure.ranks)} stopped responding (dead or frozen) -- the likely cause of "
                f"this error on rank {self.rank}{note}. {restart_hint()}"
            )
        else:
            self._kill(failure.ranks if failure.kind == SILENT else ())
            line = failure.line_for(self.rank)
        if line is not None:
            _add_note(exception, line)
        _reported.update(exception=exception, monitor=self, line=line)

    def _lead_diagnosis(self) -> bool:
        key = self._keys["diagnosis"]
        return self.store.compare_set(key, "", str(self.rank)) == str(self.rank).encode()

    def _await_failure(self) -> None:
        try:
            self.store.wait([self._keys["failure"]], timedelta(seconds=5 * self.interval + 5.0))
        except Exception:  # noqa: BLE001 - no verdict in time
            return
        self.read_failure()

    def _finish(self, expected: int, reported: bool = False) -> None:
        """This rank is ending on a failure: mark it, count it out."""
        if self._store_dead:
            return
        try:
            if reported:
                self.store.set(self._keys["reported"], str(self.rank))
            self.store.set(f"{PREFIX}{self.rank}", FAILED)
        except Exception:  # noqa: BLE001 - the store is gone; nothing left to coordinate
            return
        self._count_out("ended", expected)

    def _count_out(self, name: str, expected: int) -> None:
        """Add this rank to counter ``name``; the store's host waits (briefly) until ``expected`` ranks
        are, so that no rank loses the store while it still needs it. O(1) per rank."""
        try:
            self.store.add(self._keys[name], 1)
            deadline = time.monotonic() + 2 * self.interval + 2.0
            while self.hosts_store and self.store.add(self._keys[name], 0) < expected and time.monotonic() < deadline:
                time.sleep(0.05)
        except Exception:  # noqa: BLE001
            pass

    def _wait_reported(self) -> None:
        """A rank that did not fail first waits (briefly) for the traceback of the one that did."""
        if self._store_dead:
            return
        try:
            self.store.wait([self._keys["reported"]], timedelta(seconds=2 * self.interval + 3.0))
        except Exception:  # noqa: BLE001 - it caught its exception, or the store went away with it
            pass

    # -- processes ----------------------------------------------------------------------------------------
    def _record(self, r: int) -> Optional[ProcessRecord]:
        if r not in self._records:
            key = f"{PROCESS}{r}"
            try:
                if self.store.check([key]):
                    self._records[r] = ProcessRecord.decode(self.store.get(key))
            except Exception:  # noqa: BLE001
                return None
        return self._records.get(r)

    def _kill(self, ranks: tuple[int, ...] | list[int]) -> list[tuple[int, int, str]]:
        """SIGKILL those of ``ranks`` (known dead or frozen) that run on this host: (rank, pid, outcome)
        for each of them, the outcome ``KILLED`` or ``ENDED`` (``kill_if_here``)."""
        outcomes = []
        for r in ranks:
            record = self._record(r) if r != self.rank else None
            outcome = kill_if_here(record) if record is not None else None
            if outcome is not None:
                outcomes.append((r, record.pid, outcome))
        return outcomes

    @staticmethod
    def _kill_note(outcomes: list[tuple[int, int, str]]) -> str:
        return "".join(
            f"; killed rank {r}'s process (pid {pid}) on this host"
            if outcome == KILLED
            else f"; rank {r}'s process (pid {pid}) on this host has ended"
            for r, pid, outcome in outcomes
        )

    # -- after a collective failed ------------------------------------------------------------------------
    def diagnose(self, wait: Optional[float] = None) -> list[int]:
        """After an error on this rank: which peers went silent? Marks this rank as failed (not
        dead), then watches for ``wait`` seconds; a peer that neither beats nor marks itself is dead
        or frozen. Stops early (returning []) once another rank has claimed the failure."""
        if self.store is None or self.world == 1:
            return []
        self.stop_beating(FAILED)
        wait = wait if wait is not None else 2.5 * self.interval + 1.0
        first = self._counters()
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            time.sleep(min(0.25, max(0.0, deadline - time.monotonic())))
            try:
                if self.read_failure() is not None:
                    return []
            except Exception:  # noqa: BLE001
                break
        second = self._counters()
        return [r for r in range(self.world) if r != self.rank and first.get(r) is not None and first.get(r) == second.get(r)]

    def stop_beating(self, state: str) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
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


def _add_note(exception: BaseException, line: str) -> None:
    if hasattr(exception, "add_note"):
        exception.add_note(line)
    elif exception.args:  # Python 3.10
        exception.args = (f"{exception.args[0]}\n{line}", *exception.args[1:])


# -- ending the process ---------------------------------------------------------------------------------------
_exiting: dict[str, int] = {}  # "thread": the one ending the process (claimed with an atomic setdefault)
_exit_entries = itertools.count()  # entries into _exit_with by that thread (next() is atomic)
_reported: dict[str, Any] = {}  # the exception report() judged, with its monitor and one-line verdict
_hook: dict[str, Any] = {"previous": None}


def _exit_with(message: str) -> None:
    """Print one line and end this process now: no traceback, no C++ teardown noise from gloo."""
    me = threading.get_ident()
    if _exiting.setdefault("thread", me) != me:
        threading.Event().wait()  # another thread is already ending the process
    if next(_exit_entries):
        # a signal handler re-entered this thread while it ends the process (the parent-death signal
        # comes once per thread of the dying launcher): the interrupted frame finishes the exit;
        # waiting here, as before, stopped it forever
        return
    # os.write, not print: this may run in a signal handler that interrupted the main thread inside a
    # write to the same stream, where print/flush would raise ("reentrant call") and never reach _exit
    try:
        os.write(2, f"{message}\n".encode())
    except OSError:
        pass
    try:
        launch_guard.reap_children()
        sys.stdout.flush()
    except Exception:  # noqa: BLE001 - ending anyway
        pass
    os._exit(1)


def watch_launcher(rank: int) -> bool:
    """End this rank with one line as soon as the launcher that started it dies (``launch_guard``)."""
    return launch_guard.watch_launcher(rank, _exit_with)


def _judged(value: BaseException) -> bool:
    seen: Optional[BaseException] = value
    while seen is not None:
        if seen is _reported.get("exception"):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _excepthook(etype: type, value: BaseException, tb: Any) -> None:
    """An exception ends this rank. The rank that failed first prints its traceback; every other
    rank waits for it, then prints one line (no traceback, no gloo frames)."""
    previous = _hook["previous"] or sys.__excepthook__
    if not _judged(value):
        previous(etype, value, tb)
        return
    monitor: HealthMonitor = _reported["monitor"]
    line: Optional[str] = _reported["line"]
    failure = monitor.failure
    expected = monitor.world - (len(failure.ranks) if failure is not None and failure.kind == SILENT else 0)
    if line is None:
        previous(etype, value, tb)
        sys.stderr.flush()
        monitor._finish(expected, reported=True)
        return
    if failure is not None and failure.kind == ERROR and failure.by != monitor.rank:
        monitor._wait_reported()
    monitor._finish(expected)
    _exit_with(line)


def _install_excepthook() -> None:
    if sys.excepthook is not _excepthook:
        _hook["previous"] = sys.excepthook
        sys.excepthook = _excepthook


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


# -- torch's NCCL watchdog ------------------------------------------------------------------------------------
NCCL_FLIGHT_RECORDER_ENTRIES = 2000  # torch's recommended ring size (its own default in recent releases)
NCCL_DUMP_DIR = "nccl_flight_recorder"  # under the working directory: one file per rank, <dir>/rank_<r>
# Variables torch reads under two names; one setting, whichever name the user gave it.
_NCCL_ALIASES = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": ("NCCL_ASYNC_ERROR_HANDLING",),
    "TORCH_FR_BUFFER_SIZE": ("TORCH_NCCL_TRACE_BUFFER_SIZE",),
    "TORCH_NCCL_TRACE_BUFFER_SIZE": ("TORCH_FR_BUFFER_SIZE",),
    "TORCH_FR_DUMP_TEMP_FILE": ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE",),
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": ("TORCH_FR_DUMP_TEMP_FILE",),
}


def _flight_recorder_names() -> tuple[str, str]:
    """(buffer size, dump file prefix): torch 2.8 renamed them TORCH_FR_*; the old TORCH_NCCL_* names
    still work in 2.13 but warn that they are deprecated."""
    from torch.torch_version import TorchVersion, __version__

    if TorchVersion(__version__) >= (2, 8):
        return "TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE"
    return "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"


def nccl_watchdog_environment(timeout: Optional[timedelta] = None, dump_dir: Optional[str] = None) -> dict[str, str]:
    """The settings of torch's NCCL watchdog this project wants (names checked against torch 2.13's
    ProcessGroupNCCL.hpp and FlightRecorder.hpp; torch reads them when a NCCL process group is created):

    - ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``: when a collective times out (the strategy's ``timeout``)
      or fails, the watchdog tears the process down instead of leaving it blocked on the GPU; 3
      (SkipCleanUp) skips ``ncclCommAbort``, which can itself hang when a peer is gone. (1 also tears
      down, after aborting the communicators; torchrun's agent sets 1, and a value already set is kept.)
    - ``TORCH_NCCL_ENABLE_MONITORING=1``, ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC``: a monitor thread aborts
      the process when the watchdog thread itself stops beating (stuck in a CUDA or NCCL call) for
      that long: the collective timeout, between 60 s and torch's default of 480 s.
    - the flight recorder: a ring of the last ``NCCL_FLIGHT_RECORDER_ENTRIES`` collectives per rank
      (``TORCH_FR_BUFFER_SIZE``; before torch 2.8 ``TORCH_NCCL_TRACE_BUFFER_SIZE``), dumped on a
      timeout or error (``TORCH_NCCL_DUMP_ON_TIMEOUT=1``, which needs the two above) to
      ``<dump_dir>/rank_<r>`` (``TORCH_FR_DUMP_TEMP_FILE``; before 2.8
      ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``): which collective each rank was in, and who never joined.
    """
    seconds = timeout.total_seconds() if timeout is not None else 480.0
    buffer_size, dump_file = _flight_recorder_names()
    directory = dump_dir if dump_dir is not None else os.path.join(os.getcwd(), NCCL_DUMP_DIR)
    return {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
        "TORCH_NCCL_ENABLE_MONITORING": "1",
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": str(int(min(480.0, max(60.0, seconds)))),
        buffer_size: str(NCCL_FLIGHT_RECORDER_ENTRIES),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        dump_file: os.path.join(directory, "rank_"),
    }


def apply_nccl_watchdog_defaults(timeout: Optional[timedelta] = None, dump_dir: Optional[str] = None) -> dict[str, str]:
    """Set ``nccl_watchdog_environment`` in ``os.environ`` where the user has not set the variable (or
    its other name); return what was set. Call it before the NCCL process group is created."""
    applied: dict[str, str] = {}
    for name, value in nccl_watchdog_environment(timeout, dump_dir).items():
        if any(n in os.environ for n in (name, *_NCCL_ALIASES.get(name, ()))):
            continue
        os.environ[name] = value
        applied[name] = value
    dump = next((v for k, v in applied.items() if k.endswith("_TEMP_FILE")), None)
    if dump is not None:
        os.makedirs(os.path.dirname(dump), exist_ok=True)
    return applied


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
                from lightning_3d.core.topology import destroy_world

                destroy_world()
            except Exception:  # noqa: BLE001 - exiting anyway
                pass

    atexit.register(_cleanup)


def mark_failed() -> None:
    """Record that this process is ending on an error, so exit cleanup leaves the group alone."""
    _exit_cleanup["failed"] = True



def form_process_group(
    environment: Any, backend: str, timeout: timedelta, device: Any, *, nodes: int, per_node: int, rank: int, node: int
) -> None:
    """Join the job's process group (through this attempt's rendezvous store under torchrun). A job
    that does not form within ``timeout`` -- a node never started, ``num_nodes`` larger than the
    allocation -- ends with one line naming what was expected and what to do, not a store traceback."""
    from lightning.fabric.utilities.distributed import _distributed_is_initialized, _init_dist_connection

    kwargs: dict[str, Any] = {"timeout": timeout}
    if device.type != "cpu":
        kwargs["device_id"] = device
    store = elastic_attempt_store(timeout)
    if store is not None and not _distributed_is_initialized():
        kwargs["store"] = store
    try:
        _init_dist_connection(environment, backend, **kwargs)
    except (RuntimeError, dist.DistError) as err:
        if "timeout" not in str(err).lower() and "timed out" not in str(err).lower():
            raise
        cause = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise RuntimeError(
            f"lightning_3d: the job did not form within timeout={timeout.total_seconds():.0f} s ({cause}): it "
            f"expects {nodes * per_node} ranks (num_nodes={nodes} x devices={per_node}), and not all of them joined "
            f"{os.environ.get('MASTER_ADDR', 'localhost')}:{os.environ.get('MASTER_PORT', '?')} (this is rank "
            f"{rank}, node {node}). Start the same command on every node (SLURM: srun, or "
            f"torchrun per node), or set num_nodes to the nodes you have."
        ) from None
