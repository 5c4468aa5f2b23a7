"""Fine-tune a Hugging Face causal LM checkpoint: the LightningModule recipes and the CLI use for
``model.init_from=PATH``.

The model is built by :func:`lightning_3d.from_pretrained` in :meth:`configure_model` (parameters on
the meta device); the strategy lays it out and each rank reads only its own slices of the weights.
The step is Hugging Face's own loss (``labels=input_ids``: the model shifts them), so the numbers are
the ones ``transformers`` reports for the same batch.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import lightning as L
import torch
from torch import Tensor, nn

from lightning_3d.checkpoint.pretrained import from_pretrained
from lightning_3d.models.gpt import adamw_with_warmup_cosine, check_optimizer_settings


class HFCausalLMModule(L.LightningModule):
    """A Hugging Face causal LM (any family transformers ships plans for) trained from ``init_from``.

    Args:
        init_from: a Hugging Face model directory (``config.json`` + safetensors weights).
        lr: peak learning rate reached after ``warmup_steps``.
        min_lr_ratio: the cosine schedule decays to ``lr * min_lr_ratio``.
        weight_decay: AdamW decay for matrices and embeddings (not for biases and norms).
        betas: AdamW betas.
        warmup_steps: linear warmup length in optimizer steps.
        decay_steps: length of the cosine decay; ``None`` uses the Trainer's total steps.
        dtype: the dtype the model is built in before the precision plugin converts it.
        config_overrides: keyword arguments for ``AutoConfig.from_pretrained`` (e.g. dropout rates).
    """

    def __init__(
        self,
        init_from: str,
        lr: float = 3e-5,
        min_lr_ratio: float = 0.1,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 0,
        decay_steps: Optional[int] = None,
        dtype: Optional[str] = None,
        config_overrides: Optional[dict[str, Any]] = None,
    ) -> None:
        super().__init__()
        check_optimizer_settings(lr, min_lr_ratio, weight_decay, betas, warmup_steps, decay_steps)
        self.save_hyperparameters(
            {
                "init_from": str(init_from),
                "lr": lr,
                "min_lr_ratio": min_lr_ratio,
                "weight_decay": weight_decay,
                "betas": tuple(betas),
                "warmup_steps": warmup_steps,
                "decay_steps": decay_steps,
                "dtype": dtype,
                "config_overrides": dict(config_overrides or {}),
            }
        )
        self.model: Optional[nn.Module] = None

    def configure_model(self) -> None:
        """Idempotent: Lightning calls it on every fit/validate/test."""
        if self.model is None:
            hp = self.hparams
            self.model = from_pretrained(hp.init_from, dtype=hp.dtype, **hp.config_overrides)

    def forward(self, input_ids: Tensor, labels: Optional[Tensor] = None) -> Any:
        assert self.model is not None, "configure_model() has not run"
        return self.model(input_ids=input_ids, labels=labels)

    def _loss(self, batch: Union[Tensor, tuple[Tensor, ...]]) -> Tensor:
        input_ids = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(input_ids, labels=input_ids).loss

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def test_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("test_loss", loss, sync_dist=True)
        return loss

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        """Greedy next-token prediction for every position."""
        input_ids = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(input_ids).logits.argmax(dim=-1)

    def configure_optimizers(self) -> Any:
        return adamw_with_warmup_cosine(self, self.hparams)
