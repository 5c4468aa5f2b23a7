"""NCCL's rules on gloo: make CPU ranks fail where a GPU cluster would.

Gloo forgives three things NCCL does not. Under :func:`strict_comm` (on in every multi-rank test;
``LIGHTNING_3D_STRICT_COMM=1`` turns it on in any run, e.g. to check a model on a laptop):

a. **Host tensors.** A tensor that lightning_3d code created without ``device=`` (the CPU default),
   moved to the host (``.cpu()``, ``pin_memory``), or that lives in offloaded host memory
   (:func:`mark_host`), and anything computed from it alone, is *host-tagged*; handing one to a
   collective or a point-to-point call raises :class:`StrictCommError` naming where it was made.
   The collectives include torch's functional ones, which DTensor calls (``full_tensor``,
   ``redistribute``): a host-tagged shard's local tensor is refused there too.
   A ``TorchFunctionMode`` does the tagging; ``.to(device=...)`` clears it. Model code
   (``lightning_3d.models``) is exempt: it builds on the CPU and is moved, as any PyTorch model is.
b. **Tags are dropped.** Point-to-point messages match in posting order per (group, sender,
   receiver), as NCCL matches them. A matched pair whose tags, dtypes or sizes differ is an error
   naming both call sites (gloo would have matched by tag, or silently delivered other bytes).
c. **Rendezvous.** A send completes only once its receive has started, and a rank's P2P items run
   in posting order per stream, as NCCL's: a ``batch_isend_irecv`` batch on its group's stream
   (with the group's collectives, which wait for the batches posted before them), a single
   send/recv on the stream of its pair of ranks; an item waits until the items before it completed. An ordering deadlock then hangs on CPU with tiny tensors,
   as NCCL hangs with large ones; a wait longer than ``deadlock_after`` seconds raises, naming the
   items each side is stuck on (else the harness kills the world at its deadline).

P2P operations go through a per-process engine thread that posts gloo ``isend``/``irecv`` with
tag 0 once an item reaches the head of its queues; receivers acknowledge through the rendezvous
store, which also carries each send's description for the mismatch check (tests only: this is
O(messages) store traffic).
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
import time
from collections import defaultdict, deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.distributed._functional_collectives as funcol
from torch import Tensor
from torch.overrides import TorchFunctionMode

STRICT_ENV = "LIGHTNING_3D_STRICT_COMM"
_GROUP_STREAM = -1  # the queue of a group's batches and collectives (its communicator's stream)
_ATTR = "_lightning_3d_host_site"
_PACKAGE = "lightning_3d"
_EXEMPT = ("lightning_3d.models", "lightning_3d.testing.strict_comm", "lightning_3d.testing.harness", "lightning_3d.planner")
_FACTORIES = {
    torch.zeros, torch.ones, torch.empty, torch.full, torch.tensor, torch.arange, torch.linspace,
    torch.logspace, torch.eye, torch.rand, torch.randn, torch.randint, torch.randperm, torch.scalar_tensor,
    torch.empty_strided,
}  # fmt: skip
_HOST_MOVES = {"cpu", "pin_memory"}
_HOST_SOURCES = {torch.from_numpy}
_CONVERSIONS = {torch.as_tensor, torch.asarray}  # host memory when given Python data and no device


class StrictCommError(RuntimeError):
    """Gloo would have accepted this; NCCL would fail or hang."""


def enabled_by_env() -> bool:
    return os.environ.get(STRICT_ENV, "0") not in ("", "0", "false", "False")


# -- (a) host tensors ------------------------------------------------------------------------------------------
_DISPATCH = ("torch.overrides", "torch._tensor", "torch.functional")  # Python wrappers that only dispatch


def _caller(depth: int = 2) -> tuple[str, str]:
    """(module, "file:line") of the code that called the torch function (past dispatch wrappers): a
    tensor torch's own code makes (inside ``broadcast_object_list``, say) is not ours. ``depth``: the
    frames between this function and ``__torch_function__``'s caller."""
    frame = sys._getframe(depth)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module != __name__ and module not in _DISPATCH:
            return module, f"{_short(frame.f_code.co_filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return "", "?"


def _short(path: str) -> str:
    marker = os.sep + _PACKAGE + os.sep
    return _PACKAGE + os.sep + path.split(marker, 1)[1] if marker in path else path


