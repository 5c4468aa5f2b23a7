"""Pipeline benchmarks: our runtime vs torch.distributed.pipelining, and measured bubbles.

Both sides run the same GPT, the same two-stage split, the same micro-batches and the same
plain training loop (forward+backward schedule, AdamW step) on 2 CPU ranks; no Lightning on
either side, so the runtimes themselves are compared.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_3d.data import TokenWindows, stdlib_bytes
from lightning_3d.models import GPT, GPTConfig
from lightning_3d.models.adapters.gpt import gpt_sequence
from lightning_3d.pipeline.runtime import PipelineConfig, pipeline_model
from lightning_3d.pipeline.schedules import theoretical_bubble
from lightning_3d.testing import run_on_ranks
from lightning_3d.topology import ParallelDims, Topology

PIPE_GPT = dict(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128)
BATCH, MICRO = 16, 4


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = TokenWindows(stdlib_bytes(2**20), PIPE_GPT["block_size"])
    out = []
    for step in range(n):
        items = [data[step * BATCH + i] for i in range(BATCH)]
        out.append((torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])))
    return out


def _dense() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**PIPE_GPT))


class _TorchStage(nn.Module):
    """A piece of the GPT for torch.distributed.pipelining (tied weights untied: a copy per stage)."""

    def __init__(self, model: GPT, first: bool) -> None:
        super().__init__()
        self.first = first
        half = len(model.blocks) // 2
        if first:
            self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop
            self.blocks = nn.ModuleList(model.blocks[:half])
        else:
            self.blocks = nn.ModuleList(model.blocks[half:])
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.drop(self.wte(x) + self.wpe(torch.arange(x.shape[1])))
        for block in self.blocks:
            x = block(x)
        return x if self.first else self.lm_head(self.ln_f(x))


def torch_pipelining(steps: int, schedule: str) -> dict[str, float]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank = dist.get_rank()
    stage_module = _TorchStage(_dense(), first=rank == 0)
    stage = PipelineStage(stage_module, rank, 2, torch.device("cpu"))
    loss_fn = lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten())  # noqa: E731
    sched = (Schedule1F1B if schedule == "1f1b" else ScheduleGPipe)(stage, MICRO, loss_fn=loss_fn)
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


def ours(steps: int, schedule: str, virtual: int = 1) -> dict[str, float]:
    topology = Topology.build(ParallelDims(dp=1, tp=1, pp=2))
    model = _dense()
    runtime = pipeline_model(model, gpt_sequence(model), topology, PipelineConfig(schedule=schedule, virtual_stages=virtual, micro_batches=MICRO))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    times = []
    for x, y in _batches(steps):
        start = time.perf_counter()
        model(x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    idle = [s.idle_fraction for s in runtime.history[3:]]
    return {"step_s": statistics.median(times[3:]), "idle_fraction": statistics.mean(idle)}


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


def bubbles(steps: int, repeats: int) -> dict[str, Any]:
    """Measured idle fraction per schedule (pp=2, 4 micro-batches) next to the theory."""
    out: dict[str, Any] = {"case": "pp2_bubbles", "model": PIPE_GPT, "batch": BATCH, "micro_batches": MICRO}
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1)):
        runs = [run_on_ranks(ours, 2, steps, name, v, timeout=600) for _ in range(repeats)]
        idle = statistics.median(statistics.mean(r["idle_fraction"] for r in ranks) for ranks in runs)
        step = statistics.median(max(r["step_s"] for r in ranks) for ranks in runs)
        out[name] = {"idle_fraction": round(idle, 3), "theory": round(theoretical_bubble(name, 2, MICRO, v), 3), "step_s": round(step, 4)}
    return out
