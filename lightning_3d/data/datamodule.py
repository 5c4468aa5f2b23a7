"""The LightningDataModule the recipes and the CLI use."""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import numpy as np
from torch.utils.data import DataLoader

from lightning_3d.data.corpus import DEFAULT_MAX_BYTES, TokenWindows, read_token_file, split_tokens, stdlib_bytes
from lightning_3d.data.sampler import ResumableDataLoader, batches_done_this_epoch
from lightning_3d.data.vocab import check_data_vocab, model_vocab_size
from lightning_3d.monitoring.callbacks import data_parallel_size


class TextDataModule(L.LightningDataModule):
    """Windows of a token stream: the standard-library byte corpus or a prepared token file.

    Args:
        source: ``"stdlib"`` (default) or the path of a ``.bin`` token file.
        block_size: tokens per sample; ``None`` takes the model's context length
            (``lightning_module.config.block_size``), so the CLI needs it only once.
        batch_size: samples per data-parallel replica and step. Ignored when ``global_batch_size``
            is set.
        global_batch_size: samples per step over all replicas; the per-replica batch is derived
            from the data-parallel size, so the same recipe gives the same optimization at any layout.
        val_fraction: tail of the stream held out for validation.
        max_bytes: how much of the standard library to read (``source="stdlib"`` only).
        num_workers: DataLoader workers.

    The data must fit the model's vocabulary: the file's ``vocab_size`` (256 for the byte corpus) is
    compared with the model's at set-up (found duck-typed: ``get_input_embeddings()``,
    ``config.vocab_size`` or ``vocab_size``), and every window's ids are checked on the host as they
    are read. Both raise ``ValueError`` naming the numbers.
    """

    def __init__(
        self,
        source: str = "stdlib",
        block_size: Optional[int] = None,
        batch_size: int = 8,
        global_batch_size: Optional[int] = None,
        val_fraction: float = 0.05,
        max_bytes: int = DEFAULT_MAX_BYTES,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        for name, value in (("batch_size", batch_size), ("global_batch_size", global_batch_size)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(
                    f"{name}={value!r} is invalid: it must be a positive whole number of samples"
                    + (" per step over all replicas" if name == "global_batch_size" else " per replica") + "."
                )
        self.source = source
        self.block_size = block_size
        self.batch_size = batch_size
        self.global_batch_size = global_batch_size
        self.val_fraction = val_fraction
        self.max_bytes = max_bytes
        self.num_workers = num_workers
        self.vocab_size = 256
        self._data_vocab: Optional[tuple[int, str]] = None  # (ids the data needs, where that comes from)
        self._train: Optional[TokenWindows] = None
        self._val: Optional[TokenWindows] = None

    def _load(self) -> np.ndarray:
        if self.source == "stdlib":
            tokens = stdlib_bytes(self.max_bytes)
            largest = int(tokens.max())  # in memory, a few MB: exact (valid UTF-8 has no byte 0xF5..0xFF)
            self._data_vocab = (largest + 1, f"holds bytes up to {largest} (needs vocab_size >= {largest + 1})")
            return tokens
        tokens, meta = read_token_file(self.source)
        self.vocab_size = int(meta["vocab_size"])
        self._data_vocab = (self.vocab_size, f"has vocab_size={self.vocab_size} (from its .bin.json)")
        return tokens

    def _context_length(self) -> int:
        if self.block_size is not None:
            return self.block_size
        config = getattr(self.trainer.lightning_module if self.trainer else None, "config", None)
        if config is None or not hasattr(config, "block_size"):
            raise ValueError("TextDataModule(block_size=None) needs a model with config.block_size; pass block_size.")
        return int(config.block_size)

    def setup(self, stage: str) -> None:
        if self._train is None:
            train, val = split_tokens(self._load(), self.val_fraction)
            block_size = self._context_length()
            self._train = TokenWindows(train, block_size, name=f"{self._source_name()} (training split)")
            self._val = TokenWindows(val, block_size, name=f"{self._source_name()} (validation split)")
        self._check_vocab()  # the model may not be built yet: checked again when the loaders are made

    def _source_name(self) -> str:
        return "the standard-library byte corpus" if self.source == "stdlib" else f"token file {self.source}"

    def _check_vocab(self) -> None:
        """The data's vocabulary must fit the model's; windows then check their ids against the model's."""
        module = self.trainer.lightning_module if self.trainer is not None else None
        found = model_vocab_size(module) if module is not None else None
        if found is None:
            return  # a model without a discoverable vocabulary: nothing to compare
        model_vocab, where = found
        if self._data_vocab is not None:
            needed, why = self._data_vocab
            check_data_vocab(needed, f"{self._source_name()} {why}", model_vocab, where)
        for dataset in (self._train, self._val):
            if dataset is not None:
                dataset.vocab_size = model_vocab

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

    def _loader(self, dataset: Optional[TokenWindows], train: bool) -> DataLoader:
        assert dataset is not None, "setup() has not run"
        self._check_vocab()  # after configure_model(): the model's embedding now exists
        kwargs: dict[str, Any] = dict(
            batch_size=self.per_replica_batch_size(), shuffle=train, drop_last=train, num_workers=self.num_workers
        )
        if train:
            return ResumableDataLoader(dataset, progress=lambda: batches_done_this_epoch(self.trainer), **kwargs)
        return DataLoader(dataset, **kwargs)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self._train, train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self._val, train=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self._val, train=False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self._val, train=False)
