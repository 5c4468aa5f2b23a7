"""Pipeline benchmarks: our runtime vs torch.distributed.pipelining, and measured bubbles.

Both sides of a comparison run the same GPT, the same split, the same micro-batches and the same
plain training loop (forward+backward schedule, AdamW step) on CPU ranks; no Lightning on either
side, so the runtimes themselves are compared.

* :func:`compare_with_torch`: our 1F1B vs ``Schedule1F1B`` (2 ranks, 2 stages).
* :func:`compare_zbv_with_torch`: our ``zb_v`` vs ``ScheduleZBVZeroBubble`` (2 ranks x 2 stages in a
  V: rank r holds stage indices r and 3 - r of 4), plus the first steps' losses of both (same
  init, same data: equal work).
* :func:`bubbles`: every schedule at pp = 2 and 4 with m = 4, 8, 16 micro-batches of the same size:
  measured idle fraction against the unit-cost theory and against the schedule simulated at the
  measured per-kind compute costs.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_3d.core.topology import ParallelDims, Topology
from lightning_3d.data import TokenWindows, stdlib_bytes
from lightning_3d.models import GPT, GPTConfig
from lightning_3d.models.adapters.gpt import gpt_sequence
from lightning_3d.pipeline.runtime import PipelineConfig, StepStats, mean_costs, pipeline_model
from lightning_3d.pipeline.schedules import build_schedule, theoretical_bubble
from lightning_3d.pipeline.simulator import simulate
from lightning_3d.testing.harness import run_on_ranks

PIPE_GPT = dict(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128)
BATCH, MICRO = 16, 4
ZBV_MICRO = 8  # micro-batches of the zb_v comparison (>= 2p - 1 = 3, where ZB-V reaches its steady state)
# Untied embeddings: torch's ScheduleZBVZeroBubble gives a weight shared by a rank's two stages (the
# tied embedding, both ends on rank 0 in the V) a wrong gradient (0.23x one process's norm at step 1,
# every other gradient equal), so a tied model would not train alike on the two sides after step 1.
ZBV_GPT = dict(PIPE_GPT, tie_embeddings=False)
# The same comparison with 8x the compute per chunk (twice the width, two blocks per chunk), where a
# message is small against the compute around it (as on a GPU with NCCL).
ZBV_GPT_8X = dict(vocab_size=256, block_size=128, n_layer=8, n_head=4, n_embd=256, tie_embeddings=False)

# The bubble table: 8 blocks, so pp=4 x 2 chunks holds one block per piece.
BUBBLE_GPT = dict(vocab_size=256, block_size=64, n_layer=8, n_head=4, n_embd=128)
BUBBLE_MICRO_SIZE = 2  # samples per micro-batch in every cell: the batch is m x 2
BUBBLE_SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zb_v", 2), ("dualpipe_v", 2))
BUBBLE_PP = (2, 4)
BUBBLE_M = (4, 8, 16)
BUBBLE_WARMUP = 4  # zb_h1 replans at its measured costs before the 4th call (PipelineConfig.replan_after)
# The acceptance cell (pp=2, m=8) again with 8x the compute per micro-batch (twice the width, twice the
# tokens): gloo posts a message in ~1.5-3 ms on these loaded cores, a sizeable share of the small
# model's 4 ms chunk forward, while on a GPU a post is a kernel launch.
BAR_GPT = dict(vocab_size=256, block_size=128, n_layer=8, n_head=4, n_embd=256)


def _batches(n: int, batch: int = BATCH, block_size: int = PIPE_GPT["block_size"]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = TokenWindows(stdlib_bytes(2**20), block_size)
    out = []
    for step in range(n):
        items = [data[step * batch + i] for i in range(batch)]
        out.append((torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])))
    return out


def _dense(gpt: Optional[dict] = None) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**(gpt or PIPE_GPT)))


class _TorchStage(nn.Module):
    """Piece ``piece`` of ``pieces`` equal cuts of the GPT's blocks, for torch.distributed.pipelining:
    the first also embeds, the last also holds the final norm and head. The tied embedding stays one
    parameter when the first and last piece live in one process (the V), and is a copy per stage
    otherwise (1F1B on 2 ranks: each holds its own)."""

    def __init__(self, model: GPT, piece: int, pieces: int) -> None:
        super().__init__()
        self.first, self.last = piece == 0, piece == pieces - 1
        per = len(model.blocks) // pieces
        if self.first:
            self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop
        self.blocks = nn.ModuleList(model.blocks[piece * per : (piece + 1) * per])
        if self.last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.drop(self.wte(x) + self.wpe(torch.arange(x.shape[1])))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.last else x


def _loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def torch_pipelining(steps: int, schedule: str) -> dict[str, float]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank = dist.get_rank()
    stage_module = _TorchStage(_dense(), rank, 2)
    stage = PipelineStage(stage_module, rank, 2, torch.device("cpu"))
    sched = (Schedule1F1B if schedule == "1f1b" else ScheduleGPipe)(stage, MICRO, loss_fn=_loss_fn)
    optimizer = torch.optim.AdamW(stage_module.parameters(), lr=1e-3)
    times = []
    for x, y in _batches(steps):
        start = time.perf_counter()
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y)
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    return {"step_s": statistics.median(times[3:])}


def torch_zbv(steps: int, gpt: Optional[dict] = None) -> dict[str, Any]:
    """torch's ScheduleZBVZeroBubble on 2 ranks: rank r runs stages r and 3 - r of 4 (the last on rank 0)."""
    from torch.distributed.pipelining import PipelineStage, ScheduleZBVZeroBubble

    rank, p = dist.get_rank(), 2
    model = _dense(gpt or ZBV_GPT)
    indices = (rank, 2 * p - 1 - rank)
    modules = [_TorchStage(model, i, 2 * p) for i in indices]
    stages = [PipelineStage(mod, i, 2 * p, torch.device("cpu")) for mod, i in zip(modules, indices)]
    sched = ScheduleZBVZeroBubble(stages, ZBV_MICRO, loss_fn=_loss_fn)
    params = list({id(q): q for mod in modules for q in mod.parameters()}.values())  # the tied weight once
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    times, losses = [], []
    for x, y in _batches(steps):
        start = time.perf_counter()
        micro_losses: list[torch.Tensor] = []
        if rank == 0:  # the first stage (input) and the last (target, loss) are both here
            sched.step(x, target=y, losses=micro_losses)
        else:
            sched.step()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
        if micro_losses:
            losses.append(torch.stack(micro_losses).mean().item())
    return {"step_s": statistics.median(times[3:]), "losses": losses[:2]}


