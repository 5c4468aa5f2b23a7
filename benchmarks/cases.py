"""Benchmark cases. Each case is a function of ``(steps, repeats)`` returning one JSON-able dict.

Cases compare our strategy with the built-in alternative on the same model, ranks and batch in
the same run, alternating the two to spread machine noise evenly, and quote ratios.
"""

from __future__ import annotations

import statistics
from typing import Any, Callable

import lightning as L
import torch

from lightning_3d.callbacks import TokenThroughput
from lightning_3d.data import TextDataModule
from lightning_3d.models import GPTConfig, GPTModule
from lightning_3d.testing import run_on_ranks

BENCH_GPT = dict(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128)
CASES: dict[str, Callable[[int, int], dict[str, Any]]] = {}


def case(fn: Callable[[int, int], dict[str, Any]]) -> Callable[[int, int], dict[str, Any]]:
    CASES[fn.__name__] = fn
    return fn


def fit_throughput(strategy: str, steps: int, global_batch: int, warmup: int = 5) -> dict[str, float]:
    """Runs on every rank: tokens/s (all replicas) and peak memory of ``steps`` GPT steps."""
    import lightning_3d  # noqa: F401  (registers "3d")

    L.seed_everything(0)
    throughput = TokenThroughput(warmup=warmup)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=torch.distributed.get_world_size(),
        max_steps=steps + warmup,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[throughput],
    )
    model = GPTModule(GPTConfig(**BENCH_GPT), warmup_steps=2)
    model.configure_callbacks = lambda: []  # keep our instance
    trainer.fit(model, TextDataModule(block_size=BENCH_GPT["block_size"], global_batch_size=global_batch, max_bytes=2**21))
    return {"tokens_per_s": throughput.mean_tokens_per_s, "peak_memory_mb": throughput.peak_memory_mb}


def _alternate(world: int, strategies: list[str], steps: int, repeats: int, global_batch: int) -> dict[str, Any]:
    runs: dict[str, list[dict[str, float]]] = {s: [] for s in strategies}
    for _ in range(repeats):
        for s in strategies:
            runs[s].append(run_on_ranks(fit_throughput, world, s, steps, global_batch, timeout=900)[0])
    return {
        s: {
            "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in rs), 1),
            "peak_memory_mb": round(max(r["peak_memory_mb"] for r in rs), 1),
        }
        for s, rs in runs.items()
    }


@case
def dp2_vs_ddp(steps: int, repeats: int) -> dict[str, Any]:
    """ThreeDParallelStrategy at dp=2 vs Lightning's DDP: same GPT, 2 CPU ranks, global batch 16 x 128 tokens."""
    result = _alternate(2, ["3d", "ddp"], steps, repeats, global_batch=16)
    ours, theirs = result["3d"], result["ddp"]
    return {
        "case": "dp2_vs_ddp",
        "model": BENCH_GPT,
        "global_batch": 16,
        "steps": steps,
        "repeats": repeats,
        "3d": ours,
        "ddp": theirs,
        "tokens_per_s_ratio": round(ours["tokens_per_s"] / theirs["tokens_per_s"], 3),
        "peak_memory_ratio": round(ours["peak_memory_mb"] / theirs["peak_memory_mb"], 3),
    }
