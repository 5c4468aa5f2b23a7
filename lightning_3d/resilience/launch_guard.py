"""No rank outlives its job: the launcher's children follow it, and a frozen rank can be killed.

Small pieces, each usable alone:

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
- Hydra multirun: the popen launcher starts each job's ranks on that job alone, in the job's
  directory (``multirun_job_command``); ``release_job_ranks`` readies the process for the next job.
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
    """Host name, pid namespace and boot id: a pid means something only inside all three (two nodes
    with one host name share the initial namespace's inode, not the boot id)."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{namespace}/{boot}"


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


def _gone(fields: Optional[list[str]], start: Optional[str]) -> bool:
    """From ``_stat``: the process is not (or no longer) the one started at ``start``: missing, dead
    (a zombie), or its pid recycled."""
    return fields is None or fields[0] in ("Z", "X") or (start is not None and fields[19] != start)


KILLED, ENDED = "killed", "ended"


def kill_if_here(record: ProcessRecord) -> Optional[str]:
    """SIGKILL the process of ``record`` if it runs on this host and is still that process.

    Returns ``KILLED``; ``ENDED`` when the recorded process on this host had already ended (a zombie,
    reaped, or its pid recycled: a peer on this host may have killed it a moment before); None when it
    runs elsewhere. Two ranks that notice the same silent peer both try: one kills, the other finds
    it ended, and either may be the one whose line the job prints."""
    if not record.start or record.host != _host() or record.pid == os.getpid():
        return None  # (no start time: /proc was unreadable when it was recorded, so nothing can be told here)
    if _gone(_stat(record.pid), record.start):
        return ENDED
    try:
        os.kill(record.pid, signal.SIGKILL)
    except OSError:
        return ENDED  # gone between the look and the kill
    return KILLED


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
        _remember_environment()
        os.environ[LAUNCHER] = f"{os.getpid()}:{self.cluster_environment.node_rank() * self.num_processes}"
        try:
            if _hydra_multirun():
                self._call_children_of_a_multirun_job()
            else:
                super()._call_children_scripts()
        finally:
            os.environ.pop(LAUNCHER, None)

    def _call_children_of_a_multirun_job(self) -> None:
        """Lightning's ``_call_children_scripts`` for a Hydra multirun job: Lightning would re-run the
        whole command line (``-m`` and the sweep included) with ``hydra.run.dir``, so each rank would
        start a sweep of its own, outside the job's directory. Here each child runs this job alone
        (its resolved overrides, in single-run mode) with the job's output directory as its run dir."""
        from hydra.utils import get_original_cwd

        self._check_can_spawn_children()
        self.procs = []
        os.environ["MASTER_ADDR"] = self.cluster_environment.main_address
        os.environ["MASTER_PORT"] = str(self.cluster_environment.main_port)
        os.environ["NODE_RANK"] = str(self.cluster_environment.node_rank())
        os.environ["LOCAL_RANK"] = str(self.cluster_environment.local_rank())
        os.environ["WORLD_SIZE"] = f"{self.num_processes * self.num_nodes}"
        for local_rank in range(1, self.num_processes):
            env = os.environ.copy()
            env["LOCAL_RANK"] = f"{local_rank}"
            if os.environ.get("PL_GLOBAL_SEED") is None:
                env.pop("PL_GLOBAL_SEED", None)
            self.procs.append(subprocess.Popen(multirun_job_command(local_rank), env=env, cwd=get_original_cwd()))


# -- Hydra multirun: ranks of one job --------------------------------------------------------------------
_LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")
_environment_before: dict[str, Optional[str]] = {}
# Hydra flags that take a value (kept for the children); -m/--multirun is dropped.
_HYDRA_VALUE_FLAGS = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd", "--experimental-rerun")


def _hydra_multirun() -> bool:
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode
    except ImportError:
        return False
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _remember_environment() -> None:
    if not _environment_before:
        _environment_before.update({name: os.environ.get(name) for name in _LAUNCH_VARIABLES})


def multirun_job_command(local_rank: int) -> list[str]:
    """The command of local rank ``local_rank`` of the current Hydra multirun job: the script, its
    Hydra flags (``--config-dir`` ...), the job's own overrides (one value per swept key), the user's
    ``hydra.*`` overrides that are not about sweeping, and the job's output directory as run dir."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import to_absolute_path

    import __main__

    hydra = HydraConfig.get()
    if __main__.__spec__ is None:
        command = [sys.executable, to_absolute_path(sys.argv[0])]
    else:
        command = [sys.executable, "-m", __main__.__spec__.name]
    argv = sys.argv[1:]
    for i, arg in enumerate(argv):
        if arg in _HYDRA_VALUE_FLAGS and i + 1 < len(argv):
            command += [arg, argv[i + 1]]
        elif arg.startswith(tuple(f"{flag}=" for flag in _HYDRA_VALUE_FLAGS)):
            command.append(arg)
    command += list(hydra.overrides.task)
    sweeping = ("hydra.mode=", "hydra.sweep.", "hydra/sweeper", "hydra.sweeper.", "hydra/launcher", "hydra.launcher.",
                "hydra.run.dir=", "hydra.job.name=", "hydra.output_subdir=")
    command += [o for o in hydra.overrides.hydra if not o.lstrip("+~").startswith(sweeping)]
    command += [
        f'hydra.run.dir="{hydra.runtime.output_dir}"',
        f"hydra.job.name=train_ddp_process_{local_rank}",
        "hydra.output_subdir=null",  # the job's .hydra/ is the launcher's to write
    ]
    return command


def release_job_ranks(wait_s: float = 120.0) -> None:
    """After one job of a Hydra multirun that launched ranks in this process: wait for its ranks,
    close the process group and unset the launch variables, so the next job (in this same process,
    with Hydra's basic launcher) launches its own ranks on a fresh port instead of taking the
    ``LOCAL_RANK`` left behind for ranks started by someone else (``apps.recipe.end_multirun_job``)."""
    deadline = time.monotonic() + wait_s
    for child in list(_children):
        try:
            child.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    failed = [c.returncode for c in _children if c.returncode != 0]
    _children.clear()
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from lightning_3d.core.topology import destroy_world

        destroy_world()
    for name, value in _environment_before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    _environment_before.clear()
    if failed:
        raise RuntimeError(f"lightning_3d: {len(failed)} rank(s) of this multirun job exited with {failed}")


class GuardedMultiProcessingLauncher(_MultiProcessingLauncher):
    """Lightning's spawn/fork/forkserver launcher whose children end when the main process dies."""

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        os.environ[LAUNCHER] = f"{os.getpid()}:"
        previous = None
        if threading.current_thread() is threading.main_thread():
            # this process is no rank: a scheduler's SIGTERM (Kubernetes sends it to PID 1 alone) must reach
            # the ranks, which write a checkpoint at the step and exit (lightning_3d/resilience/preemption.py)
            previous = signal.signal(signal.SIGTERM, self._forward_sigterm)
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        finally:
            os.environ.pop(LAUNCHER, None)
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)

    def _forward_sigterm(self, signum: int, frame: Any) -> None:
        for process in getattr(self, "procs", []) or []:
            if process.is_alive():
                os.kill(process.pid, signal.SIGTERM)


# -- the child's side ---------------------------------------------------------------------------------------
_watch: dict[str, Any] = {"parent": None, "parent_start": None, "launcher": None, "launcher_start": None, "line": None}


def _set_parent_death_signal(signum: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


_checkpoints: list[str] = []  # checkpoints this process saved or resumed from, newest last


def note_checkpoint(path: object) -> None:
    """Remember that this run saved (or resumed from) a checkpoint: failure lines then say how to resume."""
    _checkpoints.append(str(path))


def restart_hint() -> str:
    """The advice a failure line ends with: resume from the last checkpoint only if there is one."""
    if _checkpoints:
        return "Restart with ckpt_path='last' to resume from the last complete checkpoint."
    return (
        "No checkpoint was saved or loaded in this run, so a restart begins at step 0 (Lightning's "
        "ModelCheckpoint(every_n_train_steps=N) saves them)."
    )


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

    def line() -> str:  # (when it happens: a checkpoint may have been written by then)
        return f"lightning_3d: rank {rank}: its launcher ({who}) died; ending rank {rank} too. {restart_hint()}"

    parent = os.getppid()
    if threading.current_thread() is threading.main_thread():
        signal.signal(DEATH_SIGNAL, lambda signum, frame: end(line()))
        _set_parent_death_signal(DEATH_SIGNAL)
    _watch.update(parent=parent, parent_start=None, launcher=None, launcher_start=None, line=line)
    # where /proc is this namespace's, it tells an exiting launcher before the kernel reparents this rank
    of_parent = _stat(parent) if _proc_is_ours() else None
    if of_parent is not None:
        _watch.update(parent_start=of_parent[19])
        if pid == parent or of_parent[1] == str(pid):  # the parent, or the forkserver's parent; any other pid is stale
            _watch.update(launcher=pid, launcher_start=_start_of(pid))
    if launcher_died():  # it died before the request was in place
        end(line())
    return True


def unwatch_launcher() -> None:
    """After training: a rank that outlives its launcher by a moment at the end of a run is fine."""
    if _watch["parent"] is not None:
        _set_parent_death_signal(0)
        _watch.update(parent=None, parent_start=None, launcher=None, launcher_start=None, line=None)


_PF_EXITING = 0x4  # in /proc/<pid>/stat's flags: the process has begun to exit


def _proc_is_ours() -> bool:
    """Whether /proc describes this process's pid namespace (not so in a sandbox that unshared the
    namespace without remounting /proc, nor off Linux): this process's own entry names its parent."""
    fields = _stat(os.getpid())
    return fields is not None and fields[1] == str(os.getppid())


def _start_of(pid: int) -> Optional[str]:
    fields = _stat(pid)
    return fields[19] if fields is not None else None


def is_exiting(pid: int, start: Optional[str] = None) -> bool:
    """Whether process ``pid`` (started at ``start``, when given) is gone or on its way out. Linux
    marks a process exiting first, closes its sockets later and reparents its children last: a rank
    that sees the launcher's store or gloo connection drop may still read the old parent from
    ``getppid()``, but never an unmarked launcher. Only meaningful where ``_proc_is_ours()``."""
    fields = _stat(pid)
    return _gone(fields, start) or int(fields[6]) & _PF_EXITING != 0


def launcher_died() -> Optional[str]:
    """The one-line report if this rank's launcher is gone or exiting (its parent changed; or, where
    /proc can be read, the parent or the launcher is marked exiting, a zombie or gone), else None."""
    parent = _watch["parent"]
    if parent is None:
        return None
    if os.getppid() != parent:
        return _watch["line"]()
    if _watch["parent_start"] is not None and is_exiting(parent, _watch["parent_start"]):
        return _watch["line"]()
    if _watch["launcher"] is not None and is_exiting(_watch["launcher"], _watch["launcher_start"]):
        return _watch["line"]()
    return None
