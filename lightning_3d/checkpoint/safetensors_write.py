"""Write safetensors files tensor by tensor, split into Hugging Face-style shards.

An export must not hold the model in memory: the header of each file is written first, from the
names, dtypes and shapes known in advance, then every tensor's bytes one at a time, so at most one
tensor (as produced by the caller) is alive. Files are named as ``save_pretrained`` names them
(``model-00001-of-00003.safetensors`` plus ``model.safetensors.index.json``, or one
``model.safetensors``), and a whole export is staged in a sibling directory that replaces the
target only once complete (:func:`staged_directory`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import struct
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import Tensor

from lightning_3d.checkpoint.atomic import replace_directory
from lightning_3d.checkpoint.safetensors_format import CODE_OF_DTYPE, HEADER_LIMIT, INDEX_NAME, SINGLE_NAME

DEFAULT_MAX_SHARD_SIZE = "5GB"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


@dataclass(frozen=True)
class TensorInfo:
    """What a header needs about a tensor before its data exists."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


def parse_size(size: Union[int, str]) -> int:
    """Bytes from an int or a string like ``"5GB"`` / ``"500MB"`` / ``"2GiB"`` (decimal units as in
    ``save_pretrained``; ``...iB`` binary)."""
    if isinstance(size, bool):
        raise ValueError(f"max_shard_size={size!r} is not a size.")
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(size))
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"max_shard_size={size!r} is not a size: give bytes (an int) or e.g. '5GB', '500MB', '2GiB'.")
        value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"max_shard_size={size!r} must be positive.")
    return value


def plan_shards(infos: Sequence[TensorInfo], max_bytes: int) -> list[list[TensorInfo]]:
    """Consecutive groups of at most ``max_bytes`` each (a tensor larger than that gets a file alone)."""
    shards: list[list[TensorInfo]] = []
    size = 0
    for info in infos:
        if not shards or (size + info.nbytes > max_bytes and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(info)
        size += info.nbytes
    return shards or [[]]


def _header_bytes(infos: Sequence[TensorInfo], metadata: Optional[dict[str, str]]) -> bytes:
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for info in infos:
        if info.dtype not in CODE_OF_DTYPE:
            raise ValueError(f"tensor {info.name!r}: dtype {info.dtype} cannot be stored in safetensors.")
        if info.name in header:
            raise ValueError(f"tensor {info.name!r} appears twice in one safetensors file.")
        header[info.name] = {"dtype": CODE_OF_DTYPE[info.dtype], "shape": list(info.shape), "data_offsets": [offset, offset + info.nbytes]}
        offset += info.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as the reference writer does
    if len(raw) > HEADER_LIMIT:
        raise ValueError(f"safetensors header of {len(raw)} bytes is over the format's limit; use a smaller max_shard_size.")
    return struct.pack("<Q", len(raw)) + raw


def _raw_bytes(tensor: Tensor) -> Any:
    """A buffer over the tensor's bytes (no copy when it is contiguous on the host)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy() if flat.numel() else b""


def write_file(
    path: Path, infos: Sequence[TensorInfo], produce: Callable[[TensorInfo], Tensor], metadata: Optional[dict[str, str]] = None
) -> int:
    """One safetensors file: the header, then each tensor as ``produce`` returns it (checked against
    its declared dtype and shape, since the header is already written). Returns the bytes written."""
    if sys.byteorder != "little":  # pragma: no cover - the format is little-endian
        raise RuntimeError("writing safetensors needs a little-endian host.")
    with open(path, "wb") as f:
        f.write(_header_bytes(infos, metadata))
        for info in infos:
            tensor = produce(info)
            if tensor.dtype != info.dtype or tuple(tensor.shape) != tuple(info.shape):
                raise ValueError(
                    f"tensor {info.name!r} came out as {tensor.dtype} {list(tensor.shape)}, but its header says "
                    f"{info.dtype} {list(info.shape)}."
                )
            f.write(_raw_bytes(tensor))
            del tensor
        f.flush()
        os.fsync(f.fileno())
        return f.tell()


def shard_name(index: int, count: int) -> str:
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def write_sharded(
    directory: Path,
    infos: Sequence[TensorInfo],
    produce: Callable[[TensorInfo], Tensor],
    max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE,
    metadata: Optional[dict[str, str]] = None,
) -> dict[str, Any]:
    """Weights of a Hugging Face directory: ``model.safetensors`` when one file holds them, else
    numbered shards of at most ``max_shard_size`` and ``model.safetensors.index.json``."""
    shards = plan_shards(infos, parse_size(max_shard_size))
    metadata = {"format": "pt", **(metadata or {})}  # transformers refuses files without format=pt
    names = [SINGLE_NAME] if len(shards) == 1 else [shard_name(i + 1, len(shards)) for i in range(len(shards))]
    weight_map: dict[str, str] = {}
    for name, group in zip(names, shards):
        write_file(directory / name, group, produce, metadata)
        weight_map.update({info.name: name for info in group})
    total = sum(info.nbytes for info in infos)
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return {"files": names, "total_size": total, "weight_map": weight_map}


# -- staging a whole output directory ------------------------------------------------------------------
_EXPORT_MARKERS = ("config.json", SINGLE_NAME, INDEX_NAME)


SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def written_by_export(name: str, also: tuple[str, ...] = ()) -> bool:
    """Whether a file of this name is one an export writes (so replacing it loses nothing of the user's)."""
    return name in (*_EXPORT_MARKERS, *also) or SHARD_NAME.fullmatch(name) is not None


@contextlib.contextmanager
def staged_directory(out_dir: Union[str, Path], also_written: tuple[str, ...] = ()) -> Iterator[Path]:
    """Yield a temporary sibling of ``out_dir`` to fill; on success it replaces ``out_dir`` (two
    renames), on error it is removed. Only a directory that holds nothing but what an export writes
    (config, weights, index; ``also_written``: e.g. tokenizer files) is replaced: anything else in it
    -- a ``.git``, a README, notes -- would be deleted with it, so that is refused by name."""
    final = Path(out_dir).absolute()
    if final.exists():
        if not final.is_dir():
            raise FileExistsError(f"{final} exists and is not a directory; choose another output directory.")
        foreign = sorted(p.name for p in final.iterdir() if not written_by_export(p.name, also_written))
        if foreign:
            shown = ", ".join(foreign[:6]) + (f" and {len(foreign) - 6} more" if len(foreign) > 6 else "")
            raise FileExistsError(
                f"{final} holds files an export does not write ({shown}); replacing the directory would delete "
                f"them. Export into a new directory, or move them out first."
            )
    final.parent.mkdir(parents=True, exist_ok=True)
    stamp = f"{os.getpid()}-{time.time_ns()}"
    tmp = final.with_name(f".{final.name}.tmp-{stamp}")
    tmp.mkdir()
    try:
        yield tmp
        replace_directory(tmp, final, final.with_name(f".{final.name}.replaced-{stamp}"))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