def ours(steps: int, schedule: str, virtual: int = 1, micro: int = MICRO, gpt: Optional[dict] = None) -> dict[str, Any]:
    topology = Topology.build(ParallelDims(dp=1, tp=1, pp=2))
    model = _dense(gpt)
    runtime = pipeline_model(model, gpt_sequence(model), topology, PipelineConfig(schedule=schedule, virtual_stages=virtual, micro_batches=micro))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    times, losses = [], []
    for x, y in _batches(steps):
        start = time.perf_counter()
        loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    idle = [s.idle_fraction for s in runtime.history[3:]]
    return {"step_s": statistics.median(times[3:]), "idle_fraction": statistics.mean(idle), "losses": losses[:2]}


def compare_with_torch(steps: int, repeats: int) -> dict[str, Any]:
    """Our 1F1B vs torch.distributed.pipelining.Schedule1F1B: same GPT, split, micro-batches, loop."""
    mine, theirs = [], []
    for _ in range(repeats):
        mine.append(max(r["step_s"] for r in run_on_ranks(ours, 2, steps, "1f1b", timeout=600)))
        theirs.append(max(r["step_s"] for r in run_on_ranks(torch_pipelining, 2, steps, "1f1b", timeout=600)))
    ours_s, torch_s = statistics.median(mine), statistics.median(theirs)
    return {
        "case": "pp2_1f1b_vs_torch_pipelining",
        "model": PIPE_GPT,
        "batch": BATCH,
        "micro_batches": MICRO,
        "ours_step_s": round(ours_s, 4),
        "torch_step_s": round(torch_s, 4),
        "step_time_ratio": round(ours_s / torch_s, 3),
    }


def compare_zbv_with_torch(steps: int, repeats: int, gpt: Optional[dict] = None) -> dict[str, Any]:
    """Our zb_v vs torch.distributed.pipelining.ScheduleZBVZeroBubble: same GPT (by default 4 blocks,
    one per stage; embeddings untied, see ZBV_GPT), same V split on 2 ranks, same micro-batches and loop; alternated, median of repeats.
    The first two steps' losses of both sides are kept: equal at step 1 means equal forward work,
    equal at step 2 means equal gradients went into the same AdamW step."""
    steps = max(steps, 5)
    gpt = gpt or ZBV_GPT
    mine, theirs = [], []
    ours_losses: list[float] = []
    torch_losses: list[float] = []
    for _ in range(repeats):
        ranks = run_on_ranks(ours, 2, steps, "zb_v", 2, ZBV_MICRO, gpt, timeout=600)
        mine.append(max(r["step_s"] for r in ranks))
        ours_losses = ranks[0]["losses"]
        ranks = run_on_ranks(torch_zbv, 2, steps, gpt, timeout=600)
        theirs.append(max(r["step_s"] for r in ranks))
        torch_losses = ranks[0]["losses"]
    ours_s, torch_s = statistics.median(mine), statistics.median(theirs)
    diff = [abs(a - b) for a, b in zip(ours_losses, torch_losses)]
    return {
        "case": "pp2_zbv_vs_torch_pipelining",
        "model": gpt,
        "batch": BATCH,
        "micro_batches": ZBV_MICRO,
        "split": f"2 ranks x 2 stages in a V: rank r holds stage indices r and 3-r of 4 ({gpt['n_layer'] // 4} blocks each)",
        "steps": steps,
        "repeats": repeats,
        "ours_step_s": round(ours_s, 4),
        "torch_step_s": round(torch_s, 4),
        "ours_step_s_runs": [round(s, 4) for s in mine],
        "torch_step_s_runs": [round(s, 4) for s in theirs],
        "torch_over_ours": round(torch_s / ours_s, 3),
        "ours_losses": ours_losses,
        "torch_losses": torch_losses,
        "first_step_loss_diff": diff[0] if diff else None,
        "second_step_loss_diff": diff[1] if len(diff) > 1 else None,
        "same_first_loss": bool(diff) and diff[0] < 1e-5,
        "same_second_loss": len(diff) > 1 and diff[1] < 1e-5,
    }