def _ours(module: str) -> bool:
    return (module == _PACKAGE or module.startswith(_PACKAGE + ".")) and not module.startswith(_EXEMPT)


def host_site(t: Any) -> Optional[str]:
    """Where ``t`` was made a host tensor, or None (on the compute device as far as strict mode knows)."""
    return getattr(t, _ATTR, None) if isinstance(t, Tensor) else None


def _tag(out: Any, site: str) -> None:
    if isinstance(out, Tensor):
        try:
            setattr(out, _ATTR, site)
        except Exception:  # noqa: BLE001 - a tensor type without a __dict__
            pass
        local = getattr(out, "_local_tensor", None)  # a DTensor: to_local() hands out a view of this
        if local is not None:
            _tag(local, site)
    elif isinstance(out, (tuple, list)):
        for o in out:
            _tag(o, site)


def mark_host(t: Tensor, why: str) -> Tensor:
    """Declare ``t`` host memory (offloaded state, FSDP2's CPU-offloaded shards): a no-op outside
    strict mode but for one attribute. Returns ``t``."""
    if _state.mode is not None:
        _tag(t, why)
    return t


def _names_host(device: Any) -> bool:
    """The literal ``"cpu"``: code that says "the host". (A ``torch.device`` could be the compute
    device of a CPU run, so it counts as the device.)"""
    return isinstance(device, str) and device.split(":")[0] == "cpu"


def _to_target(args: tuple, kwargs: dict) -> Optional[str]:
    """For ``Tensor.to``: "device" or "host" when a device is named, "like" for ``x.to(other)``,
    None when only a dtype is."""
    device = kwargs.get("device")
    if device is not None:
        return "host" if _names_host(device) else "device"
    for a in args[1:]:
        if isinstance(a, Tensor):
            return "like"
        if isinstance(a, (torch.device, str, int)) and not isinstance(a, bool):
            return "host" if _names_host(a) else "device"
    return None


_FACTORY, _CONVERSION, _SOURCE, _MOVE, _IN_PLACE, _TO, _COMPUTE = range(7)
_KINDS: dict[Any, int] = {}  # torch function -> what it does to host tags (decided once per function)


def _kind_of(func: Callable) -> int:
    try:
        kind = _KINDS.get(func)
    except TypeError:  # an unhashable callable: decided each time
        return _decide_kind(func)
    if kind is None:
        kind = _KINDS[func] = _decide_kind(func)
    return kind


def _decide_kind(func: Callable) -> int:
    name = getattr(func, "__name__", "")
    if func in _FACTORIES:
        return _FACTORY
    if func in _CONVERSIONS:
        return _CONVERSION
    if func in _HOST_SOURCES:
        return _SOURCE
    if name in _HOST_MOVES:
        return _MOVE
    if name.endswith("_") and not name.endswith("__") or name == "__setitem__":
        return _IN_PLACE
    return _TO if name == "to" else _COMPUTE


def _tag_if_ours(out: Any, what: str) -> None:
    module, site = _caller(3)
    if _ours(module):
        _tag(out, f"{site} ({what})")


class _HostTracker(TorchFunctionMode):
    """Tags host tensors as they are made and carries the tag through computations on them.

    Every torch call of a strict run passes here, so the common case (a computation on device
    tensors) is one cached kind lookup and one pass over the arguments."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        original = _UNWRAPPED.get(func)
        if original is not None:  # a checked collective re-dispatched by torch.distributed: checked once already
            return original(*args, **kwargs)
        out = func(*args, **kwargs)
        kind = _kind_of(func)
        if kind == _COMPUTE:
            return _carry_tag(out, args, kwargs)
        if kind == _IN_PLACE:
            return out  # the target stays where it is
        if kind == _FACTORY:
            device, pinned = kwargs.get("device"), kwargs.get("pin_memory")
            if device is None or pinned or _names_host(device):
                _tag_if_ours(out, f"torch.{func.__name__} without device=" if device is None else "host memory")
        elif kind == _CONVERSION:
            if not isinstance(args[0] if args else None, Tensor):
                device = kwargs.get("device")
                if device is None or _names_host(device):
                    _tag_if_ours(out, f"torch.{func.__name__} without device=")
            else:
                return _carry_tag(out, args, kwargs)
        elif kind == _SOURCE:
            _tag_if_ours(out, f"torch.{func.__name__}")
        elif kind == _MOVE:
            _tag_if_ours(out, f".{func.__name__}()")
        else:
            return _moved(out, args, kwargs)
        return out


def _carry_tag(out: Any, args: tuple, kwargs: dict) -> Any:
    """A computation's result is host memory when its tensor inputs all are (scalars aside)."""
    site = None
    for a in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(a, Tensor):
            found = getattr(a, _ATTR, None)
            if found is None:
                if a.dim() > 0:
                    return out  # a device tensor takes part: the result lives on the device
            elif site is None:
                site = found
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, Tensor):
                    found = getattr(b, _ATTR, None)
                    if found is None:
                        if b.dim() > 0:
                            return out
                    elif site is None:
                        site = found
    if site is None or (args and out is args[0]):
        return out  # nothing from the host, or the input itself came back (contiguous(), ...)
    _tag(out, site)
    return out


