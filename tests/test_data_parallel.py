"""Data parallelism through Lightning's Trainer: parity with one process, logging, metrics,
accumulation, manual optimization, checkpoints.

Two worlds are started once per module (a 2-rank one and a 1-rank reference) and every check
runs inside them; the tests below only compare what they returned.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_3d.testing.harness import run_on_ranks
from tests.helpers import (
    STEPS,
    LossRecorder,
    gpt_losses,
    param_checksum,
    quiet_trainer,
    result_of,
    run_checks,
    tiny_data,
    tiny_gpt,
)


# -- checks (run on every rank of a world) ---------------------------------------------------
class CountGradientCollectives(L.Callback):
    """Counts gradient-sized all-reduces per training batch (scalars from logging are ignored)."""

    def __init__(self) -> None:
        self.per_batch: list[int] = []
        self._calls = 0
        self._original = torch.distributed.all_reduce

        def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if tensor.numel() > 1:
                self._calls += 1
            return self._original(tensor, *args, **kwargs)

        self._counting = counting

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.buckets = trainer.strategy.grad_reducer.num_buckets
        torch.distributed.all_reduce = self._counting

    def on_train_batch_start(self, *args: Any) -> None:
        self._calls = 0

    def on_train_batch_end(self, *args: Any) -> None:
        self.per_batch.append(self._calls)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        torch.distributed.all_reduce = self._original


def accumulation() -> dict[str, Any]:
    L.seed_everything(0)
    recorder, counter = LossRecorder(), CountGradientCollectives()
    model = tiny_gpt()
    trainer = quiet_trainer(
        max_steps=4,
        accumulate_grad_batches=2,
        limit_val_batches=0,
        callbacks=[recorder, counter],
        strategy=_strategy(bucket_size_mb=0.02),
    )
    trainer.fit(model, tiny_data(global_batch_size=8))
    return {"losses": recorder.losses, "collectives": counter.per_batch, "buckets": counter.buckets}


def _strategy(**kwargs: Any) -> Any:
    from lightning_3d import ThreeDParallelStrategy

    return ThreeDParallelStrategy(**kwargs)


class TinyGAN(L.LightningModule):
    """Manual optimization with two optimizers and a parameter that never gets a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Linear(4, 8)
        self.discriminator = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
        self.unused = nn.Linear(3, 3)
        self.history: list[tuple[float, float]] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        g_opt, d_opt = self.optimizers()
        real = batch[0]
        fake = self.generator(real[:, :4] * 0.5)

        self.toggle_optimizer(d_opt)
        d_loss = F.softplus(-self.discriminator(real)).mean() + F.softplus(self.discriminator(fake.detach())).mean()
        d_opt.zero_grad()
        self.manual_backward(d_loss)
        d_opt.step()
        self.untoggle_optimizer(d_opt)

        self.toggle_optimizer(g_opt)
        g_loss = F.softplus(-self.discriminator(fake)).mean()
        g_opt.zero_grad()
        self.manual_backward(g_loss)
        g_opt.step()
        self.untoggle_optimizer(g_opt)
        self.history.append((float(d_loss), float(g_loss)))

    def configure_optimizers(self) -> Any:
        g = torch.optim.Adam([*self.generator.parameters(), *self.unused.parameters()], lr=1e-2)
        d = torch.optim.SGD(self.discriminator.parameters(), lr=1e-1, momentum=0.9)
        return g, d

    def train_dataloader(self) -> DataLoader:
        data = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
        per_rank = 8 // torch.distributed.get_world_size()
        return DataLoader(TensorDataset(data), batch_size=per_rank)


def gan() -> dict[str, Any]:
    L.seed_everything(0)
    model = TinyGAN()
    unused_before = model.unused.weight.detach().clone()
    quiet_trainer(max_steps=6).fit(model)
    return {
        "history": model.history,
        "checksum": param_checksum(model),
        "unused_grad_is_none": model.unused.weight.grad is None,
        "unused_unchanged": bool(torch.equal(unused_before, model.unused.weight)),
    }


