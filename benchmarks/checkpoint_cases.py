"""Checkpoint save/load cost on the 8-rank 3D layout (dp2 x tp2 x pp2, ZeRO-1): bytes each rank
writes, time training is blocked, time until the checkpoint is committed, sync vs async."""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_3d import ThreeDParallelStrategy
from lightning_3d.data import TextDataModule
from lightning_3d.models import GPTConfig, GPTModule
from lightning_3d.testing.harness import run_on_ranks

CKPT_GPT = dict(vocab_size=256, block_size=64, n_layer=4, n_head=8, n_embd=256)
LAYOUT = dict(data_parallel=2, tensor_parallel=2, pipeline_parallel=2, zero_stage=1)


def save_and_load(directory: str, async_save: bool, repeats: int) -> dict[str, float]:
    L.seed_everything(0)
    strategy = ThreeDParallelStrategy(async_checkpoint=async_save, **LAYOUT)
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=8, max_steps=2, limit_val_batches=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    model = GPTModule(GPTConfig(**CKPT_GPT), warmup_steps=1)
    model.configure_callbacks = lambda: []
    data = TextDataModule(block_size=64, global_batch_size=8, max_bytes=2**20)
    trainer.fit(model, data)
    blocking, total, written = [], [], 0.0
    strategy._lightning_module = model  # teardown kept the module; reuse its optimizers' state below
    for i in range(repeats):
        path = str(Path(directory) / f"bench-{async_save}-{i}.ckpt")
        torch.distributed.barrier()
        start = time.perf_counter()
        trainer.save_checkpoint(path)
        blocking.append(time.perf_counter() - start)
        strategy.checkpointer.finalize()
        total.append(time.perf_counter() - start)
        written = strategy.checkpointer.last_stats["bytes"]
    torch.distributed.barrier()
    start = time.perf_counter()
    trainer.fit_loop.epoch_loop.max_steps = 3
    trainer.fit(model, data, ckpt_path=path)
    load = time.perf_counter() - start
    return {"bytes": written, "blocking_s": statistics.median(blocking), "committed_s": statistics.median(total), "resume_fit_s": load}


def checkpoint_cost(steps: int, repeats: int) -> dict[str, Any]:
    out: dict[str, Any] = {"case": "checkpoint_8rank", "model": CKPT_GPT, "layout": LAYOUT}
    with tempfile.TemporaryDirectory(prefix="ckpt_bench_") as tmp:
        for mode, async_save in (("sync", False), ("async", True)):
            ranks = run_on_ranks(save_and_load, 8, tmp, async_save, max(2, repeats), timeout=900)
            out[mode] = {
                "bytes_per_rank_max": int(max(r["bytes"] for r in ranks)),
                "bytes_total": int(sum(r["bytes"] for r in ranks)),
                "blocking_s": round(max(r["blocking_s"] for r in ranks), 3),
                "committed_s": round(max(r["committed_s"] for r in ranks), 3),
                "resume_fit_s": round(max(r["resume_fit_s"] for r in ranks), 2),
            }
    out["async_blocking_ratio"] = round(out["async"]["blocking_s"] / out["sync"]["blocking_s"], 3)
    return out
