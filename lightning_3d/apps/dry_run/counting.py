"""What a dry run counts: bytes of meta tensors (once per storage) and tensors saved for backward
(:mod:`lightning_3d.core.saved_tensors`: meta tensors have no data pointer, so storages are told apart by
their ``StorageImpl``), and bytes handed to ``torch.distributed`` per process group.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import Tensor

from lightning_3d.core.saved_tensors import _local
from lightning_3d.planner.traffic import ring


# -- communication --------------------------------------------------------------------------------------------
# Bytes per call: what this rank sends over the wire under NCCL's ring algorithms
# (lightning_3d.planner.traffic.ring) for the tensor it hands over -- the buffer of an all-reduce or
# broadcast, the input of a reduce-scatter or all-to-all, the output of an all-gather -- and for
# point-to-point the tensor sent (receives are counted apart).
def _nbytes(t: Tensor) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def _arg(args: tuple, kwargs: dict, i: int, name: str) -> Any:
    return args[i] if len(args) > i else kwargs.get(name)


def _group(args: tuple, kwargs: dict, i: int) -> Any:
    return _arg(args, kwargs, i, "group")


_SIZES: dict[str, Callable[[tuple, dict], tuple[int, Any]]] = {
    "all_reduce": lambda a, k: (_nbytes(_arg(a, k, 0, "tensor")), _group(a, k, 2)),
    "broadcast": lambda a, k: (_nbytes(_arg(a, k, 0, "tensor")), _group(a, k, 2)),
    "reduce": lambda a, k: (_nbytes(_arg(a, k, 0, "tensor")), _group(a, k, 3)),
    "all_gather_into_tensor": lambda a, k: (_nbytes(_arg(a, k, 0, "output_tensor")), _group(a, k, 2)),
    "_all_gather_base": lambda a, k: (_nbytes(_arg(a, k, 0, "output_tensor")), _group(a, k, 2)),
    "all_gather": lambda a, k: (sum(_nbytes(t) for t in _arg(a, k, 0, "tensor_list")), _group(a, k, 2)),
    "all_gather_single": lambda a, k: (_nbytes(_arg(a, k, 0, "output_tensor")), _group(a, k, 2)),
    "reduce_scatter_single": lambda a, k: (_nbytes(_arg(a, k, 1, "input")), _group(a, k, 3)),
    "reduce_scatter_tensor": lambda a, k: (_nbytes(_arg(a, k, 1, "input")), _group(a, k, 3)),
    "_reduce_scatter_base": lambda a, k: (_nbytes(_arg(a, k, 1, "input")), _group(a, k, 3)),
    "reduce_scatter": lambda a, k: (sum(_nbytes(t) for t in _arg(a, k, 1, "input_list")), _group(a, k, 3)),
    "all_to_all_single": lambda a, k: (_nbytes(_arg(a, k, 1, "input")), _group(a, k, 4)),
    "all_to_all": lambda a, k: (sum(_nbytes(t) for t in _arg(a, k, 1, "input_tensor_list")), _group(a, k, 2)),
}
_KIND = {
    name: ("all_reduce" if name == "all_reduce" else "broadcast" if name in ("broadcast", "reduce")
           else "reduce_scatter" if "reduce_scatter" in name else "all_to_all" if "all_to_all" in name else "all_gather")
    for name in _SIZES
}
_P2P = {"isend": True, "send": True, "irecv": False, "recv": False}


@dataclass
class Traffic:
    """Bytes and calls per (process group, operation) seen while counting."""

    calls: dict[tuple[Any, str], int] = field(default_factory=lambda: defaultdict(int))
    nbytes: dict[tuple[Any, str], int] = field(default_factory=lambda: defaultdict(int))

    def add(self, group: Any, op: str, nbytes: int) -> None:
        group = group if group is not None else c10d._get_default_group()
        self.calls[(group, op)] += 1
        self.nbytes[(group, op)] += nbytes

    def scaled(self, factor: float) -> "Traffic":
        out = Traffic()
        for key, n in self.nbytes.items():
            out.nbytes[key] = int(n * factor)
            out.calls[key] = int(self.calls[key] * factor)
        return out

    def __iadd__(self, other: "Traffic") -> "Traffic":
        for key, n in other.nbytes.items():
            self.nbytes[key] += n
            self.calls[key] += other.calls[key]
        return self


class _Counter:
    traffic: Optional[Traffic] = None
    depth = 0  # inside a counted call (batch_isend_irecv runs isend/irecv itself): not again


_counter = _Counter()


def _counting(name: str, original: Callable) -> Callable:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _counter.traffic is not None and _counter.depth == 0:
            if name in _SIZES:
                nbytes, group = _SIZES[name](args, kwargs)
                size = dist.get_world_size(group if group is not None else c10d._get_default_group())
                _counter.traffic.add(group, name, int(ring(_KIND[name], nbytes, size)))
            elif name in _P2P:
                tensor = _arg(args, kwargs, 0, "tensor")
                _counter.traffic.add(_arg(args, kwargs, 2, "group"), "send" if _P2P[name] else "recv", _nbytes(tensor))
            elif name == "batch_isend_irecv":
                for op in _arg(args, kwargs, 0, "p2p_op_list"):
                    sent = op.op in (c10d.isend, _ORIGINAL.get("isend"))
                    _counter.traffic.add(op.group, "send" if sent else "recv", _nbytes(op.tensor))
        _counter.depth += 1
        try:
            return original(*args, **kwargs)
        finally:
            _counter.depth -= 1

    wrapper.__name__ = wrapper.__qualname__ = name
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    return wrapper


_ORIGINAL: dict[str, Callable] = {}


@contextmanager
def counting_collectives() -> Iterator[None]:
    """Wrap ``torch.distributed``'s collectives and P2P calls (in ``torch.distributed`` and
    ``distributed_c10d``, where ``P2POp`` checks its ``op`` by identity) for the code inside;
    :func:`count` then records what they are handed."""
    names = [*_SIZES, *_P2P, "batch_isend_irecv"]
    saved: dict[str, tuple[Any, Any]] = {}
    for name in names:
        if not hasattr(c10d, name):
            continue
        current = getattr(c10d, name)
        saved[name] = (current, getattr(dist, name, None))
        _ORIGINAL[name] = current
        wrapped = _counting(name, current)
        setattr(c10d, name, wrapped)
        if hasattr(dist, name):
            setattr(dist, name, wrapped)
    try:
        yield
    finally:
        for name, (in_c10d, in_dist) in saved.items():
            setattr(c10d, name, in_c10d)
            if in_dist is not None:
                setattr(dist, name, in_dist)
        _ORIGINAL.clear()


@contextmanager
def count(traffic: Traffic) -> Iterator[Traffic]:
    """Record into ``traffic`` the calls made inside (needs :func:`counting_collectives` around)."""
    previous, _counter.traffic = _counter.traffic, traffic
    try:
        yield traffic
    finally:
        _counter.traffic = previous
