"""Run a schedule on paper: dependencies, deadlocks, timing, activations alive.

Two models:

* :func:`simulate` walks the schedule's actions with buffered sends matched by message (what gloo
  does): a compute action takes ``forward_time`` or ``backward_time`` (per chunk); a receive
  completes when the matching send has happened (sends are asynchronous and take ``comm_time``); a
  rank blocked on a receive whose send can never happen is a deadlock. It gives the bubble.
* :func:`check_plan` runs a *communication plan* (how the runtime posts its P2P items, see
  :func:`~lightning_3d.pipeline.plan.communication_plan`) under NCCL's rules, the "strict"
  model of docs/pipeline.md: tags are ignored, the k-th send from a rank to a peer matches the
  peer's k-th receive from it; each rank queues its items (one operation, or one
  ``batch_isend_irecv`` batch) per peer -- or, with ``fifo="rank"``, in one queue for all peers, as
  one NCCL stream does -- and an item starts only at the head of every queue it sits in; a send
  completes once its receive has started, a receive once its send has started, and an item leaves
  its queues when all its operations completed; posting returns at once, ``Wait`` blocks the host.
  Shape headers go as the runtime sends them (:func:`~lightning_3d.pipeline.plan.headers_of`).
  A plan that cannot finish raises :class:`CommDeadlock` naming the stuck items; one that matches
  the wrong messages, computes on a receive it did not wait for, or leaves an item unwaited raises
  :class:`PlanError`. It also gives timing (a batch's operations take ``comm_time`` from the moment
  both ends started).
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from lightning_3d.pipeline.plan import COMPUTE, Action, Post, Step, Wait, communication_plan, headers_of, is_send, peer_of

Fifo = Literal["peer", "rank"]


class ScheduleDeadlock(RuntimeError):
    pass


class CommDeadlock(ScheduleDeadlock):
    """A communication plan that hangs under NCCL semantics; ``stuck`` describes every rank."""

    def __init__(self, message: str, stuck: dict[int, str]) -> None:
        super().__init__(message)
        self.stuck = stuck


class PlanError(AssertionError):
    """A communication plan that is wrong whatever the timing (mismatched messages, data used unwaited)."""


@dataclass
class Simulation:
    makespan: float
    busy: list[float]
    max_in_flight: list[int]  # micro-batch chunks whose forward ran and backward has not, per rank
    finish_order: list[list[Action]] = field(default_factory=list)

    @property
    def bubble(self) -> float:
        """Idle fraction: 1 - busy time / (ranks x makespan)."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)


def simulate(
    schedule: list[list[Action]],
    forward_time: float = 1.0,
    backward_time: float = 2.0,
    comm_time: float = 0.0,
    costs: Union[Mapping[str, float], Sequence[Mapping[str, float]], None] = None,
) -> Simulation:
    """``costs``: seconds per compute kind (F, B, I, W) measured on real ranks -- one mapping for all,
    or one per rank (stages differ: the embedding, the head) -- overriding the unit model, so a
    measured bubble can be set against what the schedule itself leaves at those costs."""
    p = len(schedule)
    per_rank = [costs] * p if costs is None or isinstance(costs, Mapping) else list(costs)
    pointer = [0] * p
    clock = [0.0] * p
    busy = [0.0] * p
    alive = [0] * p
    max_alive = [0] * p
    sent: dict[tuple[str, int, int, int], float] = {}  # (kind, micro, receiver rank, receiver chunk) -> arrival
    order: list[list[Action]] = [[] for _ in range(p)]
    remaining = sum(len(a) for a in schedule)
    while remaining:
        progressed = False
        for rank in range(p):
            while pointer[rank] < len(schedule[rank]):
                action = schedule[rank][pointer[rank]]
                if action.kind in ("RECV_ACT", "RECV_GRAD"):
                    key = ("ACT" if action.kind == "RECV_ACT" else "GRAD", action.micro, rank, action.chunk)
                    if key not in sent:
                        break  # blocked: try other ranks
                    clock[rank] = max(clock[rank], sent.pop(key))
                elif action.kind in ("SEND_ACT", "SEND_GRAD"):
                    peer, peer_chunk = peer_of(action, p, rank)
                    kind = "ACT" if action.kind == "SEND_ACT" else "GRAD"
                    sent[(kind, action.micro, peer, peer_chunk)] = clock[rank] + comm_time
                else:
                    mine = per_rank[rank]
                    cost = mine[action.kind] if mine and action.kind in mine else compute_time(action.kind, forward_time, backward_time)
                    clock[rank] += cost
                    busy[rank] += cost
                    alive[rank] += in_flight_change(action.kind)
                    max_alive[rank] = max(max_alive[rank], alive[rank])
                order[rank].append(action)
                pointer[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: schedule[r][pointer[r]] for r in range(p) if pointer[r] < len(schedule[r])}
            raise ScheduleDeadlock(f"pipeline schedule deadlocks; ranks wait on {stuck}")
    return Simulation(makespan=max(clock), busy=busy, max_in_flight=max_alive, finish_order=order)


