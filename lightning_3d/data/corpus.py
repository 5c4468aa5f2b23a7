"""Token streams: the Python standard library as bytes, and memory-mapped token files.

The default corpus is real text that every machine with Python has: the ``.py`` files of the
standard library, read as bytes (vocabulary 256) in sorted path order, so every rank and every
run sees the same stream without downloading anything.

Token files are raw little-endian ``uint16`` or ``uint32`` arrays (``NAME.bin``) with a small
JSON sidecar (``NAME.bin.json``: dtype, vocab size, token count, tokenizer), memory-mapped so
that corpora larger than RAM work and ranks share the page cache.
"""

from __future__ import annotations

import functools
import json
import os
import sysconfig
from collections.abc import Iterable
from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch
from torch.utils.data import Dataset

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
DEFAULT_MAX_BYTES = 8 * 2**20


def stdlib_source_files() -> list[Path]:
    """The standard library's ``.py`` files in a deterministic order (installed packages excluded)."""
    return list(_source_files_under(sysconfig.get_paths()["stdlib"]))


@functools.lru_cache(maxsize=None)
def _source_files_under(stdlib: str) -> tuple[Path, ...]:
    # The skipped directories are pruned, not walked (site-packages alone can hold ~10x the stdlib's
    # files: a second per data module before), and symbolic links to directories are not followed
    # (as Path.rglob). Cached: every data module of a process reads the same list.
    root = Path(stdlib)
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        files += [Path(folder, name) for name in names if name.endswith(".py")]
    return tuple(sorted(files, key=lambda p: p.relative_to(root).as_posix()))


def stdlib_bytes(max_bytes: int = DEFAULT_MAX_BYTES) -> np.ndarray:
    """The first ``max_bytes`` bytes of the concatenated standard-library sources, as ``uint8``."""
    chunks, total = [], 0
    for path in stdlib_source_files():
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    stream = b"".join(chunks)[:max_bytes]
    if len(stream) < 2:
        raise RuntimeError("No standard-library sources found to build the default byte corpus.")
    return np.frombuffer(stream, dtype=np.uint8)


class TokenWindows(Dataset):
    """Non-overlapping windows of ``block_size + 1`` tokens as ``(input_ids, targets)`` pairs.

    With ``vocab_size`` set (the data module sets the model's), every window is checked as it is
    read: an id ``>= vocab_size`` or ``< 0`` raises, naming the id, its position and both sizes. The
    check is a max (and, for signed dtypes, a min) over the window on the host, in the loader's
    workers: nothing on the device, no sync.
    """

    def __init__(self, tokens: np.ndarray, block_size: int, vocab_size: Optional[int] = None, name: str = "the token stream") -> None:
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be positive.")
        if len(tokens) < block_size + 1:
            raise ValueError(f"{len(tokens)} tokens are too few for one window of block_size={block_size} + 1.")
        self.tokens = tokens
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.name = name

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.block_size
        raw = np.asarray(self.tokens[start : start + self.block_size + 1])
        if self.vocab_size is not None:
            self._check_ids(raw, start)
        window = torch.from_numpy(raw.astype(np.int64))
        return window[:-1], window[1:]

    def _check_ids(self, raw: np.ndarray, start: int) -> None:
        high = int(raw.max())
        low = int(raw.min()) if np.issubdtype(raw.dtype, np.signedinteger) else 0
        if high < self.vocab_size and low >= 0:  # type: ignore[operator]
            return
        bad = high if high >= self.vocab_size else low  # type: ignore[operator]
        at = start + int(np.argmax(raw == bad))
        raise ValueError(
            f"token id {bad} at position {at} of {self.name} is outside the model's vocabulary [0, {self.vocab_size}). "
            f"The data was tokenized for a different (larger) vocabulary, or the file is corrupt or its .bin.json "
            f"is wrong: re-tokenize it with the model's tokenizer, or use a model with a large enough vocab_size."
        )


def split_tokens(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Train on the head of the stream, validate on its tail (no overlap)."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} must be between 0 and 1.")
    cut = int(len(tokens) * (1.0 - val_fraction))
    return tokens[:cut], tokens[cut:]


