"""Issue 35: one global data cursor. An epoch's order is a function of (seed, epoch); a checkpoint keeps how
many samples the finished batches consumed; a resume continues with exactly the next unseen samples at any
data-parallel size, for a user's map-style dataset through the strategy's sampler and for our token windows,
without reading what came before."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_3d.data.sampler import GlobalCursorSampler, ResumableDataLoader, with_global_cursor
from lightning_3d.testing.harness import run_on_ranks
from tests.helpers import TINY_GPT, quiet_trainer, result_of, run_checks, tiny_data, tiny_gpt, world_shape


class Counted(Dataset):
    """Sample ``i`` is ``i``; counts the samples read."""

    def __init__(self, n: int) -> None:
        self.n, self.reads = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.reads += 1
        return i


@pytest.mark.parametrize("drop_last", [False, True])
def test_the_order_is_torchs_and_each_global_batch_is_the_same_run_of_it_at_any_dp(drop_last):
    n, global_batch = 37, 8
    runs = {}
    for replicas in (1, 2, 4, 8):
        samplers = [GlobalCursorSampler(n, replicas, r, seed=3, drop_last=drop_last) for r in range(replicas)]
        for r, sampler in enumerate(samplers):
            sampler.set_epoch(2)
            torch_sampler = DistributedSampler(range(n), replicas, r, seed=3, drop_last=drop_last)
            torch_sampler.set_epoch(2)
            assert list(sampler) == list(torch_sampler)
        per = [list(s) for s in samplers]
        b = global_batch // replicas
        runs[replicas] = [sorted(i for rank in per for i in rank[j * b:(j + 1) * b]) for j in range(len(per[0]) // b)]
    order = samplers[0].order(2)
    steps = n // global_batch
    for replicas, batches in runs.items():
        assert batches[:steps] == [sorted(order[j * global_batch:(j + 1) * global_batch]) for j in range(steps)], replicas


def test_a_checkpointed_cursor_resumes_at_another_dp_reading_only_the_unseen_samples():
    n, global_batch, done = 64, 8, 3  # stop after 3 global batches at dp4, resume at dp2 (and dp8)
    saved = ResumableDataLoader(Counted(n), batch_size=2, sampler=GlobalCursorSampler(n, 4, 1), progress=lambda: done)
    state = saved.state_dict()
    assert state == {"batches_done": 3, "epoch": 0, "samples_per_batch": 8, "samples_consumed": 24}
    for replicas in (2, 8):
        b = global_batch // replicas
        whole = [list(ResumableDataLoader(Counted(n), batch_size=b, sampler=GlobalCursorSampler(n, replicas, r))) for r in range(replicas)]
        for r in range(replicas):
            data = Counted(n)
            resumed = ResumableDataLoader(data, batch_size=b, sampler=GlobalCursorSampler(n, replicas, r))
            resumed.load_state_dict(state)
            batches = list(resumed)
            assert [t.tolist() for t in batches] == [t.tolist() for t in whole[r][done:]]
            assert data.reads == (n // replicas) - done * b  # nothing before the cursor was read
            assert len(resumed) == n // replicas // b  # Lightning's progress counts the batches before it
    mismatched = ResumableDataLoader(Counted(n), batch_size=2, sampler=GlobalCursorSampler(n, 2, 0))
    with pytest.raises(ValueError, match="4 per loader batch\\), where the checkpoint's run took 8"):
        mismatched.load_state_dict(state)


def test_only_a_plain_loader_with_lightnings_sampler_gets_the_cursor():
    data = Counted(16)
    plain = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, 2, 1, seed=5))
    converted = with_global_cursor(plain, lambda: 0)
    assert isinstance(converted, ResumableDataLoader) and isinstance(converted.sampler, GlobalCursorSampler)
    assert [t.tolist() for t in converted] == [t.tolist() for t in plain]

    class Custom(DataLoader):
        pass

    for other in (Custom(data, batch_size=2, sampler=DistributedSampler(data, 2, 1)), DataLoader(data, batch_size=2)):
        assert with_global_cursor(other, lambda: 0) is other


# -- through Lightning: a user's dataset, a fresh process, another data-parallel size --------------------------
STEPS, SAVE_AT, GLOBAL_BATCH = 6, 3, 8


class Windows(Dataset):
    """A user's map-style dataset of (input, target) windows of a fixed random stream."""

    def __init__(self) -> None:
        stream = torch.from_numpy(np.random.default_rng(0).integers(0, TINY_GPT["vocab_size"], 48 * 33))
        self.windows = stream.view(48, 33)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.windows[i, :-1], self.windows[i, 1:]