def _moved(out: Any, args: tuple, kwargs: dict) -> Any:
    """``Tensor.to``: a named host target tags the result at the caller, a device target clears the
    tag, ``x.to(other)`` takes ``other``'s, a dtype-only cast computes like any other function."""
    target = _to_target(args, kwargs)
    if target is None:
        return _carry_tag(out, args, kwargs)
    source = host_site(args[0])
    like = host_site(args[1]) if target == "like" and len(args) > 1 else None
    site = like
    if target == "host":
        module, where = _caller(3)
        if _ours(module):
            site = where + " (.to('cpu'))"
    if out is args[0] and site != source:
        # on a CPU-only machine the move is a no-op returning the same object: hand back
        # an alias, so the source keeps its tag (or none) and the result gets its own
        out = out.detach() if not out.requires_grad else out.view_as(out)
    if out is not args[0]:
        if site is None:
            if host_site(out) is not None:
                delattr(out, _ATTR)
        else:
            _tag(out, site)
    return out


def check_device(fn: str, tensors: Any) -> None:
    """Refuse a host-tagged tensor handed to ``torch.distributed.<fn>``."""
    items = tensors if isinstance(tensors, (list, tuple)) else [tensors]
    for t in items:
        if isinstance(t, (list, tuple)):
            check_device(fn, t)
            continue
        site = host_site(t)
        if site is not None:
            raise StrictCommError(
                f"strict communication: torch.distributed.{fn} got a host tensor ({site}); NCCL accepts "
                f"only tensors on the compute device. Create it with device=<the compute device> (the "
                f"strategy's root_device, or the device of the tensors it goes with), or move it there first."
            )


# -- (b, c) point-to-point in posting order, with rendezvous ---------------------------------------------------
@dataclass(eq=False)  # compared by identity: a generated __eq__ would compare tensors
class _Op:
    send: bool
    tensor: Tensor
    peer: int  # global rank
    group: Any
    tag: int
    site: str
    seq: int = -1
    work: Any = None
    transferred: threading.Event = field(default_factory=threading.Event)  # gloo's part is over
    failure: Optional[str] = None
    done: bool = False

    def describe(self) -> str:
        arrow = f"send to rank {self.peer}" if self.send else f"recv from rank {self.peer}"
        return f"{arrow} #{self.seq} ({_kind(self.tensor)}, tag {self.tag}) at {self.site}"


def _wait_quietly(op: _Op) -> None:
    try:
        op.work.wait()
    except Exception as err:  # noqa: BLE001 - a size mismatch, a peer gone: reported by the engine
        op.failure = repr(err)
    op.transferred.set()


@dataclass(eq=False)
class _Item:
    ops: list[_Op]
    queues: list[tuple[str, int]]
    started: bool = False
    error: Optional[str] = None
    finished: threading.Event = field(default_factory=threading.Event)

    def describe(self) -> str:
        what = "batch_isend_irecv [" + "; ".join(o.describe() for o in self.ops) + "]" if len(self.ops) > 1 else self.ops[0].describe()
        return what + (" (started: waiting for the peer)" if self.started else " (queued behind earlier items)")


