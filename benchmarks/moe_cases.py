"""Expert parallelism on CPU ranks: what splitting the experts over 2 ranks costs and saves.

:func:`ep2_vs_ep1` trains one MoE GPT on 2 data-parallel ranks twice, alternating: at
``expert_parallel=1`` (every rank holds every expert: dense experts, the data-parallel baseline)
and at ``expert_parallel=2`` (each rank holds half of them; routed rows travel by all-to-all). It
quotes tokens/s, the model state per rank, and the share of the ep2 step spent inside the two
all-to-all exchanges (and the count exchange) of its MoE layers, timed around every
``all_to_all_single`` call. gloo's collectives return when done, so the timed share is the
exchange itself, load imbalance waiting included.

torchtitan's MoE is not compared: torchtitan is not installed here and the machine has no network
(its grouped experts also run on CUDA only).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from lightning_3d.data import TextDataModule
from lightning_3d.models import GPTConfig, GPTModule
from lightning_3d.monitoring.callbacks import TokenThroughput
from lightning_3d.testing.harness import run_on_ranks

MOE_BENCH_GPT = dict(
    vocab_size=256, block_size=256, n_layer=4, n_head=4, n_embd=256, mlp="swiglu", bias=False, dropout=0.0,
    n_experts=8, top_k=2, moe_every=1, expert_hidden=512, n_shared_experts=0,
)
GLOBAL_BATCH = 8


class _ExchangeTimer:
    """Wall time spent in ``dist.all_to_all_single`` while training (the MoE layers' exchanges)."""

    def __init__(self) -> None:
        self.seconds, self.calls, self._original = 0.0, 0, dist.all_to_all_single

    def __enter__(self) -> "_ExchangeTimer":
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return self._original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        dist.all_to_all_single = timed
        return self

    def __exit__(self, *exc: Any) -> None:
        dist.all_to_all_single = self._original


class _StepClock(L.Callback):
    """Seconds of the measured steps (after ``warmup``) and the exchange time inside them."""

    def __init__(self, warmup: int, timer: _ExchangeTimer) -> None:
        self.warmup, self.timer = warmup, timer
        self.step_seconds = self.exchange_seconds = 0.0
        self._start = self._exchange_at_start = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._start, self._exchange_at_start = time.perf_counter(), self.timer.seconds

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step > self.warmup:
            self.step_seconds += time.perf_counter() - self._start
            self.exchange_seconds += self.timer.seconds - self._exchange_at_start


def fit_moe(ep: int, steps: int, warmup: int) -> dict[str, float]:
    """Runs on every rank: tokens/s, model state and exchange share of ``steps`` MoE GPT steps at ``ep``."""
    from cases import StateMemory, bench_trainer

    from lightning_3d import ThreeDParallelStrategy

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))  # the strategy's rule
    L.seed_everything(0)
    with _ExchangeTimer() as timer:
        throughput, state, clock = TokenThroughput(warmup=warmup), StateMemory(), _StepClock(warmup, timer)
        trainer = bench_trainer(ThreeDParallelStrategy(expert_parallel=ep), steps + warmup, [throughput, state, clock])
        model = GPTModule(GPTConfig(**MOE_BENCH_GPT), warmup_steps=2)
        model.configure_callbacks = lambda: []  # keep our instances
        data = TextDataModule(block_size=MOE_BENCH_GPT["block_size"], global_batch_size=GLOBAL_BATCH, max_bytes=2**21)
        trainer.fit(model, data)
    return {
        "tokens_per_s": throughput.mean_tokens_per_s,
        "model_state_mb": state.mb,
        "exchange_share": clock.exchange_seconds / clock.step_seconds if clock.step_seconds else float("nan"),
        "exchanges_per_step": timer.calls / (steps + warmup),
    }


def ep2_vs_ep1(steps: int, repeats: int) -> dict[str, Any]:
    """ep2 vs ep1 on 2 ranks, alternating ``repeats`` times; the median speed, the largest state."""
    steps, warmup = max(5, steps // 2), 3
    runs: dict[str, list[list[dict[str, float]]]] = {"ep1": [], "ep2": []}
    for _ in range(repeats):
        for label, ep in (("ep1", 1), ("ep2", 2)):
            runs[label].append(run_on_ranks(fit_moe, 2, ep, steps, warmup, timeout=900))
    result = {
        label: {
            "tokens_per_s": round(statistics.median(r[0]["tokens_per_s"] for r in rs), 1),
            "model_state_mb_per_rank": round(max(x["model_state_mb"] for r in rs for x in r), 2),
            "exchange_share_of_step": round(statistics.median(max(x["exchange_share"] for x in r) for r in rs), 3),
            "all_to_all_calls_per_step": round(rs[0][0]["exchanges_per_step"], 1),
        }
        for label, rs in runs.items()
    }
    one, two = result["ep1"], result["ep2"]
    return {
        "case": "ep2_vs_ep1",
        "model": MOE_BENCH_GPT,
        "global_batch": GLOBAL_BATCH,
        "steps": steps,
        "warmup": warmup,
        "repeats": repeats,
        "machine": f"{os.cpu_count()} CPU cores, gloo, 2 ranks, threads per rank = cores / 2",
        **result,
        "ep2_tokens_per_s_ratio": round(two["tokens_per_s"] / one["tokens_per_s"], 3),
        "ep2_model_state_ratio": round(two["model_state_mb_per_rank"] / one["model_state_mb_per_rank"], 3),
    }
