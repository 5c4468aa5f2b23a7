"""The LightningDataModule the recipes and the CLI use."""

from __future__ import annotations

from typing import Optional

import lightning as L
import numpy as np
from torch.utils.data import DataLoader

from lightning_3d.callbacks import data_parallel_size
from lightning_3d.data.corpus import DEFAULT_MAX_BYTES, TokenWindows, read_token_file, split_tokens, stdlib_bytes


class TextDataModule(L.LightningDataModule):
    """Windows of a token stream: the standard-library byte corpus or a prepared token file.

    Args:
        source: ``"stdlib"`` (default) or the path of a ``.bin`` token file.
        block_size: tokens per sample (the model's context length).
        batch_size: samples per data-parallel replica and step. Ignored when ``global_batch_size``
            is set.
        global_batch_size: samples per step over all replicas; the per-replica batch is derived
            from the data-parallel size, so the same recipe gives the same optimization at any layout.
        val_fraction: tail of the stream held out for validation.
        max_bytes: how much of the standard library to read (``source="stdlib"`` only).
        num_workers: DataLoader workers.
    """

    def __init__(
        self,
        source: str = "stdlib",
        block_size: int = 128,
        batch_size: int = 8,
        global_batch_size: Optional[int] = None,
        val_fraction: float = 0.05,
        max_bytes: int = DEFAULT_MAX_BYTES,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.source = source
        self.block_size = block_size
        self.batch_size = batch_size
        self.global_batch_size = global_batch_size
        self.val_fraction = val_fraction
        self.max_bytes = max_bytes
        self.num_workers = num_workers
        self.vocab_size = 256
        self._train: Optional[TokenWindows] = None
        self._val: Optional[TokenWindows] = None

    def _load(self) -> np.ndarray:
        if self.source == "stdlib":
            return stdlib_bytes(self.max_bytes)
        tokens, meta = read_token_file(self.source)
        self.vocab_size = int(meta["vocab_size"])
        return tokens

    def setup(self, stage: str) -> None:
        if self._train is None:
            train, val = split_tokens(self._load(), self.val_fraction)
            self._train = TokenWindows(train, self.block_size)
            self._val = TokenWindows(val, self.block_size)

    def per_replica_batch_size(self) -> int:
        if self.global_batch_size is None:
            return self.batch_size
        replicas = data_parallel_size(self.trainer) if self.trainer is not None else 1
        if self.global_batch_size % replicas:
            raise ValueError(
                f"global_batch_size={self.global_batch_size} is not divisible by the data-parallel size "
                f"{replicas}; pick a multiple of {replicas}."
            )
        return self.global_batch_size // replicas

    def _loader(self, dataset: Optional[TokenWindows], shuffle: bool) -> DataLoader:
        assert dataset is not None, "setup() has not run"
        return DataLoader(
            dataset,
            batch_size=self.per_replica_batch_size(),
            shuffle=shuffle,
            drop_last=shuffle,
            num_workers=self.num_workers,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self._train, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self._val, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self._val, shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self._val, shuffle=False)
