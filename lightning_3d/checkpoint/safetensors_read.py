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
        self._file: Optional[BinaryIO] = open(self.path, "rb", buffering=0)  # reads go straight into our buffer
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
            out.copy_(self._read_into_buffer([(begin, itemsize)], itemsize).view(file_dtype).reshape(()))
            return out
        row_bytes = expected // shape[0] if shape[0] else 0
        rows = index[0] if index[0] is not None else torch.arange(shape[0])
        columns = _column_runs(shape, index, itemsize)
        if columns is None:  # whole rows, other dimensions selected from each chunk
            kept_shape, kept_bytes, rest = shape[1:], row_bytes, index
        else:  # only the selected column ranges of each row (a row-parallel slice of a matrix)
            kept_shape = (index[1].numel(), *shape[2:])
            kept_bytes = row_bytes // shape[1] * index[1].numel()
            rest = [None, None, *index[2:]]
        per_chunk = max(1, self.chunk_bytes // max(1, kept_bytes))
        for pos, first, count in _runs(rows):
            if first < 0:
                out.narrow(0, pos, count).zero_()
                continue
            for done in range(0, count, per_chunk):
                n = min(per_chunk, count - done)
                row0 = begin + (first + done) * row_bytes
                if columns is None:
                    ranges = [(row0, n * row_bytes)]
                else:
                    col_bytes = row_bytes // shape[1]
                    ranges = [
                        (row0 + r * row_bytes + c0 * col_bytes if c0 >= 0 else -1, k * col_bytes)
                        for r in range(n)
                        for _, c0, k in columns
                    ]
                chunk = self._read_into_buffer(ranges, n * kept_bytes).view(file_dtype).view(n, *kept_shape)
                out.narrow(0, pos + done, n).copy_(_select(chunk, rest))
        return out

    def _read_into_buffer(self, ranges: list[tuple[int, int]], size: int) -> Tensor:
        """The byte ranges ``(offset in the data section, length)`` read back to back into a reused
        buffer (offset -1: zeros, a padding column); a uint8 view valid until the next read."""
        assert self._file is not None
        if size == 0:
            return torch.empty(0, dtype=torch.uint8)
        if len(self._buffer) < size:
            self._buffer = bytearray(size)
        view = memoryview(self._buffer)
        at = 0
        for offset, length in ranges:
            if offset < 0:
                view[at : at + length] = bytes(length)
                at += length
                continue
            self._file.seek(self.data_start + offset)
            end = at + length
            while at < end:
                n = self._file.readinto(view[at:end])
                if not n:
                    raise ValueError(f"{self.path}: the file ends before its tensor data does (truncated file).")
                at += n
            self.bytes_read += length
        return torch.frombuffer(self._buffer, dtype=torch.uint8, count=size)


def _column_runs(shape: tuple[int, ...], index: Sequence[Index], itemsize: int) -> Optional[list[tuple[int, int, int]]]:
    """Runs of dimension 1 to read as byte ranges of each row, when that reads at most half of every
    row in pieces of at least 512 bytes; ``None``: read whole rows."""
    if len(shape) < 2 or index[1] is None or not shape[1]:
        return None
    runs = _runs(index[1])
    inner = itemsize
    for size in shape[2:]:
        inner *= size
    selected = sum(k for _, first, k in runs if first >= 0)
    smallest = min((k * inner for _, first, k in runs if first >= 0), default=0)
    if selected * 2 > shape[1] or smallest < 512:
        return None
    return runs


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
