"""A user's own LightningModule and LightningDataModule, for ``lightning-3d fit --model ... --data ...``
(LightningCLI subclass mode; tests/test_launchers.py::test_lightning_cli_fit_trains_the_users_classes).

The module holds the reference GPT (a registered model family, so ``tensor_parallel=2`` finds its plan)
but has its own ``__init__`` arguments, steps and optimizer, as a user's would; each rank writes a
marker file naming the classes that ran.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_3d.models.gpt import GPT, GPTConfig


class RandomTokens(Dataset):
    def __init__(self, length: int, block_size: int, vocab_size: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, vocab_size, (length, block_size + 1), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tokens[i, :-1], self.tokens[i, 1:]


class MyTokenData(L.LightningDataModule):
    def __init__(self, block_size: int = 16, vocab_size: int = 64, batch_size: int = 2) -> None:
        super().__init__()
        self.block_size, self.vocab_size, self.batch_size = block_size, vocab_size, batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomTokens(32, self.block_size, self.vocab_size), batch_size=self.batch_size)


class MyLanguageModel(L.LightningModule):
    def __init__(self, hidden: int = 32, layers: int = 2, vocab_size: int = 64, block_size: int = 16,
                 marker_dir: Optional[str] = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.config = GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=layers, n_head=4, n_embd=hidden)
        self.net: Optional[GPT] = None
        self.steps = 0

    def configure_model(self) -> None:
        if self.net is None:
            self.net = GPT(self.config)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        input_ids, targets = batch
        loss = self.net(input_ids, targets)
        self.steps += 1
        self.log("my_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def on_train_end(self) -> None:
        if self.hparams.marker_dir:
            rank = int(os.environ.get("LOCAL_RANK", self.global_rank))
            Path(self.hparams.marker_dir, f"rank{rank}.txt").write_text(
                f"{type(self).__name__} {type(self.trainer.datamodule).__name__} steps={self.steps} "
                f"fc_rows={self.net.blocks[0].mlp.fc.weight.shape[0]}\n"  # ffn rows this rank holds
            )


class MyLanguageModelWithData(MyLanguageModel):
    """The same module with its own loader: ``lightning-3d fit --model ...`` without ``--data`` uses it."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomTokens(32, self.config.block_size, self.config.vocab_size), batch_size=2)
