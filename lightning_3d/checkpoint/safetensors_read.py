"""Read a slice of one tensor of a ``.safetensors`` file, without mapping or loading the whole tensor.

A rank that holds a tensor-parallel slice, a pipeline stage or a ZeRO-3 row chunk of a weight needs
only some rows (and, inside each row, some columns) of the dense tensor in the file. Rows of a
row-major tensor are contiguous byte ranges, so runs of consecutive rows are read with
``seek``/``readinto`` in chunks of a few MiB, the other dimensions are selected from each chunk,
and the result is written into a preallocated output. Peak memory is the output plus one chunk
(and the chunk's selection). Files are read, never memory-mapped: mapped pages would count in the
process's resident memory, which is what a per-rank memory budget measures.

An index of ``-1`` selects a padding row/column (a vocabulary padded to a multiple of the
tensor-parallel degree): it comes out as zero.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO, Optional, Union

import torch
from torch import Tensor

from lightning_3d.checkpoint.safetensors_format import DTYPE_OF_CODE, read_header

CHUNK_BYTES = 4 * 2**20  # bytes read per request: bounds the transient memory of a slice read

Index = Optional[Tensor]  # per dimension: None (all of it) or a 1-D LongTensor (-1 = zero padding)


def _runs(rows: Tensor) -> list[tuple[int, int, int]]:
    """(output position, first file row, count) for maximal runs of consecutive file rows; a stretch
    of padding rows (-1) is one run with first row -1."""
    if rows.numel() == 0:
        return []
    valid = rows >= 0
    both_valid = valid[1:] & valid[:-1]
    both_padding = ~valid[1:] & ~valid[:-1]
    joined = (both_valid & (rows[1:] - rows[:-1] == 1)) | both_padding
    starts = [0, *(torch.nonzero(~joined).flatten() + 1).tolist(), rows.numel()]
    return [(a, int(rows[a]) if bool(valid[a]) else -1, b - a) for a, b in zip(starts, starts[1:])]


def _check_index(name: str, dim: int, index: Tensor, size: int) -> Tensor:
    if index.dim() != 1 or index.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name}: the index of dimension {dim} must be a 1-D integer tensor, got {index.dtype} of shape {tuple(index.shape)}.")
    index = index.to(device="cpu", dtype=torch.int64)
    if index.numel() and (int(index.min()) < -1 or int(index.max()) >= size):
        raise ValueError(
            f"{name}: the index of dimension {dim} selects {int(index.min())}..{int(index.max())}, outside [0, {size}) "
            f"(-1 means a zero padding entry)."
        )
    return index


def _select(chunk: Tensor, index: Sequence[Index]) -> Tensor:
    """Pick entries of dimensions 1.. from a chunk of rows; padding entries (-1) become zero."""
    for dim in range(1, chunk.dim()):
        idx = index[dim] if dim < len(index) else None
        if idx is None:
            continue
        pad = idx < 0
        chunk = chunk.index_select(dim, idx.clamp(min=0))
        if bool(pad.any()):
            shape = [1] * chunk.dim()
            shape[dim] = -1
            chunk = chunk.masked_fill(pad.view(shape), 0)
    return chunk


class SafetensorsFile:
    """One open ``.safetensors`` file whose header is parsed once, for many slice reads.

    ``bytes_read`` counts the tensor bytes read so far (what a memory or I/O budget is about).
    """

    def __init__(self, path: Union[str, Path], chunk_bytes: int = CHUNK_BYTES) -> None:
        if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
            raise RuntimeError("safetensors data is little-endian; this host is not.")
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes={chunk_bytes} must be positive.")
        self.path = Path(path)
        self.header, self.data_start = read_header(self.path)
        self.chunk_bytes = chunk_bytes
        self.bytes_read = 0
        self._file: Optional[BinaryIO] = open(self.path, "rb")
        self._buffer = bytearray()

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._buffer = bytearray()

    def keys(self) -> list[str]:
        return list(self.header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entry(name)["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return DTYPE_OF_CODE[self._entry(name)["dtype"]]

    def _entry(self, name: str) -> dict[str, Any]:
        entry = self.header.get(name)
        if entry is None:
            raise KeyError(f"{self.path} holds no tensor {name!r}.")
        return entry

    def read(
        self,
        name: str,
        index: Sequence[Index] = (),
        *,
        dtype: Optional[torch.dtype] = None,
        out: Optional[Tensor] = None,
    ) -> Tensor:
        """The tensor ``name`` restricted to ``index`` (per dimension: None = all, or 1-D indices with
        -1 = a zero entry), converted to ``dtype`` (default: the file's; ``out``'s when given).

        ``out`` (any strides, any device) receives the result in place; its shape must be the
        selection's shape.
        """
        if self._file is None:
            raise ValueError(f"{self.path} is closed.")
        entry = self._entry(name)
        file_dtype = DTYPE_OF_CODE[entry["dtype"]]
        shape = tuple(entry["shape"])
        if len(index) > max(1, len(shape)) or (len(index) and not shape):
            raise ValueError(f"{self.path}: {name!r} has shape {list(shape)}; got indices for {len(index)} dimensions.")
        index = [None if idx is None else _check_index(name, d, idx, shape[d]) for d, idx in enumerate(index)]
        index += [None] * (len(shape) - len(index))
        out_shape = tuple(size if idx is None else idx.numel() for size, idx in zip(shape, index))
        if out is None:
            out = torch.empty(out_shape, dtype=dtype or file_dtype)
        elif tuple(out.shape) != out_shape:
            raise ValueError(f"{self.path}: {name!r} selected as shape {list(out_shape)}, but the output has shape {list(out.shape)}.")
        begin, end = entry["data_offsets"]
        itemsize = torch.empty((), dtype=file_dtype).element_size()
        expected = itemsize
        for size in shape:
            expected *= size
        if end - begin != expected:
            raise ValueError(f"{self.path}: {name!r} has {end - begin} bytes for shape {list(shape)} of {entry['dtype']}; the file is damaged.")
        if not shape:  # a scalar
            out.copy_(self._read_rows(begin, 1, itemsize, file_dtype, ()).reshape(()))
            return out
        row_shape = shape[1:]
        row_bytes = expected // shape[0] if shape[0] else 0
        rows = index[0] if index[0] is not None else torch.arange(shape[0])
        per_chunk = max(1, self.chunk_bytes // max(1, row_bytes))
        for pos, first, count in _runs(rows):
            if first < 0:
                out.narrow(0, pos, count).zero_()
                continue
            for done in range(0, count, per_chunk):
                n = min(per_chunk, count - done)
                chunk = self._read_rows(begin + (first + done) * row_bytes, n, row_bytes, file_dtype, row_shape)
                out.narrow(0, pos + done, n).copy_(_select(chunk, index))
        return out

    def _read_rows(self, offset: int, rows: int, row_bytes: int, dtype: torch.dtype, row_shape: tuple[int, ...]) -> Tensor:
        """``rows`` rows starting at byte ``offset`` of the data section, viewed as ``dtype`` (a view of a
        reused buffer: valid until the next read)."""
        assert self._file is not None
        size = rows * row_bytes
        if size == 0:
            return torch.empty((rows, *row_shape), dtype=dtype)
        if len(self._buffer) < size:
            self._buffer = bytearray(size)
        view = memoryview(self._buffer)[:size]
        self._file.seek(self.data_start + offset)
        got = 0
        while got < size:
            n = self._file.readinto(view[got:])
            if not n:
                raise ValueError(f"{self.path}: the file ends before its tensor data does (truncated file).")
            got += n
        self.bytes_read += size
        raw = torch.frombuffer(self._buffer, dtype=torch.uint8, count=size)
        return raw.view(dtype).view(rows, *row_shape)


def read_slice(
    path: Union[str, Path],
    name: str,
    index: Sequence[Index] = (),
    *,
    dtype: Optional[torch.dtype] = None,
    out: Optional[Tensor] = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> Tensor:
    """One slice read (see :meth:`SafetensorsFile.read`); open a :class:`SafetensorsFile` for many."""
    with SafetensorsFile(path, chunk_bytes) as f:
        return f.read(name, index, dtype=dtype, out=out)
