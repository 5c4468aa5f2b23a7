"""Pipeline schedules as data: one list of actions per pipeline rank.

The model is cut into ``p * v`` consecutive *pieces*; piece ``k`` lives on rank ``k % p`` as its
local chunk ``k // p`` (``v > 1`` is Megatron's interleaved layout), except under the V-shaped
schedules (``zb_v``, ``dualpipe_v``: two chunks per rank), where rank ``r`` holds pieces ``r`` and
``2p - 1 - r``, so the first and the last piece share rank 0 (:func:`piece_of`, :func:`place`). An action is a forward or
backward of micro-batch ``m`` on a chunk, or the send/receive of an activation or a gradient.
Receives come right before the compute that needs them and sends right after the compute that
produced them. The same data drives the runtime, the deadlock/bubble simulator and the tests.

:func:`communication_plan` says how the runtime puts that traffic on the wire under NCCL's rules
(docs/pipeline.md, "NCCL semantics"): ``batch_isend_irecv`` batches whose sends and receives meet
their partners in the same round on both ends, receives posted ahead and waited just before the
compute that uses them; :func:`build_plan` checks it in the simulator before the runtime uses it.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import Optional

from lightning_3d.core.layout_rules import SCHEDULES, V_SHAPED
from lightning_3d.pipeline.plan import Action, Step, communication_plan, piece_of, place
from lightning_3d.pipeline.simulator import ScheduleDeadlock, Simulation, check_plan, simulate


# Measured seconds of one F, I and W on each pipeline rank (index = rank), agreed by every rank.
Costs = tuple[tuple[float, float, float], ...]


def _compute_order(name: str, p: int, m: int, v: int, rank: int, extra_warmup: int = 0, costs: Optional[Costs] = None) -> list[tuple[str, int, int]]:
    """(F|B|I|W, micro, chunk) in execution order for one rank."""
    if name == "zb_h1":
        return list(_zb_h1_orders(p, m, costs)[rank])
    if name == "zb_v":
        return _zb_v_order(p, m, rank)
    if name == "dualpipe_v":  # a (ragged) batch of fewer than 2p micro-batches runs ZB-V's order: same V
        return _dualpipe_v_order(p, m, rank) if m >= 2 * p else _zb_v_order(p, m, rank)
    if name == "gpipe":
        return [("F", i, c) for c in range(v) for i in range(m)] + [("B", i, c) for c in reversed(range(v)) for i in reversed(range(m))]
    if name == "1f1b" and v == 1:
        warmup = min(p - rank - 1, m)
        order = [("F", i, 0) for i in range(warmup)]
        for i in range(m - warmup):
            order += [("F", warmup + i, 0), ("B", i, 0)]
        order += [("B", i, 0) for i in range(m - warmup, m)]
        return order
    # Interleaved 1F1B (Narayanan et al. 2021): micro-batches go through the chunks in groups of p.
    # A last group of fewer than p (a ragged batch: m not a multiple of p) goes through them the same
    # way, as Megatron-LM does for any micro-batch count.
    groups = [range(start, min(start + p, m)) for start in range(0, m, p)]
    forwards = [("F", i, c) for g in groups for c in range(v) for i in g]
    backwards = [("B", i, c) for g in groups for c in reversed(range(v)) for i in g]
    total = m * v
    warmup = min((p - rank - 1) * 2 + (v - 1) * p + extra_warmup, total)
    order = forwards[:warmup]
    for i in range(total - warmup):
        order += [forwards[warmup + i], backwards[i]]
    order += backwards[total - warmup :]
    return order


@functools.lru_cache(maxsize=256)
def _zb_h1_orders(p: int, m: int, costs: Optional[Costs] = None) -> tuple[tuple[tuple[str, int, int], ...], ...]:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism": the schedule with 1F1B's peak
    memory), built by list scheduling rather than by hand: every rank, whenever it is free, runs an
    input-gradient half I if its gradient has arrived (the previous stage waits for it), else a
    forward if its activation has arrived and fewer than ``limit`` micro-batches are in flight (F to
    W), else a held-back weight-gradient half W. ``limit`` is at most ``p``, the most 1F1B keeps on
    any stage (its first); each rank's limit is ``min(p, p - rank + k)``, with the ``k`` whose
    schedule finishes first (ties: the smaller k, less memory). Early stages fill their cool-down
    waits with W's, later stages hold more micro-batches than under 1F1B but never more than its
    first stage does.

    Durations are one unit each (F = I = W), or ``costs``: each rank's measured seconds of F, I and
    W (the paper's automatic scheduling; the runtime re-plans once it has measured them). Either way
    every rank runs its I's and its W's in micro-batch order, so gradients are summed in the same
    order under any costs: the same bits."""
    unit = tuple((1.0, 1.0, 1.0) for _ in range(p))
    durations = costs or unit
    if len(durations) != p:
        raise ValueError(f"zb_h1 costs name {len(durations)} pipeline ranks, expected {p}.")
    # each k in increasing order (a tie keeps the smaller: less memory); with costs, the unit-time orders
    # compete too, timed at the costs (the greedy choice is not always the faster one there)
    runs = [_list_schedule(p, m, [min(p, p - r + k) for r in range(p)], d) for d in dict.fromkeys((durations, unit)) for k in range(p + 1)]
    if costs is not None:
        timed = [{"F": f, "I": i, "W": w} for f, i, w in durations]
        runs = [(simulate(_to_actions("zb_h1", p, 1, orders), costs=timed).makespan, orders) for _, orders in runs]
    best = min(range(len(runs)), key=lambda i: (runs[i][0], i))
    return tuple(tuple(o) for o in runs[best][1])


