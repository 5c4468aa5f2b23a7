"""Datasets: the standard-library byte corpus (default) and memory-mapped token files."""

from lightning_3d.data.corpus import (
    TokenWindows,
    prepare_byte_tokens,
    read_token_file,
    split_tokens,
    stdlib_bytes,
    write_token_file,
)
from lightning_3d.data.datamodule import TextDataModule

__all__ = [
    "TextDataModule",
    "TokenWindows",
    "prepare_byte_tokens",
    "read_token_file",
    "split_tokens",
    "stdlib_bytes",
    "write_token_file",
]
