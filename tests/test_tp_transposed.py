"""Hugging Face GPT-2's ``Conv1D`` stores ``[in, out]``; its tensor-parallel replacement computes with
``[out, in]`` slices. Checkpoints must hold the dense tensor in the ``Conv1D`` layout at every
tensor-parallel degree (``TPSpec.transposed``), so tp2 <-> tp1 resharding, consolidation and loading
into a plain ``GPT2LMHeadModel`` all see the same tensors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_3d import ThreeDParallelStrategy
from lightning_3d.checkpoint.consolidate import consolidate
from lightning_3d.tensor_parallel.spec import TPSpec, assemble_dense, shard_tensor, spec_record
from lightning_3d.testing.harness import run_on_ranks
from tests.helpers import LossRecorder, quiet_trainer, tiny_data
from tests.test_tensor_parallel_training import HFCausalLM

pytest.importorskip("transformers")
PROBE = torch.arange(24).view(2, 12)


class GPT2Module(HFCausalLM):
    def __init__(self) -> None:
        super().__init__("gpt2")

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch[0], labels=batch[0]).loss
        self.log("val_loss", loss, sync_dist=True)
        return loss


def _probe_logits(module: GPT2Module) -> list:
    module.model.eval()
    with torch.no_grad():
        return module.model(input_ids=PROBE).logits.tolist()  # gathered over tp by the plan


def fit(tmp: str, tp: int, steps: int, resume: str | None = None, fmt: str = "sharded") -> dict[str, Any]:
    """Train HF GPT-2 (ZeRO-1: fp32 masters and Adam state in the checkpoint), saving every 2 steps."""
    L.seed_everything(0)
    recorder = LossRecorder()
    trainer = quiet_trainer(
        max_steps=steps, limit_val_batches=0, enable_checkpointing=True,
        callbacks=[recorder, ModelCheckpoint(dirpath=tmp, every_n_train_steps=2, save_top_k=-1, filename="{step}")],
        strategy=ThreeDParallelStrategy(tensor_parallel=tp, zero_stage=1, checkpoint_format=fmt),
    )
    module = GPT2Module()
    trainer.fit(module, tiny_data(global_batch_size=8), ckpt_path=resume)
    return {"losses": recorder.losses, "logits": _probe_logits(module)}


def validate(path: str, tp: int) -> dict[str, Any]:
    L.seed_everything(0)
    trainer = quiet_trainer(limit_val_batches=2, strategy=ThreeDParallelStrategy(tensor_parallel=tp))
    module = GPT2Module()
    loss = trainer.validate(module, tiny_data(global_batch_size=8), ckpt_path=path, verbose=False)[0]["val_loss"]
    return {"loss": float(loss), "logits": _probe_logits(module)}


def _plain_gpt2(weights: str) -> Any:
    """A plain one-process GPT2LMHeadModel holding the consolidated weights (strict: shapes must match)."""
    module = GPT2Module()
    module.configure_model()
    state = torch.load(weights, weights_only=True)
    module.model.load_state_dict({k[len("model.") :]: v for k, v in state.items()})
    return module.model.eval()


def test_spec_contract_and_record() -> None:
    """``local == shard_tensor(dense.t(), ...)``; the record carries the dense shape and the flag."""
    dense = torch.randn(6, 8)  # Conv1D [in=6, out=8]
    locals_ = {r: shard_tensor(dense.t(), 0, 2, r) for r in range(2)}
    spec = TPSpec(dim=0, world=2, rank=1, full_shape=(6, 8), transposed=True)
    assert spec.layout_shape == (8, 6)
    record = spec_record(spec, (4, 6))
    assert record["full_shape"] == [6, 8] and record["transposed"] is True
    assert torch.equal(assemble_dense(locals_, record), dense)
    assert "transposed" not in spec_record(TPSpec(dim=0, world=2, rank=0, full_shape=(8, 6)), (4, 6))


def test_tp2_checkpoint_loads_at_tp1_and_into_plain_gpt2(tmp_path: Path) -> None:
    tp2 = run_on_ranks(fit, 2, str(tmp_path / "tp2"), 2, 4, timeout=300)[0]
    # resharding tp2 -> tp1 with optimizer state: the resumed steps equal the uninterrupted tp2 run
    tp1 = run_on_ranks(fit, 1, str(tmp_path / "tp1"), 1, 4, resume=str(tmp_path / "tp2" / "step=2.ckpt"),
                       fmt="consolidated", timeout=300)[0]
    np.testing.assert_allclose(tp1["losses"], tp2["losses"][2:], rtol=1e-5)
    # consolidated tp2 weights load strictly into a plain GPT2LMHeadModel and give tp2's logits
    weights = consolidate(str(tmp_path / "tp2" / "step=4.ckpt"), str(tmp_path / "w.pt"), weights_only=True)["out"]
    with torch.no_grad():
        logits = _plain_gpt2(weights)(input_ids=PROBE).logits
    torch.testing.assert_close(logits, torch.tensor(tp2["logits"]), atol=1e-5, rtol=1e-5)
    # and the reverse: a tp1 consolidated checkpoint loads at tp2
    tp1_ckpt = str(tmp_path / "tp1" / "step=4.ckpt")
    at_tp2 = run_on_ranks(validate, 2, tp1_ckpt, 2, timeout=300)[0]
    at_tp1 = run_on_ranks(validate, 1, tp1_ckpt, 1, timeout=300)[0]
    assert at_tp2["loss"] == pytest.approx(at_tp1["loss"], rel=1e-5)
    torch.testing.assert_close(torch.tensor(at_tp2["logits"]), torch.tensor(at_tp1["logits"]), atol=1e-5, rtol=1e-5)
