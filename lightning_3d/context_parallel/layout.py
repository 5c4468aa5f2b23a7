"""Load-balanced causal chunking of the sequence dimension for context parallelism.

With a causal mask, token t attends to t + 1 keys: splitting the sequence into ``cp`` contiguous
pieces would leave the last rank with almost all the work. Instead the sequence is cut into
``2 * cp`` equal chunks and cp rank ``i`` holds chunks ``i`` and ``2 * cp - 1 - i`` (in that
order), one early and one late chunk, so every rank does the same amount of attention.

Everything that needs the true position of a local token (RoPE, learned position embeddings,
the loss's targets) asks :func:`local_positions`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Union

import torch
from torch import Tensor

Device = Union[torch.device, str, None]


def check_divisible(seq_len: int, cp: int) -> None:
    """Raise a ValueError naming the values and the fix unless ``seq_len`` splits into ``2 * cp`` chunks."""
    if cp < 1:
        raise ValueError(f"context-parallel size cp={cp} must be >= 1.")
    if seq_len % (2 * cp):
        up = -(-seq_len // (2 * cp)) * 2 * cp
        raise ValueError(
            f"sequence length {seq_len} is not divisible by 2 * cp = {2 * cp} (cp={cp}): load-balanced causal "
            f"chunking cuts the sequence into 2 * cp equal chunks. Pad or crop the sequence to a multiple of "
            f"{2 * cp} (e.g. {up}), or choose a context-parallel size that divides {seq_len} // 2."
        )


def _check_rank(cp_rank: int, cp: int) -> None:
    if not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank={cp_rank} is outside the context-parallel group of size cp={cp}.")


def chunks_of(cp_rank: int, cp: int) -> tuple[int, int]:
    """The two chunk indices (early, late) that cp rank ``cp_rank`` holds."""
    _check_rank(cp_rank, cp)
    return cp_rank, 2 * cp - 1 - cp_rank


def shard_sequence(x: Tensor, dim: int, cp_rank: int, cp: int) -> Tensor:
    """The local part of ``x`` along ``dim``: chunks ``cp_rank`` and ``2*cp-1-cp_rank``, concatenated."""
    check_divisible(x.shape[dim], cp)
    early, late = chunks_of(cp_rank, cp)
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[early], chunks[late]], dim=dim)


def unshard_sequence(parts: Sequence[Tensor], dim: int, cp: int) -> Tensor:
    """The full sequence from the ``cp`` local parts (in cp-rank order): the inverse of :func:`shard_sequence`."""
    if len(parts) != cp:
        raise ValueError(f"unshard_sequence got {len(parts)} parts for cp={cp}; pass one local part per cp rank.")
    halves = [p.chunk(2, dim=dim) for p in parts]
    ordered = [halves[c][0] if c < cp else halves[2 * cp - 1 - c][1] for c in range(2 * cp)]
    return torch.cat(ordered, dim=dim)


def local_positions(seq_len: int, cp_rank: int, cp: int, device: Device) -> Tensor:
    """The true positions (LongTensor of length ``seq_len // cp``) of this cp rank's local tokens."""
    check_divisible(seq_len, cp)
    chunk = seq_len // (2 * cp)
    early, late = chunks_of(cp_rank, cp)
    return torch.cat(
        [
            torch.arange(early * chunk, (early + 1) * chunk, dtype=torch.long, device=device),
            torch.arange(late * chunk, (late + 1) * chunk, dtype=torch.long, device=device),
        ]
    )


def chunk_order(cp: int) -> list[tuple[int, int]]:
    """For each chunk of the natural order, (the cp rank holding it, which half of its local part)."""
    return [(c, 0) if c < cp else (2 * cp - 1 - c, 1) for c in range(2 * cp)]


__all__ = ["check_divisible", "chunk_order", "chunks_of", "local_positions", "shard_sequence", "unshard_sequence"]