def _kind(t: Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"


def _scratch(kind: str, device: torch.device) -> Tensor:
    """An empty tensor of the dtype and shape ``_kind`` wrote, on ``device``."""
    dtype, _, dims = kind.partition("[")
    shape = [int(d) for d in dims.rstrip("]").split(",") if d.strip()]
    return torch.empty(shape, dtype=getattr(torch, dtype), device=device)


class _Work:
    """What ``isend``/``irecv``/``batch_isend_irecv`` return under strict mode."""

    def __init__(self, engine: "_Engine", item: _Item) -> None:
        self.engine, self.item = engine, item

    def wait(self, timeout: Any = None) -> bool:
        self.engine.wait(self.item)
        return True

    def is_completed(self) -> bool:
        return self.item.finished.is_set()

    def is_success(self) -> bool:
        return self.item.finished.is_set() and self.item.error is None

    def exception(self) -> Optional[BaseException]:
        return StrictCommError(self.item.error) if self.item.error else None

    def result(self) -> list[Tensor]:
        return [o.tensor for o in self.item.ops]


class _Engine:
    """Runs this process's P2P items in NCCL order on top of gloo (see the module docstring)."""

    def __init__(self, source: Any, deadlock_after: float) -> None:
        self.source, self.deadlock_after = source, deadlock_after
        try:
            self.store = source.clone()  # the engine thread's own connection
        except Exception:  # noqa: BLE001 - a store without clone
            self.store = source
        self.rank = dist.get_rank()
        self.lock = threading.Condition()
        self.queues: dict[tuple[str, int], deque[_Item]] = defaultdict(deque)
        self.sent: dict[tuple[str, int], int] = defaultdict(int)  # (group, peer) -> sends posted
        self.received: dict[tuple[str, int], int] = defaultdict(int)
        self.gloo_recvs: dict[tuple[str, int], int] = defaultdict(int)  # receives handed to gloo, per peer
        self.live: list[_Item] = []
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name="lightning_3d-strict-p2p", daemon=True)
        self.thread.start()

    def _key(self, group: str, src: int, dst: int, seq: int, what: str) -> str:
        return f"lightning_3d/strict/{group}/{src}>{dst}/{seq}/{what}"

    def post(self, ops: list[_Op], batched: bool) -> _Item:
        """Queue an item: a batch on its group's stream (NCCL runs ``batch_isend_irecv`` on the group's
        communicator, with its collectives), a single call on the stream of its pair of ranks."""
        with self.lock:
            queues = []
            for op in ops:
                name = c10d._get_process_group_name(op.group)
                counter = self.sent if op.send else self.received
                op.seq = counter[(name, op.peer)]
                counter[(name, op.peer)] += 1
                queue = (name, _GROUP_STREAM if batched else op.peer)
                if queue not in queues:
                    queues.append(queue)
            item = _Item(ops, queues)
            for q in queues:
                self.queues[q].append(item)
            self.live.append(item)
            self.lock.notify_all()
        return item

    def before_collective(self, group: Any, fn: str) -> None:
        """A collective on ``group`` runs behind the group's batches already posted (one stream)."""
        queue = (c10d._get_process_group_name(group), _GROUP_STREAM)
        with self.lock:
            pending = list(self.queues.get(queue, ()))
        for item in pending:
            self.wait(item, f"torch.distributed.{fn} on the same group, which NCCL runs behind it")

    def wait(self, item: _Item, waiter: str = "") -> None:
        deadline = time.monotonic() + self.deadlock_after
        while not item.finished.wait(0.05):
            if time.monotonic() > deadline:
                with self.lock:
                    stuck = [i.describe() for i in self.live if not i.finished.is_set()]
                raise StrictCommError(
                    f"strict communication: rank {self.rank} waited {self.deadlock_after:.0f} s for "
                    f"{item.describe()}{' before ' + waiter if waiter else ''}. Its unfinished point-to-point items, in posting order: {stuck}. Under NCCL "
                    f"a send completes only when the peer's matching receive runs, and each rank's items to a "
                    f"peer run in posting order: post matching sends and receives together "
                    f"(batch_isend_irecv) or in an order that cannot deadlock."
                )
        if item.error:
            raise StrictCommError(item.error)

    # the engine thread
    def _run(self) -> None:
        idle = 0.0005
        while not self.stopped:
            progressed = False
            try:
                with self.lock:
                    if not self.live and not self.stopped:
                        self.lock.wait()  # nothing in flight: sleep until post() or stop() notifies
                        continue
                    items = list(self.live)
                for item in items:
                    progressed |= self._advance(item)
            except Exception as err:  # noqa: BLE001 - fail the waiting items rather than the thread
                with self.lock:
                    for item in self.live:
                        item.error = item.error or f"strict communication engine failed: {err!r}"
                        item.finished.set()
                    self.live.clear()
                self.stopped = True  # the next post starts a new engine
                return
            if not progressed:
                with self.lock:
                    self.lock.wait(idle)
                idle = min(idle * 2, 0.005)
            else:
                idle = 0.0005

    def _advance(self, item: _Item) -> bool:
        if not item.started:
            with self.lock:
                if not all(self.queues[q][0] is item for q in item.queues):
                    return False
            for op in item.ops:
                self._start(op)
            item.started = True
            return True
        progressed = False
        for op in item.ops:
            if not op.done and self._finished(op, item):
                op.done = progressed = True
        failed = next((op.failure for op in item.ops if op.failure), None)
        if failed and not item.error:
            item.error = f"strict communication: {item.describe()} failed in gloo: {failed}"
        if all(op.done for op in item.ops):
            with self.lock:
                for q in item.queues:
                    self.queues[q].popleft()
                self.live.remove(item)
            item.finished.set()
            return True
        return progressed

    def _start(self, op: _Op) -> None:
        group = c10d._get_process_group_name(op.group)
        if op.send:
            self.store.set(self._key(group, self.rank, op.peer, op.seq, "meta"), f"{_kind(op.tensor)}|{op.tag}|{op.site}")
            self._transfer(op, _ORIGINAL["isend"](op.tensor, op.peer, op.group, 0))
        else:  # the receive has started: the send may complete; gloo's part waits for its description
            self.store.set(self._key(group, op.peer, self.rank, op.seq, "ack"), "1")

    def _transfer(self, op: _Op, work: Any) -> None:
        op.work = work
        # gloo's P2P works report completion only through wait(): wait in a thread of the op's own,
        # so one op blocked on its peer never holds up the others
        threading.Thread(target=_wait_quietly, args=(op,), name="lightning_3d-strict-wait", daemon=True).start()

    def _finished(self, op: _Op, item: _Item) -> bool:
        group = c10d._get_process_group_name(op.group)
        if op.send:
            ack = self._key(group, self.rank, op.peer, op.seq, "ack")
            if not (op.transferred.is_set() and self.store.check([ack])):
                return False
            self.store.delete_key(ack)
            return True
        if op.work is None:
            return self._match(op, item, group)
        return op.transferred.is_set()

    def _match(self, op: _Op, item: _Item, group: str) -> bool:
        """Compare the receive with the send it matches by position before gloo moves any bytes (a size
        mismatch would abort the process); post gloo's receive in sequence order."""
        if self.gloo_recvs[(group, op.peer)] != op.seq:
            return False
        meta_key = self._key(group, op.peer, self.rank, op.seq, "meta")
        if not self.store.check([meta_key]):
            return False
        kind, tag, site = self.store.get(meta_key).decode().split("|", 2)
        self.store.delete_key(meta_key)
        self.gloo_recvs[(group, op.peer)] += 1
        if kind != _kind(op.tensor) or int(tag) != op.tag:
            item.error = (
                f"strict communication: rank {self.rank}'s {op.describe()} was matched (NCCL matches in posting "
                f"order; tags are ignored) with rank {op.peer}'s send #{op.seq} of {kind}, tag {tag} at {site}. "
                f"Post sends and receives between two ranks in the same order on both sides."
            )
            # take the bytes into a scratch buffer of the sender's size, so that the sender completes
            # and both sides report instead of one hanging
            self._transfer(op, _ORIGINAL["irecv"](_scratch(kind, op.tensor.device), op.peer, op.group, 0))
            return False
        self._transfer(op, _ORIGINAL["irecv"](op.tensor, op.peer, op.group, 0))
        return False

    def stop(self, drain: float = 2.0) -> None:
        """Stop after the items still in flight finished (a peer may be waiting for them), or ``drain`` s."""
        deadline = time.monotonic() + drain
        while self.live and time.monotonic() < deadline:
            time.sleep(0.01)
        self.stopped = True
        with self.lock:
            for item in self.live:
                item.error = item.error or "strict communication ended while this item was in flight"
                item.finished.set()
            self.live.clear()
            self.lock.notify_all()
        self.thread.join(timeout=5)