# -- memory-mapped token files --------------------------------------------------------------
def _meta_path(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def read_token_file(path: Union[str, Path]) -> tuple[np.ndarray, dict]:
    """Memory-map a token file written by :func:`write_token_file`; returns (tokens, metadata)."""
    path = Path(path)
    meta_file = _meta_path(path)
    if path.is_file() and not meta_file.is_file():  # (text given where tokens are expected: do not suggest overwriting it)
        beside = path.with_suffix(".bin") if path.suffix != ".bin" else path.with_name(f"{path.stem}.tokens.bin")
        raise FileNotFoundError(
            f"{path} is not a token file (it has no {meta_file.name}); to train on its text, write a token file "
            f"beside it: `lightning-3d prepare {beside} {path}`, and pass that."
        )
    if not path.is_file() or not meta_file.is_file():
        raise FileNotFoundError(
            f"token file {path} (and its {meta_file.name}) not found; create one with "
            f"`lightning-3d prepare {path} <text files or directories>`."
        )
    meta = _read_meta(meta_file)
    itemsize = np.dtype(meta["dtype"]).itemsize
    size = path.stat().st_size
    if size % itemsize or size // itemsize != meta["num_tokens"]:  # (a memmap of a cut file would read garbage or fail)
        raise ValueError(
            f"{path} holds {size // itemsize} tokens ({size} bytes of {meta['dtype']}) but {meta_file.name} says "
            f"{meta['num_tokens']}: the file was cut or edited. Write it again with `lightning-3d prepare`."
        )
    tokens = np.memmap(path, dtype=np.dtype(meta["dtype"]), mode="r") if size else np.zeros(0, dtype=meta["dtype"])
    return tokens, meta


def _read_meta(meta_file: Path) -> dict:
    """A token file's metadata, checked: our words for a file that is not JSON or misses a field."""
    try:
        meta = json.loads(meta_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{meta_file} is not valid JSON ({err}); write the token file again with `lightning-3d prepare`.") from None
    missing = [k for k in ("dtype", "vocab_size", "num_tokens") if not isinstance(meta, dict) or k not in meta]
    if missing:
        raise ValueError(f"{meta_file} lacks {missing}; write the token file again with `lightning-3d prepare`.")
    if meta["dtype"] not in ("uint8", "uint16", "uint32", "int32", "int64") or not isinstance(meta["num_tokens"], int):
        raise ValueError(
            f"{meta_file} says dtype={meta['dtype']!r}, num_tokens={meta['num_tokens']!r}: token files hold unsigned "
            f"integer ids (uint16 / uint32) and a whole count; write it again with `lightning-3d prepare`."
        )
    return meta


def write_token_file(tokens: np.ndarray, path: Union[str, Path], vocab_size: int, tokenizer: str) -> dict:
    """Write ``tokens`` with the smallest of uint16/uint32 that holds ``vocab_size``."""
    path = Path(path)
    tokens = np.asarray(tokens)
    if len(tokens) and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise ValueError(
            f"token ids range over [{int(tokens.min())}, {int(tokens.max())}], outside vocab_size={vocab_size}: "
            f"pass the tokenizer's vocabulary size (larger than every id)."
        )
    dtype = np.uint16 if vocab_size <= 2**16 else np.uint32
    path.parent.mkdir(parents=True, exist_ok=True)
    np.asarray(tokens, dtype=dtype).tofile(path)
    meta = {"dtype": np.dtype(dtype).name, "vocab_size": vocab_size, "num_tokens": int(len(tokens)), "tokenizer": tokenizer}
    _meta_path(path).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def _text_files(inputs: Iterable[Union[str, Path]], suffixes: tuple[str, ...]) -> list[Path]:
    files: list[Path] = []
    for item in map(Path, inputs):
        if item.is_dir():
            files.extend(sorted(p for p in item.rglob("*") if p.is_file() and p.suffix in suffixes))
        elif item.is_file():
            files.append(item)
        else:
            raise FileNotFoundError(f"input {item} does not exist.")
    if not files:
        raise ValueError(f"no input files found (directories are searched for {', '.join(suffixes)}).")
    return files


def prepare_byte_tokens(
    inputs: Iterable[Union[str, Path]],
    out: Union[str, Path],
    suffixes: tuple[str, ...] = (".txt", ".md", ".py", ".rst"),
) -> dict:
    """Tokenize text files as bytes (vocab 256) into one token file; returns its metadata. The output
    replaces only a token file this function wrote: never an input, never another file."""
    files = _text_files(inputs, suffixes)
    target = Path(out).absolute()
    if any(f.absolute() == target for f in files):
        raise ValueError(f"the output {out} is also an input: writing it would overwrite the text; choose another output, e.g. {target.with_suffix('.bin')}.")
    if target.exists() and not (target.is_file() and _meta_path(target).is_file()):
        raise FileExistsError(
            f"{out} exists and is not a token file written by `lightning-3d prepare` (no {_meta_path(target).name} beside it); "
            f"choose another output, or remove it first."
        )
    data = b"".join(path.read_bytes() for path in files)
    return write_token_file(np.frombuffer(data, dtype=np.uint8), out, vocab_size=256, tokenizer="bytes")