class Seen(L.Callback):
    """Per step: this rank's samples (their first tokens) and its loss."""

    def __init__(self) -> None:
        self.steps: list[tuple[list[list[int]], float]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, i: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.steps.append(([row[:6].tolist() for row in batch[0]], float(loss)))


class StopAt(L.Callback):
    """Stops training after step SAVE_AT (its checkpoint written): a run planned for STEPS, cut short."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, i: int) -> None:
        if trainer.global_step >= SAVE_AT:
            trainer.should_stop = True


def _fit(
    steps: int, callbacks: list[Any], ckpt_path: Any = None, text: bool = False, fixed: bool = False, early: bool = False,
    **strategy: Any,
) -> list[Any]:
    """``fixed``: the user's loader keeps 2 samples per replica at any size, and the strategy keeps the global
    batch by gradient accumulation (``global_batch_size``). ``early``: the schedule's length comes from
    ``trainer.estimated_stepping_batches``, which makes Lightning build the loader before the restore."""
    from lightning_3d import ThreeDParallelStrategy

    if fixed:
        strategy["global_batch_size"] = GLOBAL_BATCH
    L.seed_everything(0)
    seen = Seen()
    trainer = quiet_trainer(
        max_steps=steps, limit_val_batches=0, callbacks=[seen, *callbacks], enable_checkpointing=bool(callbacks),
        precision="32-true", strategy=ThreeDParallelStrategy(**strategy),
        max_epochs=1 if early else None,  # (with max_epochs, estimated_stepping_batches builds the loader to count)
    )
    model = tiny_gpt()
    model.hparams.decay_steps = None if early else STEPS  # (None: configure_optimizers reads estimated_stepping_batches)
    dp = world_shape()[0] // (strategy.get("tensor_parallel", 1) * strategy.get("pipeline_parallel", 1))
    if text:  # our token windows, whose loader resumes by the same cursor
        trainer.fit(model, tiny_data(global_batch_size=GLOBAL_BATCH), ckpt_path=ckpt_path)
    else:
        loader = DataLoader(Windows(), batch_size=2 if fixed else GLOBAL_BATCH // dp, shuffle=True, drop_last=True)
        trainer.fit(model, train_dataloaders=loader, ckpt_path=ckpt_path)
    assert isinstance(trainer.train_dataloader.sampler, GlobalCursorSampler)
    assert trainer.accumulate_grad_batches == (GLOBAL_BATCH // (2 * dp) if fixed else 1)
    return seen.steps


def first_world(root: str, kinds: tuple[str, ...] = ("", "text")) -> dict[str, Any]:
    checks = {}
    for kind in kinds:
        every = ModelCheckpoint(dirpath=Path(root) / f"ckpt{kind}", save_last=True, every_n_train_steps=SAVE_AT)
        checks[f"full{kind}"] = lambda k=kind: _fit(STEPS, [], text=k == "text", fixed=k == "fixed", early=k == "early")
        # (early: the whole run's schedule, stopped after the checkpoint at SAVE_AT, as the uninterrupted run's)
        checks[f"first{kind}"] = lambda k=kind, c=every: _fit(
            STEPS if k == "early" else SAVE_AT, [c, StopAt()] if k == "early" else [c], text=k == "text", fixed=k == "fixed", early=k == "early"
        )
    return run_checks(checks)


def resumed_world(root: str, kinds: tuple[str, ...] = ("", "text"), **strategy: Any) -> dict[str, Any]:  # new processes, another layout
    checks = {
        f"resumed{kind}": lambda k=kind: _fit(
            STEPS, [], ckpt_path=str(Path(root) / f"ckpt{k}" / "last.ckpt"), text=k == "text", fixed=k == "fixed", early=k == "early",
            # (fixed: an elastic policy that lets dp shrink to 2, as this restart does)
            **({"elastic": {"min_data_parallel": 2}} if k == "fixed" else {}), **strategy,
        )
        for kind in kinds
    }
    if "fixed" in kinds and not strategy:  # policies this dp4 -> dp2 restart breaks: refused before step 1
        last = str(Path(root) / "ckptfixed" / "last.ckpt")
        checks["policy-min"] = lambda: _fit(STEPS, [], ckpt_path=last, fixed=True, elastic={"min_data_parallel": 4})
        checks["policy-nothing"] = lambda: _fit(STEPS, [], ckpt_path=last, fixed=True, elastic={"may_change": []})
    return run_checks(checks)


def _per_step(results: list[dict[str, Any]], name: str) -> list[tuple[list[list[int]], float]]:
    """Each step's samples over the replicas (sorted; tp and pp peers see their replica's) and the mean of
    the ranks' losses (each reports its replica's batch loss)."""
    ranks = [result_of(r, name) for r in results]
    steps = range(len(ranks[0]))
    return [
        (sorted(map(list, {tuple(s) for rank in ranks for s in rank[i][0]})), float(np.mean([rank[i][1] for rank in ranks])))
        for i in steps
    ]


def _optimizer_steps(micro: list[tuple[list[list[int]], float]], accumulation: int) -> list[tuple[list[list[int]], float]]:
    """Loader batches grouped into optimizer steps: their samples together, and the sum of their losses
    (Lightning hands callbacks each loss divided by the accumulation)."""
    return [
        (sorted(s for ids, _ in micro[i : i + accumulation] for s in ids), float(np.sum([loss for _, loss in micro[i : i + accumulation]])))
        for i in range(0, len(micro), accumulation)
    ]


def _check_resume(first: list[dict[str, Any]], resumed: list[dict[str, Any]], kind: str = "", accumulation: int = 1) -> None:
    full, after = _per_step(first, f"full{kind}"), _optimizer_steps(_per_step(resumed, f"resumed{kind}"), accumulation)
    assert len(after) == STEPS - SAVE_AT
    assert [ids for ids, _ in after] == [ids for ids, _ in full[SAVE_AT:]]
    np.testing.assert_allclose([loss for _, loss in after], [loss for _, loss in full[SAVE_AT:]], rtol=1e-5)
    if kind == "":  # (distinct random windows; text repeats itself)
        epoch = [s for ids, _ in full for s in ids]
        assert len(epoch) == STEPS * GLOBAL_BATCH and len({tuple(s) for s in epoch}) == len(epoch)  # no sample twice


@pytest.fixture(scope="module")
def dp4_then_dp2() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    root = tempfile.mkdtemp(prefix="l3d-cursor-")
    kinds = ("", "text", "fixed", "early")
    return run_on_ranks(first_world, 4, root, kinds, timeout=600), run_on_ranks(resumed_world, 2, root, kinds, timeout=600)


@pytest.mark.parametrize("kind", ["", "text", "early"], ids=["users-dataset", "token-windows", "schedule-from-estimated-steps"])
def test_resumed_at_another_dp_it_sees_the_uninterrupted_runs_samples(dp4_then_dp2, kind):
    """(``early``: configure_optimizers reads trainer.estimated_stepping_batches, so Lightning builds the loader
    before the checkpoint's state is restored and never hands it that state: the resume restarted the epoch
    at its first sample, in silence, until the strategy had the loader built again after the restore.)"""
    _check_resume(*dp4_then_dp2, kind=kind)


def test_a_fixed_per_replica_batch_keeps_the_global_batch_by_accumulating_at_the_new_dp(dp4_then_dp2):
    """ThreeDParallelStrategy(global_batch_size=8) with a loader of 2 samples per replica: no accumulation at
    dp4, 2 micro-batches per step at dp2. The checkpoint (3 loader batches of 8 samples) resumes as 6 of 4:
    each optimizer step then takes the same 8 samples as the uninterrupted dp4 run's, with its loss. Without
    the strategy's global batch the resume is refused (the loader batch changed size)."""
    first, resumed = dp4_then_dp2
    _check_resume(first, resumed, kind="fixed", accumulation=2)  # (under elastic={"min_data_parallel": 2})