class CountingModule(BoringModel):
    """Counts validation samples with self.log(sync_dist=True) and with torchmetrics."""

    def __init__(self) -> None:
        super().__init__()
        self.metric_sum = torchmetrics.SumMetric()
        self.metric_mean = torchmetrics.MeanMetric()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        n = torch.tensor(float(batch.shape[0]))
        self.log("logged_count", n, reduce_fx="sum", sync_dist=True, on_epoch=True)
        self.metric_sum.update(torch.ones(batch.shape[0]))
        self.metric_mean.update(torch.full((batch.shape[0],), float(torch.distributed.get_rank())))
        self.log("metric_count", self.metric_sum, on_epoch=True)
        self.log("metric_mean_rank", self.metric_mean, on_epoch=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(torch.randn(24, 32), batch_size=5)  # uneven last batch on purpose


def logging_and_metrics() -> dict[str, float]:
    L.seed_everything(0)
    results = quiet_trainer().validate(CountingModule(), verbose=False)[0]
    return {k: float(v) for k, v in results.items()}


def boring_all_stages(tmp: str) -> dict[str, Any]:
    L.seed_everything(0)
    model = BoringModel()
    before = param_checksum(model)
    trainer = quiet_trainer(max_steps=5, limit_val_batches=2, default_root_dir=tmp)
    trainer.fit(model)
    after = param_checksum(model)
    validated = trainer.validate(model, verbose=False)
    tested = trainer.test(model, verbose=False)
    predictions = trainer.predict(model)
    return {
        "changed": after != before,
        "checksum": after,
        "validated": bool(validated),
        "tested": bool(tested),
        "num_predictions": sum(p.shape[0] for p in predictions),
        "is_distributed": trainer.strategy.is_distributed,
    }


def resume(tmp: str, mid_epoch: bool) -> dict[str, Any]:
    """Uninterrupted 2 x 4 steps vs. resuming from the checkpoint after step 4 (epoch end or mid-epoch)."""
    ckpt_dir = Path(tmp) / ("mid" if mid_epoch else "epoch")
    trainer_kwargs: dict[str, Any] = dict(limit_val_batches=0, enable_checkpointing=True)
    if mid_epoch:
        trainer_kwargs.update(max_steps=8, limit_train_batches=8)
        checkpoint = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=4, save_top_k=-1, filename="{step}")
        resume_from = ckpt_dir / "step=4.ckpt"
    else:
        trainer_kwargs.update(max_epochs=2, limit_train_batches=4)
        checkpoint = ModelCheckpoint(dirpath=ckpt_dir, every_n_epochs=1, save_top_k=-1, filename="{epoch}")
        resume_from = ckpt_dir / "epoch=0.ckpt"

    L.seed_everything(0)
    full = LossRecorder()
    quiet_trainer(callbacks=[full, checkpoint], **trainer_kwargs).fit(tiny_gpt(), tiny_data())

    L.seed_everything(0)
    resumed = LossRecorder()
    trainer = quiet_trainer(callbacks=[resumed], **trainer_kwargs)
    trainer.fit(tiny_gpt(), tiny_data(), ckpt_path=str(resume_from))
    return {"full": full.losses, "resumed": resumed.losses, "global_step": trainer.global_step}


def collectives() -> dict[str, Any]:
    trainer = quiet_trainer(max_steps=1)
    trainer.fit(BoringModel())
    s = trainer.strategy
    rank = torch.distributed.get_rank()
    barriers = []  # a reduce is one all-reduce: no barrier before it (a host stall per logged value on NCCL)
    plain_barrier = torch.distributed.barrier
    torch.distributed.barrier = lambda *a, **k: barriers.append(1) or plain_barrier(*a, **k)
    try:
        reduced = {
            "mean": float(s.reduce(torch.tensor(float(rank)), reduce_op="mean")),
            "sum": float(s.reduce(torch.tensor(float(rank + 1)), reduce_op="sum")),
            "int_mean": s.reduce(torch.tensor(rank + 2), reduce_op="mean").tolist(),
            "max": float(s.reduce(torch.tensor(float(rank)), reduce_op="max")),
            "enum_sum": float(s.reduce(torch.tensor(2.0), reduce_op=torch.distributed.ReduceOp.SUM)),
            "default_op": float(s.reduce(torch.tensor(float(rank)))),
            "none_op": float(s.reduce(torch.tensor(1.0), reduce_op=None)),  # Lightning documents None as a sum
            "fp16_mean": float(s.reduce(torch.tensor(60000.0, dtype=torch.float16), reduce_op="mean")),  # the sum would be inf
        }
    finally:
        torch.distributed.barrier = plain_barrier
    return {
        **reduced,
        "barriers_in_reduce": len(barriers),
        "gathered": s.all_gather(torch.tensor([rank, 10 + rank])).tolist(),
        "broadcast": s.broadcast({"from": rank}, src=0),
        "all_agree_false": s.reduce_boolean_decision(rank == 0, all=True),
        "any_true": s.reduce_boolean_decision(rank == 0, all=False),
        "barrier": s.barrier() is None,
        "sampler": s.distributed_sampler_kwargs,
        "mesh_dims": list(trainer.lightning_module.device_mesh.mesh_dim_names),
    }


