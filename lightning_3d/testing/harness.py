"""Run a function on N CPU ranks (gloo) with a hard timeout: the harness for multi-rank tests.

Ranks are forked from a forkserver that has already imported torch and Lightning, so a
world starts in well under a second instead of paying the import cost per rank. A rank
that raises has its traceback re-raised in the caller with its rank number; a rank that
dies or a world that hangs is killed at the deadline; nothing is left running.

    results = run_on_ranks(check_something, 2, some_arg, timeout=120)

``fn`` must be importable (a module-level function) and its arguments and return value
picklable. Inside ``fn`` the default process group already exists (unless
``init_process_group=False``) and the usual ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/
``MASTER_*`` variables are set, so a ``Trainer`` started there joins that world.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_module
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Optional

# what every rank would import after the fork (the package root is lazy: name the strategy and the
# reference model, which import nearly all the rest)
_PRELOAD = ["torch", "torch.distributed", "lightning", "lightning_3d", "lightning_3d.plugins.strategy", "lightning_3d.models.gpt"]
_context: Optional[Any] = None


class RankError(RuntimeError):
    """A rank raised, died, or the world did not finish in time."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mp_context() -> Any:
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(_PRELOAD)
    return _context


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    procs_per_node: int,
    port: int,
    results: Any,
    args: tuple,
    kwargs: dict,
    init_process_group: bool,
    timeout: float,
    strict: bool,
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank % procs_per_node),
        LOCAL_WORLD_SIZE=str(procs_per_node),
        NODE_RANK=str(rank // procs_per_node),
        OMP_NUM_THREADS="1",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if init_process_group:
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=timeout),
            )
        if strict and init_process_group:
            from lightning_3d.testing.strict_comm import strict_comm

            # report a P2P deadlock by its items well before the world's deadline kills the ranks
            with strict_comm(deadlock_after=max(5.0, 0.6 * timeout)):
                value = fn(*args, **kwargs)
        else:
            value = fn(*args, **kwargs)
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - report everything, including SystemExit
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            _leave_together(rank, world_size, min(timeout, 60.0))
            try:
                from lightning_3d.core.topology import destroy_world

                destroy_world()
            except Exception:  # noqa: BLE001
                pass


def _leave_together(rank: int, world_size: int, patience: float) -> None:
    """Rank 0 hosts the store: it stays until every rank has finished (or ``patience`` s). A rank
    done early must not take the store away from peers still using it: ``new_group`` connects a
    group's members through it, and a rank outside the group returns at once (seen under load: rank 3
    failed with 'Failed to recv, got 0 bytes' making a DeviceMesh that rank 0 was not part of)."""
    import torch.distributed as dist

    try:
        store = dist.distributed_c10d._get_default_store()
        store.add("lightning_3d/harness/finished", 1)
        if rank == 0:
            deadline = time.monotonic() + patience
            while store.add("lightning_3d/harness/finished", 0) < world_size and time.monotonic() < deadline:
                time.sleep(0.01)
    except Exception:  # noqa: BLE001 - a peer's store connection already gone: nothing left to wait for
        pass


def _kill(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)


def _root_cause(name: str, procs: list[Any], rank: int, error: str) -> str:
    """A rank's error, unless another rank died first: a rank that hosts the store and exits makes its
    peers fail in their own set-up ('Connection reset by peer'), and the death is what to name."""
    time.sleep(0.2)  # the dead rank's exit is seen once the process is reaped
    dead = [(r, p.exitcode) for r, p in enumerate(procs) if r != rank and p.exitcode not in (None, 0)]
    if dead:
        r, code = dead[0]
        return f"{name}: rank {r} died with exit code {code}; then rank {rank} raised:\n{error}"
    return f"{name}: rank {rank} raised:\n{error}"


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    init_process_group: bool = True,
    nodes: int = 1,
    strict: Optional[bool] = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return the per-rank results in rank order.

    ``nodes`` simulates a multi-node layout (``NODE_RANK``/``LOCAL_RANK`` set accordingly).
    ``strict``: run ``fn`` under NCCL's rules (:mod:`lightning_3d.testing.strict_comm`); default: on when
    ``LIGHTNING_3D_STRICT_COMM=1`` (the test suite sets it; benchmarks leave it off).
    Raises :class:`RankError` with the failing rank's traceback, the dead rank's exit code, or the
    ranks still running at the deadline.
    """
    if world_size < 1 or world_size % nodes:
        raise ValueError(f"world_size={world_size} must be a positive multiple of nodes={nodes}.")
    if strict is None:
        from lightning_3d.testing.strict_comm import enabled_by_env

        strict = enabled_by_env()
    ctx = _mp_context()
    port = free_port()
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, rank, world_size, world_size // nodes, port, results, args, kwargs, init_process_group, timeout, strict),
            name=f"rank{rank}",
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    done: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(done) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(done))
                raise RankError(f"{fn.__name__}: ranks {missing} did not finish within the {timeout:.0f} s timeout.")
            try:
                rank, ok, value = results.get(timeout=min(remaining, 0.5))
            except queue_module.Empty:
                for rank, p in enumerate(procs):
                    if rank not in done and p.exitcode is not None:
                        # It may have reported just before exiting: drain once more before blaming it.
                        time.sleep(0.2)
                        if results.empty():
                            raise RankError(f"{fn.__name__}: rank {rank} died with exit code {p.exitcode}.")
                        break
                continue
            if not ok:
                raise RankError(_root_cause(fn.__name__, procs, rank, value))
            done[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5 if len(done) == world_size else 0)
        _kill(procs)
    return [done[r] for r in range(world_size)]