def compute_time(kind: str, forward_time: float, backward_time: float) -> float:
    """F: a forward; B: a whole backward; I and W: its input- and weight-gradient halves (each half of
    it: both are about one forward's matmuls)."""
    if kind == "F":
        return forward_time
    return backward_time if kind == "B" else backward_time / 2


def in_flight_change(kind: str) -> int:
    """A micro-batch's activations live from its F until the backward that releases them: B, or W
    (the weight gradients still read the layers' inputs after I)."""
    return {"F": 1, "B": -1, "W": -1}.get(kind, 0)


# -- the strict (NCCL) model ------------------------------------------------------------------------------
@dataclass(eq=False, slots=True)
class _Op:
    action: Action
    header: bool
    send: bool
    peer: int
    message: tuple  # (ACT|GRAD, micro, receiving piece, header): named alike on both ends
    item: "_Item"
    match: Optional["_Op"] = None
    done: Optional[float] = None

    def __repr__(self) -> str:
        what = ("header of " if self.header else "") + repr(self.action)
        arrow = f"{what} to rank {self.peer}" if self.send else f"{what} from rank {self.peer}"
        return arrow + ("" if self.done is not None else " (unmatched)" if self.match is None else " (peer's item not started)")


@dataclass(eq=False, slots=True)
class _Item:
    rank: int
    number: int  # plan's posting number; -1 for a header item
    ops: list[_Op]
    posted: float
    queues: list[tuple[int, ...]]
    started: Optional[float] = None
    done: Optional[float] = None
    pending: int = 0  # operations not complete yet
    finish: float = 0.0  # the latest completion among them

    def __repr__(self) -> str:
        name = "header item" if self.number < 0 else f"item {self.number}"
        state = "started" if self.started is not None else "queued"
        return f"{name} [{'; '.join(map(repr, self.ops))}] ({state})"


Headers = Union[Literal["none", "all"], Collection[int]]