def lightning_sigterm_flag(tmp: str) -> dict[str, Any]:
    """Lightning's per-step broadcast of rank 0's SIGTERM flag is off while ours agrees (counted: 0
    calls in 3 steps), and Lightning's own loop has it back after the fit. A flag Lightning's handler
    set on rank 1 alone before training (a signal during set-up) is taken over by ours: both ranks
    stop together with a checkpoint, where Lightning would raise on rank 1 alone and leave rank 0 in
    its next collective."""
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    from lightning_3d.resilience.preemption import TrainingInterrupted

    calls = []
    plain = _TrainingEpochLoop._broadcast_sigterm_tensor
    _TrainingEpochLoop._broadcast_sigterm_tensor = lambda self: calls.append(1) or plain(self)
    try:
        trainer = quiet_trainer(max_steps=3)
        trainer.fit(BoringModel())
        restored = "_broadcast_sigterm_tensor" not in trainer.fit_loop.epoch_loop.__dict__

        class SignalDuringSetUp(L.Callback):
            def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
                trainer._signal_connector.received_sigterm = torch.distributed.get_rank() == 1  # (what its handler sets)

        stopped = None
        late = quiet_trainer(max_steps=8, default_root_dir=f"{tmp}/sigterm", callbacks=[SignalDuringSetUp()])
        try:
            late.fit(BoringModel())
        except TrainingInterrupted as err:
            stopped = (err.step, Path(err.path).exists())
        restored = restored and "_broadcast_sigterm_tensor" not in late.fit_loop.epoch_loop.__dict__  # (after an exception too)
    finally:
        _TrainingEpochLoop._broadcast_sigterm_tensor = plain
    return {"lightning_broadcasts": len(calls), "restored": restored, "stopped": stopped}


def two_rank_world(tmp: str) -> dict[str, Any]:
    return run_checks(
        {
            "gpt": gpt_losses,
            "accumulation": accumulation,
            "gan": gan,
            "logging": logging_and_metrics,
            "boring": lambda: boring_all_stages(tmp),
            "resume_epoch": lambda: resume(tmp, mid_epoch=False),
            "resume_mid_epoch": lambda: resume(tmp, mid_epoch=True),
            "collectives": collectives,
            "sigterm_flag": lambda: lightning_sigterm_flag(tmp),
        }
    )


def reference_world() -> dict[str, Any]:
    return run_checks({"gpt": gpt_losses, "accumulation": accumulation, "gan": gan})


