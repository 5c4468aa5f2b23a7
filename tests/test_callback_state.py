"""Callbacks and hooks under sharded checkpoints: ``checkpoint["state_dict"]`` is this rank's local
state dict (saving and loading), and what a callback adds to the checkpoint -- per-rank tensors
included -- comes back on the same rank. The worked example is an EMA of the local shards
(docs/checkpointing.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor

from lightning_3d import ThreeDParallelStrategy
from lightning_3d.checkpoint.dense_state import _sharded_spec, to_dense
from lightning_3d.testing.harness import RankError, run_on_ranks
from tests.helpers import quiet_trainer, tiny_data, tiny_gpt

STEPS, SAVE_AT = 6, 3


class EMA(L.Callback):
    """Exponential moving average of this rank's parameters: its local shards (a tensor-parallel
    slice, a pipeline stage's layers, a ZeRO-3 row chunk), never gathered. Saved per rank in the
    checkpoint under ``"ema"`` (``where="hook"``) or as the callback's state (``where="state_dict"``)."""

    def __init__(self, decay: float = 0.9, where: str = "hook") -> None:
        self.decay, self.where = decay, where
        self.shadow: dict[str, Tensor] = {}
        self.updates = 0

    @staticmethod
    def _local(t: Tensor) -> Tensor:
        return t.to_local() if hasattr(t, "to_local") else t  # ZeRO-3: the DTensor's local chunk

    @torch.no_grad()
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        for name, p in pl_module.named_parameters():
            if p.requires_grad:
                local = self._local(p.detach()).float()
                if name in self.shadow:
                    self.shadow[name].lerp_(local, 1.0 - self.decay)
                else:
                    self.shadow[name] = local.clone()
        self.updates += 1

    # -- saved with the checkpoint, per rank ---------------------------------------------------------
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        if self.where == "hook":
            checkpoint["ema"] = {"decay": self.decay, "updates": self.updates, "shadow": self.shadow}

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        if self.where == "hook" and "ema" in checkpoint:
            self._restore(checkpoint["ema"])

    def state_dict(self) -> dict[str, Any]:
        if self.where == "state_dict":
            return {"decay": self.decay, "updates": self.updates, "shadow": self.shadow}
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.where == "state_dict" and state:
            self._restore(state)

    def _restore(self, state: dict[str, Any]) -> None:
        self.decay, self.updates = state["decay"], state["updates"]
        self.shadow = dict(state["shadow"])  # host tensors: placed in on_train_start

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Restored shadows must fit this rank's shards (they do under the layout that saved them), and
        go where the parameters are."""
        local = {n: self._local(p.detach()) for n, p in pl_module.named_parameters()}
        wrong = [n for n, t in self.shadow.items() if n not in local or local[n].shape != t.shape]
        if wrong:
            raise RuntimeError(f"the EMA state does not fit this rank's parameters (another layout?): {wrong[:3]}")
        self.shadow = {n: t.to(local[n].device, torch.float32, copy=True) for n, t in self.shadow.items()}


class Probe(L.Callback):
    """Records what the hooks see: the local state dict at save (compared with the module's own) and
    at load, the EMA right after it was restored, and the gathered EMA at the end."""

    def __init__(self, ema: EMA) -> None:
        self.ema = ema
        self.saved: dict[str, Any] = {}
        self.loaded: dict[str, Any] = {}
        self.dense: dict[str, Tensor] = {}
        self.reference: dict[str, Tensor] = {}  # the EMA of the gathered weights, uninterrupted runs only

    @torch.no_grad()
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        for name, p in pl_module.named_parameters():
            dense = to_dense(p, _sharded_spec(p)).float()
            if name in self.reference:
                self.reference[name].lerp_(dense, 1.0 - self.ema.decay)
            else:
                self.reference[name] = dense.clone()

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        state, own = checkpoint["state_dict"], pl_module.state_dict()
        assert list(state) == list(own) and len(state) > 0
        for k, v in own.items():
            assert state[k].shape == v.shape and torch.equal(EMA._local(state[k]), EMA._local(v)), k
        if trainer.global_step != SAVE_AT:
            return
        self.saved = {
            "state_dict": {k: EMA._local(v).clone() for k, v in state.items()},
            "ema": {k: v.clone() for k, v in self.ema.shadow.items()},
        }

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        state = checkpoint["state_dict"]
        own = pl_module.state_dict()  # restored before the callbacks' hooks run
        assert list(state) == list(own)
        self.loaded["state_dict"] = {k: EMA._local(state[k]).clone() for k in state}
        assert all(torch.equal(self.loaded["state_dict"][k], EMA._local(v)) for k, v in own.items())

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.loaded["ema"] = {k: v.clone() for k, v in self.ema.shadow.items()}

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from torch.distributed.tensor import DTensor

        for name, p in pl_module.named_parameters():
            s = self.ema.shadow[name]
            if hasattr(p, "device_mesh"):
                s = DTensor.from_local(s, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
            self.dense[name] = to_dense(s, _sharded_spec(p)).clone()


def fit_with_ema(tmp: str, resume: Optional[str] = None, where: str = "hook", **strategy: Any) -> dict[str, Any]:
    L.seed_everything(0)
    ema = EMA(where=where)
    probe = Probe(ema)
    callbacks: list[L.Callback] = [ema, probe]
    if resume is None:
        callbacks.append(ModelCheckpoint(dirpath=tmp, every_n_train_steps=SAVE_AT, save_top_k=-1, filename="{step}"))
    trainer = quiet_trainer(
        max_steps=STEPS, limit_val_batches=0, callbacks=callbacks, enable_checkpointing=resume is None,
        strategy=ThreeDParallelStrategy(**strategy),
    )
    trainer.fit(tiny_gpt(lr=3e-3), tiny_data(global_batch_size=8), ckpt_path=resume)
    out = {"saved": probe.saved, "loaded": probe.loaded, "dense": probe.dense, "reference": probe.reference, "final": ema.shadow, "updates": ema.updates}
    return as_numpy(out)  # tensors would travel back through shared memory that dies with the rank


def as_numpy(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.detach().cpu().numpy().copy()
    if isinstance(obj, dict):
        return {k: as_numpy(v) for k, v in obj.items()}
    return obj


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict[str, np.ndarray]:
    """The same EMA computed in one process (nothing sharded)."""
    return run_on_ranks(fit_with_ema, 1, str(tmp_path_factory.mktemp("one")), timeout=300)[0]["dense"]


def assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray], atol: float = 0.0) -> None:
    assert sorted(a) == sorted(b) and len(a) > 0
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=0, atol=atol, err_msg=k)


@pytest.mark.parametrize(
    ("layout", "where"),
    [(dict(tensor_parallel=2), "hook"), (dict(data_parallel=2, zero_stage=3), "state_dict"), (dict(pipeline_parallel=2), "hook")],
    ids=["tp2-hook", "zero3-dp2-state_dict", "pp2-hook"],
)
def test_ema_saved_per_rank_and_restored(tmp_path, one_process, layout, where):
    ranks = run_on_ranks(fit_with_ema, 2, str(tmp_path), where=where, timeout=300, **layout)
    checkpoint = tmp_path / f"step={SAVE_AT}.ckpt"
    assert (checkpoint / "rank0.meta.pt").is_file() and (checkpoint / "rank1.meta.pt").is_file()
    # the hooks saw this rank's shards; gathered, the EMA of the shards is the EMA of the dense weights
    # (kept beside it from the gathered parameters every step) within 1e-6 ...
    dense = {k: v for r in ranks for k, v in r["dense"].items()}  # pipeline stages: each its own layers
    assert_same(dense, {k: v for r in ranks for k, v in r["reference"].items()}, atol=1e-6)
    # ... and the EMA of a one-process run, within Adam's layout noise (a weight whose gradient is rounding
    # noise, e.g. the key bias softmax ignores, takes lr-sized steps either way: up to ~6e-6 here)
    if "model.lm_head.weight" in dense and "model.lm_head.weight" not in one_process:  # the last stage's tied copy
        assert_same({"w": dense.pop("model.lm_head.weight")}, {"w": dense["model.wte.weight"]}, atol=1e-6)
    assert_same(dense, one_process, atol=2e-5)
    if "tensor_parallel" in layout:  # the ranks' shards differ (tp slices of the same names)
        assert any(not np.array_equal(ranks[0]["final"][k], ranks[1]["final"][k]) for k in ranks[0]["final"])

    resumed = run_on_ranks(fit_with_ema, 2, str(tmp_path), resume=str(checkpoint), where=where, timeout=300, **layout)
    for before, after in zip(ranks, resumed):
        assert_same(after["loaded"]["ema"], before["saved"]["ema"])  # exactly what this rank saved
        assert_same(after["loaded"]["state_dict"], before["saved"]["state_dict"])  # on_load sees the same local view
        assert after["updates"] == STEPS
        assert_same(after["final"], before["final"], atol=1e-6)  # and training on gives the uninterrupted EMA


def test_per_rank_state_under_another_layout_is_refused(tmp_path):
    run_on_ranks(fit_with_ema, 2, str(tmp_path), timeout=300, tensor_parallel=2)
    with pytest.raises(RankError, match=r"differ between ranks .*checkpoint\['ema'\]\['shadow'\]"):
        run_on_ranks(fit_with_ema, 1, str(tmp_path), resume=str(tmp_path / f"step={SAVE_AT}.ckpt"), timeout=300)


def save_replicated(tmp: str, resume: Optional[str] = None) -> list[float]:
    """A callback whose tensor state is alike on every rank (dp2): loads under another layout."""

    class Counter(L.Callback):
        def __init__(self) -> None:
            self.seen = torch.zeros(3)

        def on_train_batch_end(self, *args: Any) -> None:
            self.seen += 1

        def state_dict(self) -> dict[str, Any]:
            return {"seen": self.seen}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.seen = state["seen"].clone()

    L.seed_everything(0)
    counter = Counter()
    callbacks: list[L.Callback] = [counter]
    if resume is None:
        callbacks.append(ModelCheckpoint(dirpath=tmp, every_n_train_steps=2, save_top_k=-1, filename="{step}"))
    trainer = quiet_trainer(max_steps=2 if resume is None else 3, limit_val_batches=0, callbacks=callbacks,
                            enable_checkpointing=resume is None, strategy=ThreeDParallelStrategy())
    trainer.fit(tiny_gpt(), tiny_data(global_batch_size=8), ckpt_path=resume)
    return counter.seen.tolist()


def test_replicated_callback_state_loads_under_another_layout(tmp_path):
    assert run_on_ranks(save_replicated, 2, str(tmp_path), timeout=300) == [[2.0] * 3] * 2
    assert run_on_ranks(save_replicated, 1, str(tmp_path), resume=str(tmp_path / "step=2.ckpt"), timeout=300) == [[3.0] * 3]


class Overwrite(L.Callback):
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        checkpoint["state_dict"] = {k: v * 0 for k, v in checkpoint["state_dict"].items()}


def save_overwritten(tmp: str) -> list[str]:
    import warnings

    trainer = quiet_trainer(max_steps=1, limit_val_batches=0, callbacks=[Overwrite()])
    trainer.fit(tiny_gpt(), tiny_data(global_batch_size=8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.save_checkpoint(str(Path(tmp) / "x.ckpt"))
    return [str(w.message) for w in caught]


def test_changing_the_state_dict_in_a_hook_warns(tmp_path):
    said = run_on_ranks(save_overwritten, 1, str(tmp_path), timeout=300)[0]
    assert any("changed checkpoint['state_dict']" in m for m in said), said
    assert (tmp_path / "x.ckpt" / "manifest.json").is_file()
