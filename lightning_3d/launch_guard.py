"""No rank outlives its job: the launcher's children follow it, and a frozen rank can be killed.

Three small pieces, each usable alone:

- ``GuardedSubprocessScriptLauncher`` / ``GuardedMultiProcessingLauncher``: Lightning's launchers,
  plus a note in each child's environment naming the launcher. At its exit the launcher waits a
  moment for its children and SIGKILLs any that are stopped (a SIGSTOPped process still receives
  SIGKILL). Lightning's child-process observer is replaced by one that gives the ranks time to
  report a child's failure before it kills them.
- ``watch_launcher``: in such a child, asks Linux to signal it when its parent dies
  (``prctl(PR_SET_PDEATHSIG)``); the rank then prints one line and exits at once instead of
  running on as an orphan that fails later with raw gloo errors.
- ``ProcessRecord``: host, pid and start time of a rank, published in the rendezvous store so that a
  peer on the same host can SIGKILL it once it is known to be frozen, and nothing else with a
  recycled pid.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher

LAUNCHER = "LIGHTNING_3D_LAUNCHER"  # "<pid>:<global rank of the launcher, or empty>" in a child's environment
DEATH_SIGNAL = signal.SIGRTMIN + 5 if hasattr(signal, "SIGRTMIN") else None  # unused by Lightning and torch
_PR_SET_PDEATHSIG = 1
CHILD_GRACE_S = 10.0  # how long a launcher waits at its exit for children that are still ending


# -- identifying a process across the store ---------------------------------------------------------------
@dataclass(frozen=True)
class ProcessRecord:
    host: str  # host name and pid namespace: a pid means something only inside both
    pid: int
    start: str  # start time in clock ticks since boot: tells a recycled pid apart

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, text: bytes | str) -> "ProcessRecord":
        return cls(**json.loads(text))


def _host() -> str:
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return f"{socket.gethostname()}/{namespace}"


def _stat(pid: int) -> Optional[list[str]]:
    """Fields of /proc/<pid>/stat after the command name: [state, ppid, ...]; None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def process_record(pid: Optional[int] = None) -> ProcessRecord:
    """The record of process ``pid`` on this host (default: this process)."""
    pid = os.getpid() if pid is None else pid
    fields = _stat(pid)
    return ProcessRecord(_host(), pid, fields[19] if fields else "")


def kill_if_here(record: ProcessRecord) -> bool:
    """SIGKILL the process of ``record`` if it runs on this host and is still that process."""
    if record.host != _host() or record.pid == os.getpid():
        return False
    fields = _stat(record.pid)
    if fields is None or fields[19] != record.start or fields[0] == "Z":
        return False
    try:
        os.kill(record.pid, signal.SIGKILL)
    except OSError:
        return False
    return True


def is_stopped(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] == "T"


# -- the launcher's side ------------------------------------------------------------------------------------
_children: list[subprocess.Popen] = []
_reaped = {"registered": False}


def reap_children(wait_s: float = CHILD_GRACE_S) -> None:
    """At the launcher's exit: wait up to ``wait_s`` for the children to end, SIGKILLing stopped ones.

    Children still running afterwards get the parent-death signal when this process exits."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = [c for c in _children if c.poll() is None]
        for child in alive:
            if is_stopped(child.pid):
                try:
                    os.kill(child.pid, signal.SIGKILL)
                except OSError:
                    pass
        if not alive or time.monotonic() >= deadline:
            return
        time.sleep(0.1)


def _guard(children: list[subprocess.Popen], grace_s: float) -> None:
    _children[:] = children
    if not _reaped["registered"]:
        _reaped["registered"] = True
        atexit.register(reap_children)
    if children:
        _ChildObserver(children, grace_s).start()


class _ChildObserver(threading.Thread):
    """Lightning's observer SIGKILLs everything as soon as one child exits with an error, which can cut
    off the failing rank's traceback and the others' one-line reports. This one waits ``grace_s``
    after the first failed child: the ranks end themselves well before; it ends what is left."""

    def __init__(self, children: list[subprocess.Popen], grace_s: float) -> None:
        super().__init__(daemon=True, name="lightning_3d-children")
        self.children, self.grace_s = children, grace_s

    def run(self) -> None:
        failed_at: Optional[float] = None
        while True:
            time.sleep(1.0)
            codes = [c.poll() for c in self.children]
            if all(code == 0 for code in codes):
                return
            if failed_at is None and any(code not in (None, 0) for code in codes):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > self.grace_s:
                for child in self.children:
                    if child.poll() is None:
                        os.kill(child.pid, signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)


class GuardedSubprocessScriptLauncher(_SubprocessScriptLauncher):
    """Lightning's ``popen`` launcher whose children end with it (see the module docstring)."""

    def __init__(self, *args: Any, grace_s: float = 60.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.grace_s = grace_s

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        # Lightning's launch, with _guard in place of its _launch_process_observer.
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            _guard(self.procs, self.grace_s)
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)

    def _call_children_scripts(self) -> None:
        os.environ[LAUNCHER] = f"{os.getpid()}:{self.cluster_environment.node_rank() * self.num_processes}"
        try:
            super()._call_children_scripts()
        finally:
            os.environ.pop(LAUNCHER, None)


class GuardedMultiProcessingLauncher(_MultiProcessingLauncher):
    """Lightning's spawn/fork/forkserver launcher whose children end when the main process dies."""

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        os.environ[LAUNCHER] = f"{os.getpid()}:"
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        finally:
            os.environ.pop(LAUNCHER, None)


# -- the child's side ---------------------------------------------------------------------------------------
_watch: dict[str, Any] = {"parent": None, "line": None}


def _set_parent_death_signal(signum: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def watch_launcher(rank: int, end: Callable[[str], None]) -> bool:
    """In a rank started by a guarded launcher: call ``end(line)`` as soon as the launcher dies.

    The kernel signals this process when its parent exits (the forkserver's parent, for
    ``forkserver``); the handler runs in the main thread as soon as it is back in Python. A thread
    blocked elsewhere is covered by ``launcher_died``, which the heartbeat thread polls. Returns
    whether this process is watched."""
    value = os.environ.get(LAUNCHER)
    if not value or DEATH_SIGNAL is None:
        return False
    pid_text, _, rank_text = value.partition(":")
    pid = int(pid_text)
    if pid == os.getpid():  # the launcher itself (its environment is restored after spawning)
        return False
    who = f"rank {rank_text}, pid {pid}" if rank_text else f"pid {pid}"
    line = (
        f"lightning_3d: rank {rank}: its launcher ({who}) died; ending rank {rank} too. "
        f"Restart with ckpt_path='last' to resume from the last complete checkpoint."
    )
    parent = os.getppid()
    if threading.current_thread() is threading.main_thread():
        signal.signal(DEATH_SIGNAL, lambda signum, frame: end(line))
        _set_parent_death_signal(DEATH_SIGNAL)
    _watch.update(parent=parent, line=line)
    if launcher_died():  # it died before the request was in place
        end(line)
    return True


def unwatch_launcher() -> None:
    """After training: a rank that outlives its launcher by a moment at the end of a run is fine."""
    if _watch["parent"] is not None:
        _set_parent_death_signal(0)
        _watch.update(parent=None, line=None)


def launcher_died() -> Optional[str]:
    """The one-line report if this rank's launcher is gone (its parent changed), else None."""
    if _watch["parent"] is None or os.getppid() == _watch["parent"]:
        return None
    return _watch["line"]
