"""The data a pipeline schedule is made of, and how its traffic goes on the wire.

An :class:`Action` is a forward or backward of a micro-batch on a chunk, or the send/receive of an
activation or a gradient; :func:`piece_of` and :func:`place` say which rank holds which piece of the
model (docs/pipeline.md). :func:`communication_plan` turns a schedule into the posts and waits the
runtime issues under NCCL's rules: ``batch_isend_irecv`` batches whose sends and receives meet their
partners in the same round on both ends, receives posted ahead and waited just before the compute
that uses them. :mod:`~lightning_3d.pipeline.schedules` builds the schedules from these pieces and
:mod:`~lightning_3d.pipeline.simulator` checks them; both import this module, neither the other's
types.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Literal, Union

Kind = Literal["F", "B", "I", "W", "RECV_ACT", "SEND_ACT", "RECV_GRAD", "SEND_GRAD"]
# V_SHAPED: two chunks per rank placed in a V (Qi et al. 2023, section 6; DeepSeek's DualPipeV): the
# micro-batch goes down the ranks through chunk 0 and back up through chunk 1.
# Compute kinds: F forward; B whole backward; I its input-gradient half (what the previous stage
# waits for) and W its weight-gradient half (needed by nobody until the optimizer step), which the
# zero-bubble schedules run apart to fill the pipeline's bubbles (Qi et al. 2023).
COMPUTE = ("F", "B", "I", "W")




def piece_of(p: int, rank: int, chunk: int, v_shape: bool = False) -> int:
    """The piece a rank holds as its local ``chunk``."""
    return 2 * p - 1 - rank if v_shape and chunk == 1 else chunk * p + rank


def place(p: int, piece: int, v_shape: bool = False) -> tuple[int, int]:
    """(rank, local chunk) holding ``piece``: the inverse of :func:`piece_of`."""
    if v_shape:
        return (piece, 0) if piece < p else (2 * p - 1 - piece, 1)
    return piece % p, piece // p


@dataclass(frozen=True)
class Action:
    kind: Kind
    micro: int
    chunk: int
    v_shape: bool = False  # the placement of the schedule it belongs to (see piece_of)

    def piece(self, p: int, rank: int) -> int:
        return piece_of(p, rank, self.chunk, self.v_shape)

    def __repr__(self) -> str:
        return f"{self.kind}{self.micro}" + (f"c{self.chunk}" if self.chunk else "")


def peer_of(action: Action, p: int, rank: int) -> tuple[int, int]:
    """(peer rank, peer's chunk) this communication action talks to."""
    piece = action.piece(p, rank)
    other = piece + 1 if action.kind in ("SEND_ACT", "RECV_GRAD") else piece - 1
    return place(p, other, action.v_shape)


def is_compute(action: Action) -> bool:
    return action.kind in COMPUTE


def is_send(action: Action) -> bool:
    return action.kind in ("SEND_ACT", "SEND_GRAD")


# -- the communication plan --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Post:
    """Post ``ops`` (communication actions with a peer on another rank) as one P2P item: one
    ``batch_isend_irecv`` batch, or with ``batched=False`` (a single action) a plain
    ``isend``/``irecv``. Posting returns at once."""

    ops: tuple[Action, ...]
    batched: bool = True

    def __repr__(self) -> str:
        return ("Post" if self.batched else "Post1") + "(" + ", ".join(map(repr, self.ops)) + ")"


@dataclass(frozen=True)
class Wait:
    """The host waits until these items (numbered in this rank's posting order from 0) completed."""

    items: tuple[int, ...]


# A rank's plan: compute actions (F, B, I, W), Post, Wait, and bare communication actions for a message
# to the rank itself (p == 1 with virtual stages; the V's bottom rank), which are handed over locally.
Step = Union[Action, Post, Wait]


def communication_plan(schedule: list[list[Action]], early: bool = True) -> list[list[Step]]:
    """How the runtime posts every rank's P2P traffic, in order (checked by
    :func:`lightning_3d.pipeline.simulator.check_plan` under NCCL semantics).

    Rounds: run the schedule with every compute taking one unit of time, as early as its inputs
    allow; boundary ``k`` of a rank is the moment right before its round ``k``. Each message is
    exchanged at one boundary *on both ends*: the one right after the round that produces it
    (``early=True``: the receiver posts the receive ahead and waits for it just before the compute
    that uses it), or the one right before the round that consumes it (``early=False``: one buffer,
    but the interleaved schedule then waits more). Everything a rank exchanges at one boundary goes
    out as one ``batch_isend_irecv`` batch (Megatron's ``send_forward_recv_backward`` and friends
    are such batches); two boundaries are never merged, even with no compute between them.

    Why it cannot hang, by induction on ``k``: once the items of boundaries before ``k`` completed,
    every host reaches boundary ``k`` (it only ever waits for items of boundaries up to the round it
    is about to compute) and posts its boundary-``k`` batch -- first its header batch, if any, which
    matches only other boundary-``k`` header batches, all posted before anyone waits for them. Those
    items now head their FIFOs (what was ahead of them is older and complete) and their partners are
    exactly the other ranks' boundary-``k`` items, so all of them start and complete. This holds
    with one FIFO per peer or per rank, and however long each compute really takes.

    The host waits for an item before the compute that uses one of its receives (a batch progresses
    as one: its sends are complete too), together with the earlier unwaited items to the same peers
    (they sat ahead of it in the same queues, so they completed already); a batch of sends only is
    left in flight and waited at the latest at the end of the step. Within a batch the operations
    are sorted by (peer, direction, message), so messages between the same two ranks in one batch
    meet in the same order on both ends.
    """
    p = len(schedule)
    rounds = _unit_rounds(schedule)
    ready: dict[tuple, int] = {}  # message -> the boundary at which both ends exchange it
    for rank, actions in enumerate(schedule):
        for i, action in enumerate(actions):
            if is_compute(action) or peer_of(action, p, rank)[0] == rank:
                continue
            if is_send(action) and early:
                ready[message_of(action, p, rank)] = rounds[rank][_producer(actions, i)] + 1
            elif not is_send(action) and not early:
                ready[message_of(action, p, rank)] = rounds[rank][_consumer(actions, i)]
    return [_rank_plan(actions, p, rank, rounds[rank], ready) for rank, actions in enumerate(schedule)]


def message_of(action: Action, p: int, rank: int) -> tuple[str, int, int]:
    """A communication action's message, named alike on both ends: (ACT|GRAD, micro, receiving piece)."""
    if is_send(action):
        peer, peer_chunk = peer_of(action, p, rank)
        return (action.kind[5:], action.micro, piece_of(p, peer, peer_chunk, action.v_shape))
    return (action.kind[5:], action.micro, action.piece(p, rank))


def _producer(actions: list[Action], i: int) -> int:
    """Index of the compute a send's message comes from (the one right before it)."""
    while not is_compute(actions[i]):
        i -= 1
    return i


def _consumer(actions: list[Action], i: int) -> int:
    """Index of the compute that uses a receive (the one right after it)."""
    while not is_compute(actions[i]):
        i += 1
    return i


def _unit_rounds(schedule: list[list[Action]]) -> list[dict[int, int]]:
    """Per rank: action index -> the round its compute runs in, every compute taking one unit and
    starting as soon as the rank is free and its input exists (sends buffered)."""
    p = len(schedule)
    pointer, clock = [0] * p, [0] * p
    rounds: list[dict[int, int]] = [{} for _ in range(p)]
    arrived: dict[tuple, int] = {}
    progressed = True
    while progressed:
        progressed = False
        for rank, actions in enumerate(schedule):
            while pointer[rank] < len(actions):
                action = actions[pointer[rank]]
                if is_compute(action):
                    rounds[rank][pointer[rank]] = clock[rank]
                    clock[rank] += 1
                elif is_send(action):
                    arrived[message_of(action, p, rank)] = clock[rank]
                else:
                    key = message_of(action, p, rank)
                    if key not in arrived:
                        break
                    clock[rank] = max(clock[rank], arrived[key])
                pointer[rank] += 1
                progressed = True
    stuck = {r: schedule[r][pointer[r]] for r in range(p) if pointer[r] < len(schedule[r])}
    if stuck:
        raise ValueError(f"pipeline schedule deadlocks; ranks wait on {stuck}")
    return rounds


def _rank_plan(actions: list[Action], p: int, rank: int, rounds: dict[int, int], ready: dict[tuple, int]) -> list[Step]:
    if p == 1:  # every message goes to the rank itself: handed over locally, in the rank's own order
        return list(actions)

    def local(action: Action) -> bool:  # a message between two pieces of this rank (the V's bottom)
        return peer_of(action, p, rank)[0] == rank

    at: dict[int, list[Action]] = defaultdict(list)  # boundary k (right before round k) -> what this rank exchanges
    for action in actions:
        if not is_compute(action) and not local(action):
            at[ready[message_of(action, p, rank)]].append(action)
    plan: list[Step] = []
    unwaited: dict[int, frozenset[int]] = {}  # posted item -> its peers
    carries: dict[Action, int] = {}  # receive -> the item it travels in
    boundary = posted = 0

    def post_until(end: int) -> None:
        nonlocal boundary, posted
        for k in range(boundary, end + 1):  # one batch per boundary, even between the same two computes
            ops = sorted(at.pop(k, ()), key=lambda a: (peer_of(a, p, rank)[0], is_send(a), message_of(a, p, rank)))
            if ops:
                plan.append(Post(tuple(ops)))
                unwaited[posted] = frozenset(peer_of(a, p, rank)[0] for a in ops)
                carries.update((a, posted) for a in ops if not is_send(a))
                posted += 1
        boundary = end + 1

    receives: list[Action] = []  # those the next compute uses
    for i, action in enumerate(actions):
        if not is_compute(action):
            if local(action):
                plan.append(action)  # handed over in place, no wire
            elif not is_send(action):
                receives.append(action)
            continue
        post_until(rounds[i])
        items = {carries.pop(a) for a in receives} & unwaited.keys()
        receives = []
        if items:
            # with them, the earlier unwaited items to the same peers: ahead in the same queues, so complete
            peers = frozenset().union(*(unwaited[j] for j in items))
            done = sorted(j for j, q in unwaited.items() if j in items or (j < max(items) and q & peers))
            plan.append(Wait(tuple(done)))
            for j in done:
                del unwaited[j]
        plan.append(action)
    post_until(max(at, default=0))
    if unwaited:
        plan.append(Wait(tuple(sorted(unwaited))))
    return plan


def headers_of(post: Post, new_shape: Callable[[Action], bool]) -> tuple[tuple[Action, ...], tuple[Action, ...]]:
    """Which activations of ``post`` carry a shape header (``new_shape``: the receiving piece has not
    seen this activation shape yet; both ends decide it alike). Returns (receives, sends) with one.

    On the wire, when there are any: first a batch of the headers alone (sends and receives, in
    ``post``'s order), waited at once when it receives one (the host reads the shape to allocate the
    payload), then ``post``'s batch of payloads. Both ends of a message hold it in the same round's
    ``post``, so their header batches match each other as the payload batches do."""
    receives = tuple(a for a in post.ops if a.kind == "RECV_ACT" and new_shape(a))
    sends = tuple(a for a in post.ops if a.kind == "SEND_ACT" and new_shape(a))
    return receives, sends