# -- the wrappers ---------------------------------------------------------------------------------------------
_COLLECTIVES = (
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base",
    "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "all_to_all", "all_to_all_single",
    "gather", "scatter", "all_reduce_coalesced", "all_gather_coalesced",
    "all_gather_single", "reduce_scatter_single",  # torch 2.13's names; the older ones call these
)  # fmt: skip
_INSIDE = threading.local()  # a checked collective that calls another (a deprecated name) is checked once
_P2P = ("send", "recv", "isend", "irecv", "batch_isend_irecv")
# torch.distributed._functional_collectives: what DTensor (full_tensor, redistribute) and FSDP2's
# helpers call; checked for host tensors (rule a) like c10d's own
_FUNCTIONAL = (
    "all_gather_tensor", "all_gather_tensor_autograd", "all_gather_single", "all_gather_single_autograd",
    "all_reduce", "reduce_scatter_tensor", "reduce_scatter_tensor_autograd", "reduce_scatter_single",
    "reduce_scatter_single_autograd", "all_to_all_single", "all_to_all_single_autograd", "broadcast",
    "all_reduce_coalesced", "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced",
    "all_gather_single_coalesced", "reduce_scatter_single_coalesced", "permute_tensor",
)  # fmt: skip
_FUNCTIONAL_ORIGINAL: dict[str, Callable] = {}
_ORIGINAL: dict[str, Callable] = {}
_UNWRAPPED: dict[Callable, Callable] = {}  # collective wrapper -> the torch function it checks