def _list_schedule(p: int, m: int, limits: list[int], durations: Costs) -> tuple[float, list[list[tuple[str, int, int]]]]:
    """(makespan, per-rank orders) of the list schedule described in :func:`_zb_h1_orders`, event by
    event: at each moment a rank is free or a message arrives, the free ranks choose in rank order."""
    forwards, inputs, weights, in_flight = [0] * p, [0] * p, [0] * p, [0] * p
    busy_until = [0.0] * p
    f_done: list[dict[int, float]] = [{} for _ in range(p)]
    i_done: list[dict[int, float]] = [{} for _ in range(p)]
    orders: list[list[tuple[str, int, int]]] = [[] for _ in range(p)]
    t = 0.0
    while any(w < m for w in weights):
        chosen = False
        for r in range(p):
            if busy_until[r] > t:
                continue
            kind = None
            if inputs[r] < forwards[r]:
                ready = (f_done[r] if r == p - 1 else i_done[r + 1]).get(inputs[r])
                kind = "I" if ready is not None and ready <= t else None
            if kind is None and forwards[r] < m and in_flight[r] < limits[r]:
                ready = 0.0 if r == 0 else f_done[r - 1].get(forwards[r])
                kind = "F" if ready is not None and ready <= t else None
            if kind is None and weights[r] < inputs[r]:
                kind = "W"
            if kind is None:
                continue
            end = t + durations[r]["FIW".index(kind)]
            if kind == "F":
                f_done[r][forwards[r]] = end
                orders[r].append(("F", forwards[r], 0))
                forwards[r] += 1
                in_flight[r] += 1
            elif kind == "I":
                i_done[r][inputs[r]] = end
                orders[r].append(("I", inputs[r], 0))
                inputs[r] += 1
            else:
                orders[r].append(("W", weights[r], 0))
                weights[r] += 1
                in_flight[r] -= 1
            busy_until[r] = end
            chosen = True
        if chosen and min(busy_until) <= t:  # a zero-length compute: choose again at the same moment
            continue
        upcoming = [x for x in busy_until if x > t] + [x for done in (*f_done, *i_done) for x in done.values() if x > t]
        if not upcoming:  # cannot happen: a rank with work left always has an I, F or W, now or later
            raise AssertionError(f"zb_h1 list schedule stalled at t={t} (p={p}, m={m}, limits={limits})")
        t = min(upcoming)
    return max(busy_until), orders


class _Order:
    """A rank's compute order written chunk by chunk: each kind takes its chunk's next micro-batch;
    ``W()`` finishes the oldest input-gradient half still waiting for its weights' half."""

    def __init__(self) -> None:
        self.out: list[tuple[str, int, int]] = []
        self.next: dict[tuple[str, int], int] = defaultdict(int)
        self.waiting: list[tuple[int, int]] = []  # (micro, chunk) whose I ran and W has not

    def add(self, kind: str, chunk: int) -> None:
        counter = "I" if kind in ("B", "I") else kind  # a whole backward B counts as that micro-batch's I and W
        micro = self.next[(counter, chunk)]
        self.next[(counter, chunk)] += 1
        self.out.append((kind, micro, chunk))
        if kind == "I":
            self.waiting.append((micro, chunk))

    def W(self, chunk: Optional[int] = None) -> None:
        """The oldest waiting W (of ``chunk`` if given); nothing if none waits."""
        for j, (micro, c) in enumerate(self.waiting):
            if chunk is None or c == chunk:
                del self.waiting[j]
                self.out.append(("W", micro, c))
                return

    def repeat(self, times: int, *kinds: tuple[str, Optional[int]]) -> None:
        for _ in range(max(times, 0)):
            for kind, chunk in kinds:
                if kind == "W":
                    self.W(chunk)
                else:
                    assert chunk is not None
                    self.add(kind, chunk)


