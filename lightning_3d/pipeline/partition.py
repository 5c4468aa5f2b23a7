"""Cut a layer sequence into pipeline pieces.

Methods: ``"uniform"`` (equal layer counts, the remainder spread over the first pieces),
``"parameters"`` (contiguous pieces with balanced parameter counts, the embedding counted on the
first piece and the head on the last), or an explicit list of the block indices where pieces
2..n start. Uneven splits are allowed; :func:`describe` reports them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Union

Method = Union[str, Sequence[int]]


def partition(num_blocks: int, pieces: int, method: Method = "uniform", weights: Sequence[float] = ()) -> list[tuple[int, int]]:
    """``pieces`` contiguous ``(start, end)`` block ranges covering ``range(num_blocks)``.

    ``weights`` (for ``"parameters"``) has ``num_blocks + 2`` entries: embedding, blocks..., head.
    """
    if pieces < 1:
        raise ValueError(f"pieces={pieces} must be positive.")
    if num_blocks < pieces:
        raise ValueError(
            f"pipeline_parallel x virtual_stages = {pieces} pieces need at least {pieces} layers, but the model "
            f"has {num_blocks}; lower pipeline_parallel or virtual_stages."
        )
    if isinstance(method, str):
        if method == "uniform":
            base, extra = divmod(num_blocks, pieces)
            sizes = [base + (1 if i < extra else 0) for i in range(pieces)]
            return _ranges(sizes)
        if method == "parameters":
            if len(weights) != num_blocks + 2:
                raise ValueError(f"'parameters' partitioning needs {num_blocks + 2} weights (embedding, blocks, head).")
            return _balanced(list(weights), pieces)
        raise ValueError(f"pipeline partition method={method!r}: use 'uniform', 'parameters' or a list of split points.")
    starts = [0, *method]
    valid = len(starts) == pieces and all(b > a for a, b in zip(starts, starts[1:])) and starts[-1] < num_blocks
    if not valid:
        raise ValueError(
            f"split points {list(method)} must be {pieces - 1} increasing block indices in 1..{num_blocks - 1}."
        )
    return [(s, e) for s, e in zip(starts, [*starts[1:], num_blocks])]


def _ranges(sizes: list[int]) -> list[tuple[int, int]]:
    out, start = [], 0
    for size in sizes:
        out.append((start, start + size))
        start += size
    return out


def _balanced(weights: list[float], pieces: int) -> list[tuple[int, int]]:
    """Minimize the heaviest piece (binary search over the bound, greedy fill), at least one block each."""
    blocks = weights[1:-1]
    embed, head = weights[0], weights[-1]
    n = len(blocks)

    def cut(bound: float) -> list[int] | None:
        sizes, current, count = [], embed, 0
        for i, w in enumerate(blocks):
            remaining_pieces = pieces - len(sizes) - 1
            must_cut = n - i == remaining_pieces  # leave one block for every later piece
            if count and (current + w > bound or must_cut):
                sizes.append(count)
                current, count = 0.0, 0
            current += w
            count += 1
        sizes.append(count)
        if len(sizes) != pieces or current + head > bound:
            return None
        return sizes

    lo, hi = max(weights), sum(weights)
    best = cut(hi) or [1] * (pieces - 1) + [n - pieces + 1]
    for _ in range(60):
        mid = (lo + hi) / 2
        sizes = cut(mid)
        if sizes is None:
            lo = mid
        else:
            best, hi = sizes, mid
    return _ranges(best)


def describe(ranges: list[tuple[int, int]], p: int) -> str:
    """One line per rank: which blocks each chunk holds (uneven splits are visible here)."""
    lines = []
    for rank in range(p):
        chunks = [f"blocks {ranges[k][0]}-{ranges[k][1] - 1}" for k in range(rank, len(ranges), p)]
        lines.append(f"pipeline rank {rank}: " + "; ".join(chunks))
    return "\n".join(lines)
