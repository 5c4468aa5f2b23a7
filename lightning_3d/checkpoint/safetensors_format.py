"""The safetensors file format, read and written without holding a whole file in memory.

A ``.safetensors`` file is an 8-byte little-endian header length, a JSON header
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`` and then the
raw little-endian bytes of every tensor, row-major, at ``data_start + begin``. Knowing this lets a
rank read only the byte ranges of its own slices (:mod:`lightning_3d.checkpoint.safetensors_read`)
and an export write tensor after tensor (:mod:`lightning_3d.checkpoint.safetensors_write`); the
``safetensors`` package would map or build whole files.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Union

import torch

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
HEADER_LIMIT = 100 * 2**20  # the format's own limit on the JSON header

DTYPE_OF_CODE: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
CODE_OF_DTYPE: dict[torch.dtype, str] = {dtype: code for code, dtype in DTYPE_OF_CODE.items()}


def read_header(path: Union[str, Path]) -> tuple[dict[str, Any], int]:
    """(the JSON header without ``__metadata__``, byte offset where tensor data starts)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length).")
        (size,) = struct.unpack("<Q", head)
        if size > HEADER_LIMIT:
            raise ValueError(f"{path}: safetensors header of {size} bytes is larger than the format allows; the file is damaged.")
        raw = f.read(size)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ValueError(f"{path}: its safetensors header is cut or damaged ({len(raw)} of {size} bytes readable); download the file again.") from None
    header.pop("__metadata__", None)
    end = 0
    for name, entry in header.items():
        if entry["dtype"] not in DTYPE_OF_CODE:
            raise ValueError(f"{path}: tensor {name!r} has dtype {entry['dtype']}, which lightning_3d cannot read.")
        end = max(end, int(entry["data_offsets"][1]))
    actual = Path(path).stat().st_size
    if actual < 8 + size + end:  # a cut download: every rank learns it here, not as "Cannot copy out of meta tensor"
        raise ValueError(
            f"{path} is cut short: its header describes {8 + size + end} bytes, the file has {actual}; download it again."
        )
    return header, 8 + size


def weight_files(directory: Union[str, Path]) -> dict[str, Path]:
    """tensor name -> the file holding it, for a Hugging Face model directory: one
    ``model.safetensors``, or shards listed in ``model.safetensors.index.json``."""
    root = Path(directory)
    index = root / INDEX_NAME
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: root / file for name, file in weight_map.items()}
    single = root / SINGLE_NAME
    if single.exists():
        header, _ = read_header(single)
        return {name: single for name in header}
    raise FileNotFoundError(
        f"{root} holds neither {SINGLE_NAME} nor {INDEX_NAME}: lightning_3d reads Hugging Face checkpoints in the "
        f"safetensors format (save them with save_pretrained(..., safe_serialization=True))."
    )