def _zb_v_order(p: int, m: int, r: int) -> list[tuple[str, int, int]]:
    """ZB-V (Qi et al. 2023, section 6): a V of two chunks per rank; with F = I = W it leaves no
    bubble once m >= 2p - 1 while holding 1F1B's peak activations (2p half-size chunks on rank 0).
    Warm-up: chunk-0 forwards until the V's bottom turns them around, then F1 I1 W1 triples; steady:
    F0 I0 W0 F1 I1 W1; cool-down: the input halves first, weights' halves last. Written for
    ``max(m, 2p - 1)`` micro-batches; with fewer, the missing ones are left out (every rank drops the
    same, so what remains still meets)."""
    n = max(m, 2 * p - 1)
    o = _Order()
    o.repeat(2 * (p - r) - 1, ("F", 0))
    o.repeat(r, ("F", 1), ("F", 0))
    o.repeat(p - r, ("F", 1), ("I", 1), ("W", 1))
    while o.next[("F", 1)] < o.next[("F", 0)] or o.next[("F", 0)] < n:
        if o.next[("F", 0)] < n:
            o.add("F", 0)
        o.repeat(1, ("I", 0), ("W", 0), ("F", 1), ("I", 1), ("W", 1))
    o.repeat(r, ("I", 0), ("I", 1))
    o.repeat(p - r, ("I", 0), ("W", 0))
    o.repeat(len(o.waiting), ("W", 1))
    o.repeat(len(o.waiting), ("W", 0))
    return [a for a in o.out if a[1] < m]


def _dualpipe_v_order(p: int, m: int, r: int) -> list[tuple[str, int, int]]:
    """DualPipeV (DeepSeek-V3's DualPipe folded into a V, so parameters are held once): after the
    warm-up every forward of one chunk is paired with a whole backward of the other (F0 B1, F1 B0),
    the pairs whose communication DualPipe overlaps with compute; the edges of the step use split
    backwards whose weight halves fill the waits. Needs m >= 2p. Here a pair runs as its forward then
    its backward (no second stream)."""
    o = _Order()
    o.repeat(2 * (p - r - 1), ("F", 0))
    o.repeat(r + 1, ("F", 0), ("F", 1))
    o.repeat(p - r - 1, ("I", 1), ("W", None), ("F", 1))
    o.repeat(m - 2 * p + r + 1, ("F", 0), ("B", 1), ("F", 1), ("B", 0))
    o.repeat(p - r - 1, ("B", 1), ("F", 1), ("B", 0))
    split = False  # the last backwards split into I and W, from about half way through this phase
    for i in range(r + 1):
        for chunk in (1, 0):
            split = split or (i == (r + 1) // 2 and r % 2 == chunk)
            o.add("I" if split else "B", chunk)
    o.repeat(p - r - 1, ("W", None), ("I" if split else "B", 0))
    o.repeat(len(o.waiting), ("W", None))
    return o.out


def build_schedule(name: str, p: int, m: int, v: int = 1, forward_only: bool = False, costs: Optional[Costs] = None) -> list[list[Action]]:
    """Actions for every pipeline rank. ``forward_only`` is for validation, test and predict;
    ``costs`` (zb_h1 only): each rank's measured seconds of F, I and W, to plan the order at."""
    return _build(name, p, m, v, forward_only, costs)[0]


def _build(name: str, p: int, m: int, v: int, forward_only: bool, costs: Optional[Costs] = None) -> tuple[list[list[Action]], bool]:
    """(the schedule, whether its communication plan was already checked)."""
    if name not in SCHEDULES:
        raise ValueError(f"pipeline_schedule={name!r} is not supported; choose one of {SCHEDULES}.")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"pipeline schedule needs p, m, v >= 1 (got p={p}, m={m}, v={v}).")
    if name in V_SHAPED and v != 2:
        raise ValueError(f"pipeline_schedule={name!r} places two chunks per rank in a V: virtual_stages must be 2 (got {v}).")
    if name not in V_SHAPED and name != "interleaved_1f1b" and v != 1:
        raise ValueError(f"virtual_stages={v} needs pipeline_schedule='interleaved_1f1b' (got {name!r}).")
    if name != "interleaved_1f1b" or not m % p or forward_only:
        return _actions(name, p, m, v, forward_only, 0, costs if name == "zb_h1" else None), False
    # A short last group can leave the standard warm-up too small to keep every rank fed; warm up a
    # little more (more forwards in flight for this one step) until the simulator shows the schedule
    # and the communication plan the runtime posts for it run under NCCL semantics. Warming up
    # everything (GPipe order) always does, so a schedule is always found.
    for extra in range(m * v + 1):
        schedule = _actions(name, p, m, v, forward_only, extra)
        if _runs(schedule):
            return schedule, True
    raise AssertionError(f"no deadlock-free interleaved schedule for p={p}, m={m}, v={v}")


