"""MFU and throughput: the FLOP count is the planner's, tokens/s counts the global batch once (not
x tp x pp), MFU divides by one device's peak; ModelSummary reports the whole model under any layout."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import pytest
import torch

from lightning_3d.apps.recipe import build_model
from lightning_3d.core.compose import compose_config
from lightning_3d.models.gpt import GPT, GPTConfig
from lightning_3d.monitoring.callbacks import GlobalSummary, TokenThroughput, model_flops_per_token
from lightning_3d.planner import problem_from_config
from lightning_3d.plugins.strategy import ThreeDParallelStrategy
from lightning_3d.testing.harness import run_on_ranks
from tests.helpers import TINY_GPT, quiet_trainer, result_of, run_checks, tiny_data, tiny_gpt

GLOBAL_BATCH = 4
PEAK = 1e12  # an explicit per-device peak: CPU has none of its own


def test_recipe_flops_per_token_is_the_planners() -> None:
    """The count the callback uses for the recipe's GPT equals the planner's for the composed config."""
    cfg = compose_config([])
    model = build_model(cfg)
    model.configure_model()  # what Lightning calls before fit: builds the GPT
    seq = int(cfg.model.block_size)
    ours = model_flops_per_token(model, seq)
    planner = problem_from_config(cfg).model.step_flops(1, 0.0) / seq
    assert ours is not None and ours == pytest.approx(planner, rel=0.01)
    # model FLOPs, not hardware FLOPs: recompute passes are not in the count
    assert ours < problem_from_config(cfg).model.step_flops(1, 1.0) / seq


def test_no_peak_on_cpu_means_no_mfu() -> None:
    callback = TokenThroughput()
    callback.flops_per_token, callback._flops, callback._seconds, callback._world_size = 1.0, 4e9, 2.0, 2
    assert callback.tflops_per_device == pytest.approx(1e-3) and callback.mfu is None
    callback.peak_flops = 1e10
    assert callback.mfu == pytest.approx(0.1)


class _NoOwnCallbacks(type(tiny_gpt())):  # GPTModule without its TokenThroughput (the test passes one)
    def configure_callbacks(self) -> list:
        return []


class _Recorder(TokenThroughput):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(warmup=1, **kwargs)
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[override]
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.steps.append(dict(self.last_metrics))


def _throughput(**strategy: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    recorder = _Recorder(peak_flops=PEAK)
    model = _NoOwnCallbacks(GPTConfig(**TINY_GPT), lr=1e-2, warmup_steps=2)
    trainer = quiet_trainer(
        max_steps=3, limit_val_batches=0, callbacks=[recorder], strategy=ThreeDParallelStrategy(**strategy), log_every_n_steps=1
    )
    trainer.fit(model, tiny_data(global_batch_size=GLOBAL_BATCH))
    return {"steps": recorder.steps, "flops_per_token": recorder.flops_per_token, "world": trainer.world_size,
            "tflops": recorder.tflops_per_device, "mfu": recorder.mfu}


def _summary_total(**strategy: Any) -> dict[str, int]:
    torch.manual_seed(0)
    model = tiny_gpt()
    trainer = quiet_trainer(max_steps=1, limit_val_batches=0, strategy=ThreeDParallelStrategy(**strategy), enable_model_summary=True)
    trainer.fit(model, tiny_data(global_batch_size=GLOBAL_BATCH))
    summary = GlobalSummary(model)  # a collective: every rank builds it
    kinds = sorted(type(cb).__name__ for cb in trainer.callbacks if "ModelSummary" in type(cb).__name__)
    local = sum(p.numel() for p in model.parameters())
    return {"total": summary.total_parameters, "trainable": summary.trainable_parameters,
            "layers": sum(summary.param_nums), "local": local, "kinds": kinds}


def _four_ranks() -> dict[str, Any]:
    return run_checks({
        "dp2_tp2": lambda: _throughput(tensor_parallel=2),
        "summary_tp2_pp2": lambda: _summary_total(tensor_parallel=2, pipeline_parallel=2),
    })


@pytest.fixture(scope="module")
def four() -> list[dict[str, Any]]:
    return run_on_ranks(_four_ranks, 4, timeout=300)


def test_dp2_tp2_logs_global_tokens_once_not_times_tp(four) -> None:
    seq = TINY_GPT["block_size"]
    expected_fpt = GPT(GPTConfig(**TINY_GPT))
    from lightning_3d.models.adapters.registry import adapter_for

    reference = adapter_for(expected_fpt).flops_per_token(expected_fpt, seq)
    for rank in four:
        got = result_of(rank, "dp2_tp2")
        assert got["world"] == 4 and got["flops_per_token"] == pytest.approx(reference)
        assert len(got["steps"]) == 3
        for m in got["steps"]:
            step_seconds = 1.0 / m["train/batches_per_sec"]
            tokens = GLOBAL_BATCH * seq  # the global batch: dp2 replicas of 2 sequences, tp peers share theirs
            assert m["train/items_per_sec"] == pytest.approx(tokens / step_seconds)
            assert m["tokens_per_s"] == pytest.approx(m["train/items_per_sec"])
            assert m["train/samples_per_sec"] == pytest.approx(GLOBAL_BATCH / step_seconds)
            assert m["train/flops_per_sec"] == pytest.approx(tokens * reference / step_seconds)
            assert m["train/device/flops_per_sec"] == pytest.approx(m["train/flops_per_sec"] / 4)
            assert m["train/device/mfu"] == pytest.approx(m["train/device/flops_per_sec"] / PEAK)
            assert m["mfu"] == pytest.approx(m["train/device/mfu"]) and m["tflops"] == pytest.approx(m["train/device/flops_per_sec"] / 1e12)
        assert got["mfu"] == pytest.approx(got["tflops"] * 1e12 / PEAK)


def test_model_summary_counts_the_whole_model_at_tp2_pp2(four) -> None:
    full = GPT(GPTConfig(**TINY_GPT))
    one_process = sum(p.numel() for p in full.parameters())  # tied embedding counted once
    assert full.config.tie_embeddings
    for rank in four:
        got = result_of(rank, "summary_tp2_pp2")
        assert got["total"] == got["trainable"] == got["layers"] == one_process, got
        assert got["local"] < one_process  # what Lightning's own summary would have printed
        assert got["kinds"] and all(k.startswith("Global") for k in got["kinds"]), got["kinds"]


class _CountingThroughput(TokenThroughput):
    """Counts the clock reads (each one a CUDA synchronize on a GPU) and keeps every logged window."""

    def __init__(self) -> None:
        super().__init__(warmup=1)
        self.clock_reads, self.logged = 0, []

    def _synchronize(self, pl_module) -> None:  # type: ignore[override]
        self.clock_reads += 1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[override]
        before = dict(self.last_metrics)
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self.last_metrics != before:
            self.logged.append((trainer.global_step, dict(self.last_metrics)))


def _fit_counting(**trainer_kwargs: Any) -> tuple[_CountingThroughput, list[str], Any]:
    """A tiny GPT fit with :class:`_CountingThroughput` first among the callbacks; the names every
    ``self.log`` call logged, in order."""
    torch.manual_seed(0)
    counting = _CountingThroughput()
    model = _NoOwnCallbacks(GPTConfig(**TINY_GPT), lr=1e-2, warmup_steps=2)
    logged_names: list[str] = []
    original_log = model.log
    model.log = lambda name, *a, **k: (logged_names.append(name), original_log(name, *a, **k))[1]  # type: ignore[method-assign]
    callbacks = [counting, *trainer_kwargs.pop("callbacks", [])]
    trainer = quiet_trainer(limit_val_batches=0, callbacks=callbacks, **trainer_kwargs)
    trainer.fit(model, tiny_data(global_batch_size=GLOBAL_BATCH))
    return counting, logged_names, trainer


def test_throughput_logs_and_reads_the_clock_at_the_loggers_cadence() -> None:
    """9 steps, log_every_n_steps=4: values logged at steps 4 and 8 only (rates over the steps since the
    last read), the clock read at the start, the end of warm-up, those two steps and the last; the mean
    covers steps 2-9 exactly."""
    counting, logged_names, trainer = _fit_counting(max_steps=9, log_every_n_steps=4)
    assert [step for step, _ in counting.logged] == [4, 8]
    assert logged_names.count("tokens_per_s") == 2 and logged_names.count("mem_mb") == 2
    assert logged_names.count("train_loss") == 9  # the model's own per-step log is untouched
    assert counting.clock_reads == 5
    tokens = GLOBAL_BATCH * TINY_GPT["block_size"]
    windows = {4: 3, 8: 4}  # steps 2-4 (after the warm-up read at step 1), then 5-8
    for step, m in counting.logged:
        assert m["train/items_per_sec"] / m["train/batches_per_sec"] == pytest.approx(tokens)
        assert m["tokens_per_s"] == pytest.approx(m["train/items_per_sec"])
        assert 0 < windows[step] / m["train/batches_per_sec"] < counting._seconds
    assert counting._tokens == 8 * tokens and counting.mean_tokens_per_s == pytest.approx(8 * tokens / counting._seconds)
    assert trainer.callback_metrics["tokens_per_s"] == pytest.approx(counting.logged[-1][1]["tokens_per_s"])


class _SlowEpochEnd(L.Callback):
    """An epoch-end hook as slow as a checkpoint save (Lightning runs it after TokenThroughput's)."""

    def on_train_epoch_end(self, trainer, pl_module) -> None:  # type: ignore[override]
        time.sleep(1.5)


def test_throughput_logs_once_per_accumulated_step_and_leaves_epoch_end_out() -> None:
    """Accumulating 2 micro-batches per step, logging every 2 steps: one log per logged step (at the
    micro-batch that steps), and a slow epoch-end hook is not training time."""
    counting, logged_names, _ = _fit_counting(max_steps=4, accumulate_grad_batches=2, callbacks=[_SlowEpochEnd()], log_every_n_steps=2)
    assert [step for step, _ in counting.logged] == [2, 4] and logged_names.count("tokens_per_s") == 2
    assert 0 < counting._seconds < 1.5  # 7 tiny micro-batches, without the 1.5 s epoch end