def test_an_elastic_policy_refuses_a_restart_it_does_not_allow(dp4_then_dp2):
    """elastic=...: a restart below min_data_parallel, or one that changes a degree may_change does not
    name (here dp 4 -> 2 with nothing allowed), stops every rank before step 1, saying why and how out."""
    _, resumed = dp4_then_dp2
    for name, said in (
        ("policy-min", "data_parallel=2 (2 processes), below its min_data_parallel=4; start on more nodes"),
        ("policy-nothing", "this restart changes dp 4 -> 2 from the checkpoint's layout, but the policy lets only nothing change"),
    ):
        for rank in resumed:
            error = rank[name].get("error", "") if isinstance(rank[name], dict) else ""
            assert said in error, error[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{}, {"tensor_parallel": 2, "pipeline_parallel": 2}], ids=["dp8", "dp2-tp2-pp2"])
def test_resumed_on_eight_ranks_at_dp8_or_dp2_tp2_pp2_too(layout):
    root = tempfile.mkdtemp(prefix="l3d-cursor-8-")
    first = run_on_ranks(first_world, 4, root, ("",), timeout=600)
    _check_resume(first, run_on_ranks(resumed_world, 8, root, ("",), timeout=900, **layout))


# -- epochs: a checkpoint that ends an epoch, a resume in a later epoch, a ragged last batch, workers ----------
class Ragged(Windows):
    """18 windows: at dp2 and 4 per replica, an epoch is 3 loader batches, the last of one sample."""

    def __len__(self) -> int:
        return 18