# -- the bubble table --------------------------------------------------------------------------------
def _bubble_cells(
    cells: list[tuple[str, int, int]], warmup: int, steps: int, gpt: Optional[dict] = None
) -> list[dict[str, Any]]:
    """On every rank of a pp-rank world: each (schedule, v, m) cell in turn, a fresh GPT (same init)
    trained for ``warmup + steps`` steps on batches of m x BUBBLE_MICRO_SIZE samples. Per cell: this
    rank's median idle fraction over the measured steps, its mean seconds per compute of each kind
    over them, and its median step time (schedule + AdamW)."""
    pp = dist.get_world_size()
    topology = Topology.build(ParallelDims(dp=1, tp=1, pp=pp))
    gpt = gpt or BUBBLE_GPT
    data = TokenWindows(stdlib_bytes(2**20), gpt["block_size"])
    out = []
    for name, v, m in cells:
        batch = m * BUBBLE_MICRO_SIZE
        model = _dense(gpt)
        runtime = pipeline_model(model, gpt_sequence(model), topology, PipelineConfig(schedule=name, virtual_stages=v, micro_batches=m))
        optimizer = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-3)
        times = []
        dist.barrier()
        for step in range(warmup + steps):
            items = [data[(step * batch + i) % len(data)] for i in range(batch)]
            x, y = torch.stack([a for a, _ in items]), torch.stack([b for _, b in items])
            start = time.perf_counter()
            model(x, y).backward()
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - start)
        measured: list[StepStats] = runtime.history[warmup:]
        out.append(
            {
                "idle_fraction": statistics.median(s.idle_fraction for s in measured),  # a descheduled step is an outlier
                "wall_s": statistics.mean(s.wall_s for s in measured),
                "costs": mean_costs(measured),
                "step_s": statistics.median(times[warmup:]),
                "planned_at": runtime.costs,  # zb_h1: the agreed costs its order was planned at (None: unit)
            }
        )
    return out


def _bubble_grid(pp: int, ms: tuple[int, ...] = BUBBLE_M) -> list[tuple[str, int, int]]:
    """The cells at one pipeline depth; dualpipe_v below 2p micro-batches would run zb_v's order."""
    return [(name, v, m) for m in ms for name, v in BUBBLE_SCHEDULES if not (name == "dualpipe_v" and m < 2 * pp)]


def _mean_costs(ranks: list[dict[str, Any]]) -> dict[str, float]:
    """Per kind, the mean over the ranks that ran it of their mean compute seconds."""
    kinds = sorted({k for r in ranks for k in r["costs"]})
    return {k: statistics.mean(r["costs"][k] for r in ranks if k in r["costs"]) for k in kinds}