def _runs(schedule: list[list[Action]]) -> bool:
    try:
        simulate(schedule)
        plan = communication_plan(schedule)
        # One queue per rank is the stricter layout (an item waits for every earlier item of its rank,
        # not only those to the same peer); whatever finishes under it finishes per peer too (the
        # tests run both over the whole grid).
        for headers in ("none", "all"):
            check_plan(plan, "rank", headers)
    except ScheduleDeadlock:
        return False
    return True


def build_plan(name: str, p: int, m: int, v: int = 1, forward_only: bool = False, costs: Optional[Costs] = None) -> list[list[Step]]:
    """The communication plan the runtime executes: the schedule's, checked under NCCL semantics
    (with and without shape headers) before any rank posts a message."""
    schedule, checked = _build(name, p, m, v, forward_only, costs)
    plan = communication_plan(schedule)
    if not checked and not _runs(schedule):  # cannot happen (see communication_plan); never hang a cluster on it
        raise AssertionError(f"the {name} communication plan for p={p}, m={m}, v={v} fails the NCCL-semantics check")
    return plan


def _actions(name: str, p: int, m: int, v: int, forward_only: bool, extra_warmup: int, costs: Optional[Costs] = None) -> list[list[Action]]:
    orders = [_compute_order(name, p, m, v, rank, extra_warmup, costs) for rank in range(p)]
    if forward_only:
        orders = [[c for c in order if c[0] == "F"] for order in orders]
    return _to_actions(name, p, v, orders)


def _to_actions(name: str, p: int, v: int, orders: list[list[tuple[str, int, int]]]) -> list[list[Action]]:
    """Every rank's compute order with its receives right before and its sends right after."""
    last = p * v - 1
    vee = name in V_SHAPED
    ranks = []
    for rank, order in enumerate(orders):
        actions: list[Action] = []
        for kind, micro, chunk in order:
            piece = piece_of(p, rank, chunk, vee)
            if kind == "F":
                if piece > 0:
                    actions.append(Action("RECV_ACT", micro, chunk, vee))
                actions.append(Action("F", micro, chunk, vee))
                if piece < last:
                    actions.append(Action("SEND_ACT", micro, chunk, vee))
            elif kind == "W":
                actions.append(Action("W", micro, chunk, vee))
            else:
                if piece < last:
                    actions.append(Action("RECV_GRAD", micro, chunk, vee))
                actions.append(Action(kind, micro, chunk, vee))  # type: ignore[arg-type]
                if piece > 0:
                    actions.append(Action("SEND_GRAD", micro, chunk, vee))
        ranks.append(actions)
    return ranks


def theoretical_bubble(name: str, p: int, m: int, v: int = 1) -> float:
    """Idle fraction of a step with a backward twice a forward (I = W = F): (p-1)/(m+p-1) for GPipe
    and 1F1B; interleaving divides the pipeline fill by v: ((p-1)/v) / (m + (p-1)/v); ZB-H1 leaves
    p-1 of 1F1B's 3(p-1) idle units per stage: (p-1) / (3m + p-1). The V-shaped schedules (F = I = W = 1
    per half-size chunk, 6m units of work per rank) leave p-1 units: (p-1) / (6m + p-1), about half
    of ZB-H1's, once m >= 2p - 1 (below that, the schedule's own simulation; with m < 2p dualpipe_v
    runs ZB-V's order)."""
    if name == "zb_h1":
        return (p - 1) / (3 * m + p - 1)
    if name in V_SHAPED:
        if m >= 2 * p - 1:
            return (p - 1) / (6 * m + p - 1)
        return simulate(build_schedule(name, p, m, 2)).bubble
    fill = (p - 1) / (v if name == "interleaved_1f1b" else 1)
    return fill / (m + fill)


def simulate_named(name: str, p: int, m: int, v: int = 1, **times: float) -> Simulation:
    """The simulation of schedule ``name`` on ``p`` ranks with ``m`` micro-batches (durations as :func:`simulate`)."""
    return simulate(build_schedule(name, p, m, v), **times)