class _StrictRun:
    """Event driven: hosts advance until they block; posting, starting and completing items propagate
    through the queues at once; a host is retried only when one of its items completed."""

    def __init__(self, plan: list[list[Step]], fifo: Fifo, headers: Headers, forward_time: float, backward_time: float, comm_time: float) -> None:
        if fifo not in ("peer", "rank"):
            raise ValueError(f"fifo must be 'peer' or 'rank', got {fifo!r}")
        self.plan, self.fifo, self.p = plan, fifo, len(plan)
        every = headers == "all"
        chosen = frozenset() if isinstance(headers, str) else frozenset(headers)
        self.new_shape = lambda action: every or action.micro in chosen
        self.forward_time, self.backward_time, self.comm_time = forward_time, backward_time, comm_time
        p = self.p
        self.pointer, self.clock, self.busy = [0] * p, [0.0] * p, [0.0] * p
        self.alive, self.max_alive = [0] * p, [0] * p
        self.items: list[dict[int, _Item]] = [{} for _ in range(p)]  # per rank: number -> item
        self.header_item: list[Optional[tuple[int, _Item]]] = [None] * p  # (pointer, header item) being waited
        self.waited: list[set[int]] = [set() for _ in range(p)]
        self.visible: list[set[tuple[str, int, int]]] = [set() for _ in range(p)]  # receives the host waited for
        self.local: set[tuple[int, str, int, int]] = set()  # local hand-offs: (rank, kind, micro, chunk)
        self.queues: dict[tuple[int, ...], deque[_Item]] = defaultdict(deque)
        self.free: dict[tuple[int, ...], float] = defaultdict(float)  # when a queue's last item left
        self.sends: dict[tuple[int, int], list[_Op]] = defaultdict(list)  # (sender, receiver) -> sends in order
        self.recvs: dict[tuple[int, int], list[_Op]] = defaultdict(list)
        self.live = 0
        self.dirty: set[int] = set(range(p))
        chunks = [a.chunk for steps in plan for st in steps for a in (st.ops if isinstance(st, Post) else (st,)) if isinstance(a, Action)]
        self.pieces = (max(chunks, default=0) + 1) * p

    # posting and the network
    def _post(self, rank: int, number: int, ops: list[tuple[Action, bool]]) -> _Item:
        item = _Item(rank, number, [], self.clock[rank], [])
        p, by_peer = self.p, self.fifo == "peer"
        for action, header in ops:
            send = action.kind[0] == "S"
            piece = action.piece(p, rank)
            receiver = (piece + 1 if action.kind == "SEND_ACT" else piece - 1) if send else piece
            peer = peer_of(action, p, rank)[0]
            op = _Op(action, header, send, peer, (action.kind[5:], action.micro, receiver, header), item)
            item.ops.append(op)
            queue = (rank, peer) if by_peer else (rank,)
            if queue not in item.queues:
                item.queues.append(queue)
            pair = (rank, peer) if send else (peer, rank)
            mine, theirs = (self.sends[pair], self.recvs[pair]) if send else (self.recvs[pair], self.sends[pair])
            mine.append(op)
            if len(mine) <= len(theirs):
                other = theirs[len(mine) - 1]
                if op.message != other.message:
                    raise PlanError(
                        f"rank {rank}'s {op!r} meets rank {other.item.rank}'s {other!r}: the k-th send between two ranks "
                        f"matches the k-th receive, whatever the tags"
                    )
                op.match, other.match = other, op
        item.pending = len(item.ops)
        for queue in item.queues:
            self.queues[queue].append(item)
        self.live += 1
        self._propagate([item])
        return item

    def _propagate(self, candidates: list[_Item]) -> None:
        """Start what can start, complete what can complete, until nothing changes."""
        queues, free = self.queues, self.free
        while candidates:
            item = candidates.pop()
            if item.done is not None:
                continue
            if item.started is None:
                if any(queues[q][0] is not item for q in item.queues):
                    continue
                started = item.started = max(item.posted, max(free[q] for q in item.queues))
                for op in item.ops:
                    other = op.match
                    if other is not None and other.item.started is not None:
                        done = op.done = other.done = max(started, other.item.started) + self.comm_time
                        item.pending -= 1
                        item.finish = max(item.finish, done)
                        peer = other.item
                        peer.pending -= 1
                        peer.finish = max(peer.finish, done)
                        if not peer.pending:
                            candidates.append(peer)
            if not item.pending:
                item.done = max(item.started, item.finish)
                self.live -= 1
                self.dirty.add(item.rank)
                for q in item.queues:
                    queue = queues[q]
                    queue.popleft()
                    free[q] = item.done
                    if queue:
                        candidates.append(queue[0])

    # the hosts
    def _host(self, rank: int) -> None:
        steps = self.plan[rank]
        while self.pointer[rank] < len(steps) and self._step(rank, steps[self.pointer[rank]]):
            self.pointer[rank] += 1

    def _step(self, rank: int, step: Step) -> bool:
        """Run one step of a rank's plan; False when the host is blocked."""
        if isinstance(step, Post):
            return self._post_step(rank, step)
        if isinstance(step, Wait):
            for number in step.items:
                if number not in self.items[rank]:
                    raise PlanError(f"rank {rank}'s {step} waits for item {number}, which it has not posted")
            items = [self.items[rank][i] for i in step.items]
            if any(item.done is None for item in items):
                return False
            for item in items:
                self.clock[rank] = max(self.clock[rank], item.done or 0.0)
                self.waited[rank].add(item.number)
                self.visible[rank].update((op.action.kind, op.action.micro, op.action.chunk) for op in item.ops if not op.send)
            return True
        if step.kind in COMPUTE:
            self._compute(rank, step)
            return True
        # a message to this very rank (p == 1): handed over locally
        if is_send(step):
            self.local.add((rank, step.kind.replace("SEND", "RECV"), step.micro, peer_of(step, self.p, rank)[1]))
            return True
        if (rank, step.kind, step.micro, step.chunk) not in self.local:
            raise PlanError(f"rank {rank} takes {step!r} from itself before handing it over")
        self.visible[rank].add((step.kind, step.micro, step.chunk))
        return True

    def _post_step(self, rank: int, step: Post) -> bool:
        if not step.batched and len(step.ops) != 1:
            raise PlanError(f"rank {rank}: an unbatched item holds one operation, got {step}")
        receives, sends = headers_of(step, self.new_shape)
        if receives or sends:  # the headers first, as a batch of their own; read at once when received
            pending = self.header_item[rank]
            if pending is None or pending[0] != self.pointer[rank]:
                headers = [(a, True) for a in step.ops if a in receives or a in sends]
                pending = (self.pointer[rank], self._post(rank, -1, headers))
                self.header_item[rank] = pending
            if receives:
                if pending[1].done is None:
                    return False
                self.clock[rank] = max(self.clock[rank], pending[1].done)
            self.header_item[rank] = None
        number = len(self.items[rank])
        self.items[rank][number] = self._post(rank, number, [(a, False) for a in step.ops])
        return True

    def _compute(self, rank: int, action: Action) -> None:
        piece = action.piece(self.p, rank)
        if action.kind != "W":  # a weight gradient needs nothing from a peer
            needs = ("RECV_ACT" if action.kind == "F" else "RECV_GRAD", action.micro, action.chunk)
            if (piece > 0 if action.kind == "F" else piece < self.pieces - 1) and needs not in self.visible[rank]:
                raise PlanError(f"rank {rank} runs {action!r} before waiting for its receive ({needs[0]}{needs[1]}c{needs[2]})")
            self.visible[rank].discard(needs)
        cost = compute_time(action.kind, self.forward_time, self.backward_time)
        self.clock[rank] += cost
        self.busy[rank] += cost
        self.alive[rank] += in_flight_change(action.kind)
        self.max_alive[rank] = max(self.max_alive[rank], self.alive[rank])

    def run(self) -> Simulation:
        while self.dirty:
            self._host(self.dirty.pop())
        if any(self.pointer[r] < len(self.plan[r]) for r in range(self.p)) or self.live:
            stuck = self._stuck()
            raise CommDeadlock(
                f"communication plan deadlocks under NCCL semantics (fifo={self.fifo!r}): "
                + "; ".join(f"rank {r}: {s}" for r, s in stuck.items()),
                stuck,
            )
        for rank in range(self.p):
            unwaited = sorted(set(self.items[rank]) - self.waited[rank])
            if unwaited:
                raise PlanError(f"rank {rank} never waits for its items {unwaited} (their buffers are in use until then)")
        return Simulation(makespan=max(self.clock), busy=self.busy, max_in_flight=self.max_alive)

    def _stuck(self) -> dict[int, str]:
        out = {}
        for rank in range(self.p):
            steps = self.plan[rank]
            at = f"blocked at {steps[self.pointer[rank]]!r}" if self.pointer[rank] < len(steps) else "done"
            pending = [repr(i) for i in self._unfinished(rank)]
            out[rank] = at + (", items in flight: " + ", ".join(pending) if pending else "")
        return out

    def _unfinished(self, rank: int) -> list[_Item]:
        items = [i for i in self.items[rank].values() if i.done is None]
        header = self.header_item[rank]
        return ([header[1]] if header is not None and header[1].done is None else []) + items


def check_plan(
    plan: list[list[Step]],
    fifo: Fifo = "peer",
    headers: Headers = "none",
    forward_time: float = 1.0,
    backward_time: float = 2.0,
    comm_time: float = 0.0,
) -> Simulation:
    """Run a communication plan under NCCL semantics (module docstring). ``headers``: the micro-batches
    whose activations carry a shape header first ("all", "none", or their indices), as the runtime
    sends one for each activation shape a receiving piece has not seen."""
    return _StrictRun(plan, fifo, headers, forward_time, backward_time, comm_time).run()


def check_schedule(schedule: list[list[Action]], fifo: Fifo = "peer", headers: Headers = "none", **times: float) -> Simulation:
    """:func:`check_plan` on the plan the runtime posts for ``schedule``."""
    return check_plan(communication_plan(schedule), fifo, headers, **times)