class _State:
    mode: Optional[_HostTracker] = None
    engine: Optional[_Engine] = None
    depth: int = 0
    deadlock_after: float = 60.0


_state = _State()


def _collective(name: str) -> Callable:
    original = _ORIGINAL[name]
    signature = inspect.signature(original)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if getattr(_INSIDE, "name", None) is not None:
            return original(*args, **kwargs)
        check_device(name, [a for a in (*args, *kwargs.values()) if isinstance(a, (Tensor, list, tuple))])
        engine = _state.engine
        if engine is not None and engine.live:
            group = signature.bind_partial(*args, **kwargs).arguments.get("group")
            engine.before_collective(group if group is not None else c10d._get_default_group(), name)
        _INSIDE.name = name
        try:
            return original(*args, **kwargs)
        finally:
            _INSIDE.name = None

    wrapper.__name__ = wrapper.__qualname__ = name
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    return wrapper


def _functional(name: str) -> Callable:
    original = _FUNCTIONAL_ORIGINAL[name]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        check_device(f"functional {name}", [a for a in (*args, *kwargs.values()) if isinstance(a, (Tensor, list, tuple))])
        return original(*args, **kwargs)

    wrapper.__name__ = wrapper.__qualname__ = name
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    return wrapper


def _peer(group: Any, peer: Optional[int], group_peer: Optional[int], what: str) -> tuple[Any, int]:
    group = group if group is not None else c10d._get_default_group()
    if peer is None and group_peer is None:
        raise StrictCommError(f"strict communication: {what} from any source; NCCL needs the peer's rank.")
    return group, peer if peer is not None else dist.get_global_rank(group, group_peer)


def _p2p_op(send: bool, tensor: Tensor, peer: Optional[int], group: Any, tag: int, group_peer: Optional[int]) -> _Op:
    name = "send" if send else "recv"
    check_device(name, tensor)
    group, peer = _peer(group, peer, group_peer, name)
    _, site = _caller()
    return _Op(send, tensor, peer, group, tag, site)


def _engine() -> _Engine:
    """This process's engine, for the current world (a new world gets a new one)."""
    store = c10d._get_default_store()
    if _state.engine is None or _state.engine.source is not store or _state.engine.stopped:
        if _state.engine is not None:
            _state.engine.stop()
        _state.engine = _Engine(store, _state.deadlock_after)
    return _state.engine


def isend(tensor: Tensor, dst: Optional[int] = None, group: Any = None, tag: int = 0, group_dst: Optional[int] = None) -> _Work:
    return _Work(_engine(), _engine().post([_p2p_op(True, tensor, dst, group, tag, group_dst)], batched=False))


def irecv(tensor: Tensor, src: Optional[int] = None, group: Any = None, tag: int = 0, group_src: Optional[int] = None) -> _Work:
    return _Work(_engine(), _engine().post([_p2p_op(False, tensor, src, group, tag, group_src)], batched=False))


