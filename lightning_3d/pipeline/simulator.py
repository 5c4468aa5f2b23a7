"""Run a schedule on paper: dependencies, deadlocks, timing, activations alive.

Every rank walks its action list. A compute action takes ``forward_time`` or ``backward_time``
(per chunk); a receive completes when the matching send has happened (sends are asynchronous and
take ``comm_time``); a rank blocked on a receive whose send can never happen is a deadlock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_3d.pipeline.schedules import Action, build_schedule, peer_of


class ScheduleDeadlock(RuntimeError):
    pass


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
) -> Simulation:
    p = len(schedule)
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
                    cost = forward_time if action.kind == "F" else backward_time
                    clock[rank] += cost
                    busy[rank] += cost
                    alive[rank] += 1 if action.kind == "F" else -1
                    max_alive[rank] = max(max_alive[rank], alive[rank])
                order[rank].append(action)
                pointer[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: schedule[r][pointer[r]] for r in range(p) if pointer[r] < len(schedule[r])}
            raise ScheduleDeadlock(f"pipeline schedule deadlocks; ranks wait on {stuck}")
    return Simulation(makespan=max(clock), busy=busy, max_in_flight=max_alive, finish_order=order)


def simulate_named(name: str, p: int, m: int, v: int = 1, **times: float) -> Simulation:
    return simulate(build_schedule(name, p, m, v), **times)
