"""The zero-bubble schedule ZB-H1 as the planner sees it: its step length and the micro-batches it
keeps in flight per stage, from the runtime's own schedule (lightning_3d.pipeline) run on paper.

The simulator times F = 1 and B = 2 (I = W = 1), so one micro-batch's forward and backward are 3
units; a step is ``makespan / 3`` micro-batch times (1F1B: ``m + pp - 1``). Building the schedule
costs about ``pp^2 (3m + pp)`` Python steps (its list scheduling tries every ``k`` in 0..pp); above
``SIMULATED_WORK`` of them (pp = 16 beyond m = 33, pp = 32 and more always) the planner uses the
paper's ZB-H1 instead: ``m + (pp - 1) / 3`` micro-batch times (bubble (p-1)/(3m+p-1), Qi et al.
2023) and ``min(pp, m)`` micro-batches in flight on every stage. Where both are known the
simulated step is 0-2% longer than the paper's (docs/planner.md).

The V-shaped schedules (``zb_v``, ``dualpipe_v``: two half-size chunks per rank, the first and the
last on rank 0) are simulated with F = 0.5 and B = 1 per chunk. From ``m >= 2pp - 1`` their step is
exactly ``m + (pp - 1) / 6`` micro-batch times and every rank holds ``2pp`` chunks (ZB-V; ``2pp + 1``
for DualPipeV), i.e. ``pp`` (``pp + 1/2``) micro-batches of its layers: the formulas are used there,
the simulation below (where it is cheap).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from lightning_3d.core.layout_rules import ZERO_BUBBLE  # the schedules whose step and memory come from here

# pp^2 (3m + pp) list-scheduling steps, about 1 us each: ~30 ms per (pp, m) at most, once per process
SIMULATED_WORK = 30_000


@dataclass(frozen=True)
class ZeroBubblePipeline:
    pp: int
    micro_batches: int
    step_units: float  # the step in micro-batch times (one F + B); 1F1B's is m + pp - 1
    in_flight: tuple[float, ...]  # per stage: most micro-batches between their F and their W (or B)
    simulated: bool  # False: the paper's formula (the simulation would be too slow)

    @property
    def bubble_units(self) -> float:
        """Idle micro-batch times of a stage in one step (1F1B: pp - 1)."""
        return self.step_units - self.micro_batches


def zero_bubble_pipeline(schedule: str, pp: int, micro_batches: int) -> ZeroBubblePipeline:
    """The step and in-flight micro-batches of ``schedule`` (one of :data:`ZERO_BUBBLE`)."""
    return zb_h1_pipeline(pp, micro_batches) if schedule == "zb_h1" else v_pipeline(schedule, pp, micro_batches)


@functools.lru_cache(maxsize=None)
def v_pipeline(schedule: str, pp: int, micro_batches: int) -> ZeroBubblePipeline:
    """ZB-V or DualPipeV: the formula from ``m >= 2pp - 1``, else the schedule simulated (in-flight
    counts in units of a rank's layers x one micro-batch: half-size chunks / 2)."""
    m = micro_batches
    extra = 0.5 if schedule == "dualpipe_v" and m >= 2 * pp else 0.0
    if pp < 2:
        return ZeroBubblePipeline(pp, m, float(m), (1.0 + extra,), True)
    if m >= 2 * pp - 1:
        return ZeroBubblePipeline(pp, m, m + (pp - 1) / 6, (pp + extra,) * pp, False)
    from lightning_3d.pipeline.schedules import build_schedule
    from lightning_3d.pipeline.simulator import simulate

    sim = simulate(build_schedule(schedule, pp, m, 2), forward_time=0.5, backward_time=1.0)
    return ZeroBubblePipeline(pp, m, sim.makespan / 3, tuple(n / 2 for n in sim.max_in_flight), True)


@functools.lru_cache(maxsize=None)
def zb_h1_pipeline(pp: int, micro_batches: int) -> ZeroBubblePipeline:
    """ZB-H1 with ``pp`` stages and ``micro_batches`` micro-batches, simulated when affordable."""
    m = micro_batches
    if pp < 2:
        return ZeroBubblePipeline(pp, m, float(m), (1,), True)
    if pp * pp * (3 * m + pp) > SIMULATED_WORK:
        return ZeroBubblePipeline(pp, m, m + (pp - 1) / 3, (min(pp, m),) * pp, False)
    from lightning_3d.pipeline.schedules import build_schedule
    from lightning_3d.pipeline.simulator import simulate

    sim = simulate(build_schedule("zb_h1", pp, m), forward_time=1.0, backward_time=2.0)
    return ZeroBubblePipeline(pp, m, sim.makespan / 3, tuple(sim.max_in_flight), True)


def v_chunk_layers(n_layer: int, pp: int) -> list[tuple[int, int]]:
    """Per rank, the layers of its two chunks under a V (uniform pieces, as the runtime cuts them)."""
    base, extra = divmod(n_layer, 2 * pp)
    sizes = [base + (1 if i < extra else 0) for i in range(2 * pp)]
    return [(sizes[r], sizes[2 * pp - 1 - r]) for r in range(pp)]


@functools.lru_cache(maxsize=4096)
def v_stage_in_flight(schedule: str, pp: int, micro_batches: int, stage: int, chunk_layers: tuple[int, int]) -> float:
    """Micro-batches' worth of rank ``stage``'s layers held at its peak under a V whose two chunks have
    ``chunk_layers`` layers: the most of ``alive0 x L0 + alive1 x L1`` along the rank's own order (its
    counts change only at its own computes), over ``L0 + L1``. With uneven chunks the first one (which
    warms up with the most forwards) weighs more than :func:`v_pipeline`'s even split says."""
    from lightning_3d.pipeline.schedules import _compute_order

    alive, peak = [0, 0], 0.0
    for kind, _, chunk in _compute_order(schedule, pp, micro_batches, 2, stage):
        if kind == "F":
            alive[chunk] += 1
        elif kind in ("B", "W"):
            alive[chunk] -= 1
        peak = max(peak, alive[0] * chunk_layers[0] + alive[1] * chunk_layers[1])
    return peak / max(1, sum(chunk_layers))