def summarize_cell(name: str, v: int, pp: int, m: int, repeats: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """One table cell from ``repeats`` runs (each: one dict per rank): idle fraction = mean over ranks
    (each rank's median over measured steps), median over repeats; the schedule simulated at each
    repeat's measured per-kind costs (the ranks' mean), median over repeats; step time = the slowest
    rank's median, median over repeats."""
    planned_at = repeats[0][0].get("planned_at")  # the order the ranks ran (zb_h1 replans at measured costs)
    schedule = build_schedule(name, pp, m, v, costs=planned_at)
    idle = statistics.median(statistics.mean(r["idle_fraction"] for r in ranks) for ranks in repeats)
    costs = [_mean_costs(ranks) for ranks in repeats]
    at_costs = statistics.median(simulate(schedule, costs=c).bubble for c in costs)
    # each rank at its own costs (rank 0 holds the embedding, the last the head; under a V rank 0 both)
    at_rank_costs = statistics.median(simulate(schedule, costs=[r["costs"] for r in ranks]).bubble for ranks in repeats)
    theory = theoretical_bubble(name, pp, m, v)
    step = statistics.median(max(r["step_s"] for r in ranks) for ranks in repeats)
    median_costs = {k: statistics.median(c[k] for c in costs if k in c) for k in costs[0]}
    return {
        "schedule": name,
        "v": v,
        "pp": pp,
        "m": m,
        "measured": round(idle, 4),
        "theory": round(theory, 4),
        "sim_at_costs": round(at_costs, 4),
        "sim_at_rank_costs": round(at_rank_costs, 4),
        "minus_theory": round(idle - theory, 4),
        "minus_sim": round(idle - at_costs, 4),
        "minus_rank_sim": round(idle - at_rank_costs, 4),
        "step_s": round(step, 4),
        "costs_ms": {k: round(1e3 * c, 3) for k, c in median_costs.items()},
        "costs_ms_by_rank": [
            {k: round(1e3 * statistics.median(ranks[r]["costs"][k] for ranks in repeats), 3) for k in repeats[0][r]["costs"]}
            for r in range(len(repeats[0]))
        ],
        "planned_at_measured_costs": planned_at is not None,
        "measured_runs": [round(statistics.mean(r["idle_fraction"] for r in ranks), 4) for ranks in repeats],
    }


def bubbles(
    steps: int,
    repeats: int,
    pps: tuple[int, ...] = BUBBLE_PP,
    ms: tuple[int, ...] = BUBBLE_M,
    warmup: int = BUBBLE_WARMUP,
    rank_fn: Callable[..., list[dict[str, Any]]] = None,  # type: ignore[assignment]  (default _bubble_cells)
    gpt: Optional[dict] = None,
) -> dict[str, Any]:
    """Measured vs theoretical bubble for every schedule at pp = 2 and 4, m = 4, 8, 16.

    ``steps`` measured steps per cell (the runner's ``--steps`` divided by 6: 5 at 30) after
    ``warmup``; each repeat runs every cell of a depth in one set of processes (schedules alternate
    within it), the depths alternate across repeats. pp=4 runs 4 processes: on a 2-core machine two
    ranks share a core, so a rank's compute time includes time it was descheduled while its
    core-mate computed, and its bubble is not the pipeline's alone. ``rank_fn``: what the ranks run
    (:func:`_bubble_cells`; a test passes one its rank processes can import)."""
    rank_fn = rank_fn or _bubble_cells
    measured_steps = max(1, steps // 6)
    runs: dict[int, list[list[dict[str, Any]]]] = {pp: [] for pp in pps}  # pp -> repeats -> ranks -> cells
    for _ in range(repeats):
        for pp in pps:
            runs[pp].append(run_on_ranks(rank_fn, pp, _bubble_grid(pp, ms), warmup, measured_steps, gpt, timeout=1800))
    table = []
    for pp in pps:
        for i, (name, v, m) in enumerate(_bubble_grid(pp, ms)):
            table.append(summarize_cell(name, v, pp, m, [[rank[i] for rank in ranks] for ranks in runs[pp]]))
    bar = [c for c in table if c["pp"] == 2 and c["m"] == 8]
    return {
        "case": "pipeline_bubbles",
        "model": gpt or BUBBLE_GPT,
        "micro_batch_size": BUBBLE_MICRO_SIZE,
        "warmup_steps": warmup,
        "measured_steps": measured_steps,
        "repeats": repeats,
        "cells": table,
        "n/a": [f"dualpipe_v pp={pp} m={m}: m < 2p runs zb_v's order" for pp in pps for m in ms if m < 2 * pp],
        "bar_pp2_m8_minus_theory_max": max((c["minus_theory"] for c in bar), default=None),
        "bar_pp2_m8_minus_sim_max": max((c["minus_sim"] for c in bar), default=None),
        "bar_holds_vs_theory": all(c["minus_theory"] <= 0.05 for c in bar),
        "bar_holds_vs_sim": all(c["minus_sim"] <= 0.05 for c in bar),
    }


def format_bubbles(result: dict[str, Any]) -> str:
    """The case's table as markdown (for docs/benchmarks.md)."""
    lines = [
        "| pp | m | schedule | measured | theory | sim, mean costs | sim, each rank's costs | measured - theory "
        "| measured - sim (each rank's) | step s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in result["cells"]:
        lines.append(
            f"| {c['pp']} | {c['m']} | {c['schedule']} | {c['measured']:.3f} | {c['theory']:.3f} | {c['sim_at_costs']:.3f} | "
            f"{c['sim_at_rank_costs']:.3f} | {c['minus_theory']:+.3f} | {c['minus_rank_sim']:+.3f} | {c['step_s']:.3f} |"
        )
    return "\n".join(lines)