def send(tensor: Tensor, dst: Optional[int] = None, group: Any = None, tag: int = 0, group_dst: Optional[int] = None) -> None:
    isend(tensor, dst, group, tag, group_dst).wait()


def recv(tensor: Tensor, src: Optional[int] = None, group: Any = None, tag: int = 0, group_src: Optional[int] = None) -> int:
    work = irecv(tensor, src, group, tag, group_src)
    work.wait()
    return work.item.ops[0].peer


def batch_isend_irecv(p2p_op_list: list[Any]) -> list[_Work]:
    if not p2p_op_list:
        return []
    _, site = _caller()
    ops = []
    for p in p2p_op_list:
        is_send = p.op in (isend, _ORIGINAL["isend"])
        check_device("batch_isend_irecv", p.tensor)
        peer = p.peer if p.peer is not None else dist.get_global_rank(p.group, p.group_peer)
        ops.append(_Op(is_send, p.tensor, peer, p.group, p.tag, site))
    engine = _engine()
    item = engine.post(ops, batched=True)
    return [_Work(engine, item) for _ in ops]


_REPLACEMENTS: dict[str, Callable] = {
    "send": send, "recv": recv, "isend": isend, "irecv": irecv, "batch_isend_irecv": batch_isend_irecv,
}  # fmt: skip


def _patch() -> None:
    for name in (*_COLLECTIVES, *_P2P):
        if not hasattr(c10d, name):
            continue
        _ORIGINAL.setdefault(name, getattr(c10d, name))
        replacement = _REPLACEMENTS.get(name)
        if replacement is None:
            replacement = _collective(name)
            _UNWRAPPED[replacement] = _ORIGINAL[name]
        for module in (c10d, dist):
            if hasattr(module, name):
                setattr(module, name, replacement)
    for name in _FUNCTIONAL:
        if hasattr(funcol, name):
            _FUNCTIONAL_ORIGINAL.setdefault(name, getattr(funcol, name))
            setattr(funcol, name, _functional(name))


def _unpatch() -> None:
    _UNWRAPPED.clear()
    for name, original in _ORIGINAL.items():
        for module in (c10d, dist):
            if hasattr(module, name):
                setattr(module, name, original)
    for name, original in _FUNCTIONAL_ORIGINAL.items():
        setattr(funcol, name, original)


@contextmanager
def strict_comm(deadlock_after: Optional[float] = None) -> Iterator[None]:
    """NCCL's rules on gloo for the code inside (re-entrant; see the module docstring)."""
    if deadlock_after is not None:
        _state.deadlock_after = deadlock_after
    enable()
    try:
        yield
    finally:
        disable()


def enable() -> None:
    """Switch strict mode on in this process's current thread (idempotent in depth)."""
    _state.depth += 1
    if _state.depth > 1:
        return
    _patch()
    _state.mode = _HostTracker()
    _state.mode.__enter__()


def disable() -> None:
    _state.depth = max(0, _state.depth - 1)
    if _state.depth:
        return
    if _state.mode is not None:
        _state.mode.__exit__(None, None, None)
        _state.mode = None
    if _state.engine is not None:
        _state.engine.stop()
        _state.engine = None
    _unpatch()


def active() -> bool:
    return _state.mode is not None


@contextmanager
def host_tracking_paused() -> Iterator[None]:
    """Run the code inside without the host tracker's ``TorchFunctionMode``: compiled blocks
    (:mod:`lightning_3d.transforms.compile`). Dynamo guards on the function-mode stack, and autograd
    runs a recompute without the forward's modes, so a fully recomputed block compiled with the
    tracker on would compile again, differently, inside its backward (and save other tensors). The
    collectives stay checked: they are patched, not traced; what goes untagged is only what the
    block's own compute makes, model code, which the tracker exempts anyway."""
    mode = _state.mode
    stack = torch.overrides._get_current_function_mode_stack() if mode is not None else []  # (every block call)
    if not stack or stack[-1] is not mode:
        yield
        return
    with torch.overrides._pop_mode_temporarily():
        yield


def enable_from_env() -> bool:
    """Called by the strategy once the process group exists: ``LIGHTNING_3D_STRICT_COMM=1`` switches
    strict mode on for the rest of the process (a CPU run then fails where NCCL would)."""
    if enabled_by_env() and not active():
        enable()
    return active()
