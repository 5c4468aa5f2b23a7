"""What a mixture-of-experts layer does in a dry run: it routes as if the routing were balanced.

Dropless routing sizes its row exchange from the data (which experts each token picks), and the
tensor-parallel share and the capacity factor select rows by value. On the meta device there is no
data, so the dry run stands in the routing the balance loss aims at: each of the ``T`` tokens' ``k``
rows goes to an expert, every expert gets ``T k / E`` of them (a capacity factor caps that at its
capacity per sequence), each rank of an expert group sends ``1 / ep`` of its rows to each peer and
receives as many, and each tp rank takes ``1 / tp`` of them. Shapes, saved tensors and collective
bytes are then those of a balanced step, which is what the planner models at
``expert_imbalance=1``. Nothing in training changes: the three functions are swapped only inside
:func:`balanced_routing`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor


def _rows_index(n: int, like: Tensor) -> Tensor:
    """An index of ``n`` rows (its values are never read on meta)."""
    return torch.empty(n, dtype=torch.long, device=like.device)


def _balanced_rows(routing: Any, n_experts: int, keep: Optional[int] = None, sequences: int = 1) -> tuple[Tensor, Tensor, Tensor]:
    """``moe.layer.sorted_rows`` under balanced routing: every token's ``k`` rows, or each expert's
    capacity per sequence where that is fewer."""
    tokens, k = routing.experts.shape
    rows = tokens * k
    if keep is not None:
        rows = min(rows, sequences * n_experts * keep)
    index = _rows_index(rows, routing.experts)
    return index, routing.weights.reshape(-1)[index], torch.empty(n_experts, dtype=torch.long, device=index.device)


def _balanced_share(token_of_row: Tensor, weight_of_row: Tensor, counts: Tensor, local: int, tp: Any) -> tuple[Tensor, Tensor, Tensor]:
    """``moe.layer.tensor_parallel_share`` under balanced routing: ``1 / tp`` of the rows, of ``E / tp`` experts."""
    size = dist.get_world_size(tp)
    index = _rows_index(token_of_row.numel() // size, token_of_row)
    return token_of_row[index], weight_of_row[index], counts[: counts.numel() // size]


def _balanced_sizes(rows: Tensor, send: Tensor, receive: Tensor) -> tuple[list[int], list[int]]:
    """``moe.expert_parallel.split_sizes`` under balanced routing: ``1 / ep`` of the rows to and from each peer."""
    ep, n = send.numel(), rows.shape[0]
    sizes = [n // ep + (1 if i < n % ep else 0) for i in range(ep)]
    return sizes, list(sizes)


@contextmanager
def balanced_routing() -> Iterator[None]:
    """Inside: MoE layers route as if balanced (see the module's docstring)."""
    from lightning_3d.moe import expert_parallel, layer

    saved = (layer.sorted_rows, layer.tensor_parallel_share, expert_parallel.split_sizes)
    layer.sorted_rows, layer.tensor_parallel_share, expert_parallel.split_sizes = _balanced_rows, _balanced_share, _balanced_sizes
    try:
        yield
    finally:
        layer.sorted_rows, layer.tensor_parallel_share, expert_parallel.split_sizes = saved
