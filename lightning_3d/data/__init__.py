"""Datasets: the standard-library byte corpus (default) and memory-mapped token files."""

from lightning_3d.data.corpus import (
    TokenWindows,
    prepare_byte_tokens,
    read_token_file,
    split_tokens,
    stdlib_bytes,
    write_token_file,
)

def __getattr__(name: str):  # noqa: ANN202 - TextDataModule imports Lightning; `lightning-3d prepare` needs only the corpus code
    if name == "TextDataModule":
        from lightning_3d.data.datamodule import TextDataModule

        return TextDataModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "TextDataModule",
    "TokenWindows",
    "prepare_byte_tokens",
    "read_token_file",
    "split_tokens",
    "stdlib_bytes",
    "write_token_file",
]
