"""What every peer-stack run shares with ours: the same GPT and seed, the same data stream and split,
the same AdamW recipe and schedule, timed the way ``TokenThroughput`` times our Trainer.

Runs inside the peers' environment (``make bench-peers`` builds ``.venv-peers``), where
``lightning_3d`` is installed beside DeepSpeed and torchtitan, so the model and data code is ours,
not a copy. Each peer script calls :func:`run_and_print`, which prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
import types
from collections.abc import Iterator
from typing import Any, Callable

import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_3d.data import TextDataModule
from lightning_3d.models.gpt import adamw_with_warmup_cosine

WARMUP = 5  # steps before timing starts: TokenThroughput(warmup=5) in our runs


def replica_batches(block_size: int, global_batch: int, rank: int, world: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This replica's batches of the bench's byte stream, in the order our strategy gives it (torch's
    ``DistributedSampler`` order, seed 0, shuffled): a step's global batch is the same set of windows."""
    data = TextDataModule(block_size=block_size, global_batch_size=global_batch, max_bytes=2**21)
    data.setup("fit")
    sampler = DistributedSampler(data._train, num_replicas=world, rank=rank, shuffle=True, seed=0)
    return iter(DataLoader(data._train, batch_size=global_batch // world, sampler=sampler, drop_last=True))


def bench_optimizer(model: torch.nn.Module, total_steps: int) -> tuple[torch.optim.Optimizer, Callable[[torch.optim.Optimizer], Any]]:
    """GPTModule's optimizer for the bench (``GPTModule(warmup_steps=2)``, defaults otherwise) and a
    function that builds its schedule on whatever optimizer a stack wraps it in."""
    hp = types.SimpleNamespace(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, warmup_steps=2, decay_steps=total_steps, min_lr_ratio=0.1)
    holder = types.SimpleNamespace(parameters=model.parameters)
    built = adamw_with_warmup_cosine(holder, hp)  # type: ignore[arg-type]
    schedule = built["lr_scheduler"]["scheduler"].lr_lambdas[0]
    return built["optimizer"], lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def timed_loop(step: Callable[[torch.Tensor, torch.Tensor], float], batches: Iterator, steps: int, global_batch: int, block_size: int) -> dict[str, Any]:
    """``WARMUP + steps`` calls of ``step``; tokens/s over the measured ones (all replicas), this rank's
    losses and peak RSS."""
    losses, seconds = [], 0.0
    last = time.perf_counter()
    for i in range(WARMUP + steps):
        x, y = next(batches)
        losses.append(float(step(x, y)))
        now = time.perf_counter()
        if i >= WARMUP:
            seconds += now - last
        last = now
    step_time = seconds / steps
    return {
        "tokens_per_s": global_batch * block_size / step_time,
        "step_time_s": step_time,
        "peak_memory_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "losses": losses,
    }


def plain_step(forward_backward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], optimizer: torch.optim.Optimizer, scheduler: Any) -> Callable[[torch.Tensor, torch.Tensor], float]:
    """A step of a plain torch loop: ``forward_backward`` (returns the loss after its backward), the
    optimizer step, zeroed gradients, the schedule step; the loss as a float."""

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = forward_backward(x, y)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        return loss.item()

    return step


def peer_parser(model_help: str = "GPTConfig fields as JSON") -> argparse.ArgumentParser:
    """The arguments every peer script takes (``peer_cases.compare`` passes them)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=json.loads, required=True, help=model_help)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--world", type=int, default=2)
    return parser


def summarize(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's timing (as our cases report), the largest RSS, and the step losses averaged over the
    replicas (each rank's is its own micro-batch's mean; equal sizes, so the mean is the global loss)."""
    return {
        "tokens_per_s": per_rank[0]["tokens_per_s"],
        "step_time_s": per_rank[0]["step_time_s"],
        "peak_memory_mb": max(r["peak_memory_mb"] for r in per_rank),
        "losses": [statistics.fmean(step) for step in zip(*(r["losses"] for r in per_rank))],
    }


def run_and_print(fn: Callable[..., dict[str, Any]], world: int, *args: Any) -> None:
    """Run ``fn(*args)`` on ``world`` gloo ranks (our harness, NCCL-rule checks off as in every
    benchmark) and print the summary as one JSON line."""
    from lightning_3d.testing.harness import run_on_ranks

    per_rank = run_on_ranks(fn, world, *args, timeout=900, strict=False)
    sys.stdout.write(json.dumps(summarize(per_rank)) + "\n")