class SaveAt(L.Callback):
    """A checkpoint after each of ``steps``, as ModelCheckpoint writes it mid-epoch."""

    def __init__(self, root: Path, steps: tuple[int, ...]) -> None:
        self.root, self.steps = root, steps

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step in self.steps:
            trainer.save_checkpoint(self.root / f"step={trainer.global_step}.ckpt")


def _fit_epochs(root: Path, ckpt_path: Any = None, workers: int = 0) -> list[Any]:
    from lightning_3d import ThreeDParallelStrategy

    L.seed_everything(0)
    seen = Seen()
    trainer = quiet_trainer(
        max_epochs=2, limit_val_batches=0, callbacks=[seen] + ([] if ckpt_path else [SaveAt(root, (3, 4))]),
        precision="32-true", strategy=ThreeDParallelStrategy(),
    )
    model = tiny_gpt()
    model.hparams.decay_steps = 6
    loader = DataLoader(Ragged(), batch_size=4, shuffle=True, drop_last=False, num_workers=workers)
    trainer.fit(model, train_dataloaders=loader, ckpt_path=ckpt_path)
    return seen.steps


def epochs_world(root: str) -> dict[str, Any]:
    full = Path(root) / "full"
    checks = {"full": lambda: _fit_epochs(full)}
    for step, workers in ((3, 0), (4, 0), (4, 1)):  # the end of epoch 0; inside epoch 1, without and with a worker
        checks[f"from{step}w{workers}"] = lambda s=step, w=workers: _fit_epochs(full, full / f"step={s}.ckpt", w)
    return run_checks(checks)


def test_resumes_at_an_epochs_end_and_in_a_later_epoch_see_the_uninterrupted_runs_samples():
    results = run_on_ranks(epochs_world, 2, tempfile.mkdtemp(prefix="l3d-cursor-epochs-"), timeout=600)
    full = _per_step(results, "full")
    assert len(full) == 6 and sorted(s for ids, _ in full[:3] for s in ids) == sorted(map(list, {tuple(w[:6].tolist()) for w in Ragged().windows[:18]}))
    for step, workers in ((3, 0), (4, 0), (4, 1)):
        resumed = _per_step(results, f"from{step}w{workers}")
        assert [ids for ids, _ in resumed] == [ids for ids, _ in full[step:]], (step, workers)
        np.testing.assert_allclose([loss for _, loss in resumed], [loss for _, loss in full[step:]], rtol=1e-5)