# -- fixtures: each world runs once per module ------------------------------------------------
@pytest.fixture(scope="module")
def dp2(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_on_ranks(two_rank_world, 2, str(tmp_path_factory.mktemp("dp2")), timeout=420)


@pytest.fixture(scope="module")
def single() -> dict[str, Any]:
    return run_on_ranks(reference_world, 1, timeout=240)[0]


def _global_losses(per_rank: list[list[float]]) -> np.ndarray:
    """Each rank's loss is the mean over an equal share of the global batch."""
    return np.mean(np.array(per_rank), axis=0)


# -- tests -----------------------------------------------------------------------------------------
def test_dp2_gpt_losses_match_one_process(dp2, single):
    ours = _global_losses([result_of(r, "gpt")["losses"] for r in dp2])
    reference = np.array(result_of(single, "gpt")["losses"])
    assert len(ours) == len(reference) == STEPS
    np.testing.assert_allclose(ours, reference, rtol=1e-5)
    assert reference[-1] < reference[0]  # it trains


def test_replicas_stay_identical(dp2):
    for name in ("gpt", "gan", "boring"):
        checksums = [result_of(r, name)["checksum"] for r in dp2]
        assert checksums[0] == checksums[1], name


def test_accumulation_communicates_only_on_the_stepping_batch(dp2, single):
    acc = [result_of(r, "accumulation") for r in dp2]
    buckets = acc[0]["buckets"]
    assert buckets > 1  # small buckets on purpose: several overlapped collectives per step
    assert acc[0]["collectives"] == [0, buckets] * 4
    np.testing.assert_allclose(
        _global_losses([a["losses"] for a in acc]), result_of(single, "accumulation")["losses"], rtol=1e-5
    )


def test_manual_optimization_with_two_optimizers_matches_one_process(dp2, single):
    ours = [result_of(r, "gan") for r in dp2]
    reference = result_of(single, "gan")
    np.testing.assert_allclose(
        np.mean([np.array(o["history"]) for o in ours], axis=0), np.array(reference["history"]), rtol=1e-5
    )
    assert np.isclose(ours[0]["checksum"], reference["checksum"], rtol=1e-6)
    # a parameter no rank produced a gradient for keeps grad=None and is not touched by Adam
    assert all(o["unused_grad_is_none"] and o["unused_unchanged"] for o in ours)


def test_sync_dist_logging_and_torchmetrics_count_each_sample_once(dp2):
    for r in dp2:
        logged = result_of(r, "logging")
        assert logged["logged_count"] == 24
        assert logged["metric_count"] == 24
        assert logged["metric_mean_rank"] == pytest.approx(0.5)  # both ranks' samples, equally weighted


def test_boring_model_fit_validate_test_predict(dp2):
    for r in dp2:
        boring = result_of(r, "boring")
        assert boring["changed"] and boring["validated"] and boring["tested"] and boring["is_distributed"]
        assert boring["num_predictions"] == 32  # BoringModel predicts on 64 samples, half per rank


@pytest.mark.parametrize("name", ["resume_epoch", "resume_mid_epoch"])
def test_resume_continues_with_the_same_losses(dp2, name):
    for r in dp2:
        run = result_of(r, name)
        assert len(run["full"]) == 8 and run["global_step"] == 8
        np.testing.assert_allclose(run["resumed"], run["full"][4:], rtol=1e-6)
        assert not np.isclose(run["resumed"][0], run["full"][0])  # weights really came from the checkpoint


def test_lightnings_per_step_sigterm_broadcast_gives_way_to_ours(dp2):
    r0, r1 = (result_of(r, "sigterm_flag") for r in dp2)
    assert r0["lightning_broadcasts"] == r1["lightning_broadcasts"] == 0 and r0["restored"] and r1["restored"]
    assert r0["stopped"] == r1["stopped"] and r0["stopped"][1], (r0, r1)  # the same step, the checkpoint written
    assert r0["stopped"][0] <= 2


def test_collectives_default_to_the_data_parallel_group(dp2):
    c0, c1 = (result_of(r, "collectives") for r in dp2)
    assert c0["mean"] == c1["mean"] == 0.5
    assert c0["sum"] == c1["sum"] == 3.0
    assert c0["int_mean"] == c1["int_mean"] == 2  # (2 + 3) / 2 in the tensor's own dtype, as Lightning's
    assert c0["max"] == c1["max"] == 1.0 and c0["enum_sum"] == c1["enum_sum"] == 4.0
    assert c0["default_op"] == c1["default_op"] == 0.5  # Lightning's default: the mean
    assert c0["none_op"] == c1["none_op"] == 2.0 and c0["fp16_mean"] == c1["fp16_mean"] == 60000.0
    assert c0["barriers_in_reduce"] == c1["barriers_in_reduce"] == 0
    assert c0["gathered"] == c1["gathered"] == [[0, 10], [1, 11]]
    assert c0["broadcast"] == c1["broadcast"] == {"from": 0}
    assert not c0["all_agree_false"] and not c1["all_agree_false"]
    assert c0["any_true"] and c1["any_true"]
    assert c0["sampler"] == {"num_replicas": 2, "rank": 0} and c1["sampler"] == {"num_replicas": 2, "rank": 1}
    assert c0["mesh_dims"] == ["pp", "dp", "cp", "tp"]
