"""Pipeline schedules as data: one list of actions per pipeline rank.

The model is cut into ``p * v`` consecutive *pieces*; piece ``k`` lives on rank ``k % p`` as its
local chunk ``k // p`` (``v > 1`` is Megatron's interleaved layout). An action is a forward or
backward of micro-batch ``m`` on a chunk, or the send/receive of an activation or a gradient.
Receives come right before the compute that needs them and sends right after the compute that
produced them; sends are asynchronous, receives wait. The same data drives the runtime, the
deadlock/bubble simulator and the tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["F", "B", "RECV_ACT", "SEND_ACT", "RECV_GRAD", "SEND_GRAD"]
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


@dataclass(frozen=True)
class Action:
    kind: Kind
    micro: int
    chunk: int

    def piece(self, p: int, rank: int) -> int:
        return self.chunk * p + rank

    def __repr__(self) -> str:
        return f"{self.kind}{self.micro}" + (f"c{self.chunk}" if self.chunk else "")


def _compute_order(name: str, p: int, m: int, v: int, rank: int, extra_warmup: int = 0) -> list[tuple[str, int, int]]:
    """(F|B, micro, chunk) in execution order for one rank."""
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


def build_schedule(name: str, p: int, m: int, v: int = 1, forward_only: bool = False) -> list[list[Action]]:
    """Actions for every pipeline rank. ``forward_only`` is for validation, test and predict."""
    if name not in SCHEDULES:
        raise ValueError(f"pipeline_schedule={name!r} is not supported; choose one of {SCHEDULES}.")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"pipeline schedule needs p, m, v >= 1 (got p={p}, m={m}, v={v}).")
    if name != "interleaved_1f1b" and v != 1:
        raise ValueError(f"virtual_stages={v} needs pipeline_schedule='interleaved_1f1b' (got {name!r}).")
    if name != "interleaved_1f1b" or not m % p or forward_only:
        return _actions(name, p, m, v, forward_only, 0)
    # A short last group can leave the standard warm-up too small to keep every rank fed; warm up a
    # little more (more forwards in flight for this one step) until the simulator shows the schedule
    # runs. Warming up everything (GPipe order) always does, so a schedule is always found.
    from lightning_3d.pipeline.simulator import ScheduleDeadlock, simulate

    for extra in range(m * v + 1):
        schedule = _actions(name, p, m, v, forward_only, extra)
        try:
            simulate(schedule)
            return schedule
        except ScheduleDeadlock:
            continue
    raise AssertionError(f"no deadlock-free interleaved schedule for p={p}, m={m}, v={v}")


def _actions(name: str, p: int, m: int, v: int, forward_only: bool, extra_warmup: int) -> list[list[Action]]:
    last = p * v - 1
    ranks = []
    for rank in range(p):
        order = _compute_order("gpipe" if forward_only else name, p, m, v, rank, extra_warmup)
        actions: list[Action] = []
        for kind, micro, chunk in order:
            if forward_only and kind == "B":
                continue
            piece = chunk * p + rank
            if kind == "F":
                if piece > 0:
                    actions.append(Action("RECV_ACT", micro, chunk))
                actions.append(Action("F", micro, chunk))
                if piece < last:
                    actions.append(Action("SEND_ACT", micro, chunk))
            else:
                if piece < last:
                    actions.append(Action("RECV_GRAD", micro, chunk))
                actions.append(Action("B", micro, chunk))
                if piece > 0:
                    actions.append(Action("SEND_GRAD", micro, chunk))
        ranks.append(actions)
    return ranks


def peer_of(action: Action, p: int, rank: int) -> tuple[int, int]:
    """(peer rank, peer's chunk) this communication action talks to."""
    piece = action.piece(p, rank)
    other = piece + 1 if action.kind in ("SEND_ACT", "RECV_GRAD") else piece - 1
    return other % p, other // p


def theoretical_bubble(name: str, p: int, m: int, v: int = 1) -> float:
    """Idle fraction of a step: (p-1)/(m+p-1) for GPipe and 1F1B; interleaving divides the
    pipeline fill by v: ((p-1)/v) / (m + (p-1)/v)."""
    fill = (p - 1) / (v if name == "interleaved_1f1b" else 1)
    return fill / (m + fill)
