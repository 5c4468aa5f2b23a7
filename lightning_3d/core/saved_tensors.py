"""Bytes of storages and of the tensors autograd saves for backward, counted once per storage.

One definition for the activation-memory callback (``lightning_3d.monitoring.callbacks.MemoryProbe``) and the
dry run (``lightning_3d.apps.dry_run``): storages are keyed by their C++ object, which, unlike the data
pointer, also tells meta-device storages apart.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Optional

import torch
from torch import Tensor


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def storage_key(t: Tensor) -> Optional[int]:
    """One key per storage, on the meta device as on a real one (``None``: no storage)."""
    try:
        storage = _local(t).untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return storage._cdata if storage.nbytes() else None


def storage_bytes(tensors: Iterable[Optional[Tensor]], seen: Optional[set[int]] = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (each counted once, also across calls
    sharing ``seen``)."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if t is None:
            continue
        key = storage_key(t)
        if key is None or key in seen:
            continue
        seen.add(key)
        total += _local(t).untyped_storage().nbytes()
    return total


class SavedBytes:
    """Tensors autograd keeps for backward, counted once per storage, weights excluded: a
    ``saved_tensors_hooks`` pair (``with torch.autograd.graph.saved_tensors_hooks(t.pack, t.unpack)``).

    ``current`` is what is alive now (a saved tensor stops counting when autograd frees it, after
    its backward), ``peak`` the most at any time."""

    def __init__(self, exclude: Iterable[Tensor]) -> None:
        self._exclude = {k for k in (storage_key(t) for t in exclude) if k is not None}
        self._live: dict[int, list[int]] = {}
        self.current = 0
        self.peak = 0

    def pack(self, tensor: Tensor) -> Any:
        key = storage_key(tensor)
        if key is None or key in self._exclude:
            return tensor
        entry = self._live.get(key)
        if entry is None:
            nbytes = _local(tensor).untyped_storage().nbytes()
            self._live[key] = [1, nbytes]
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        else:
            entry[0] += 1
        return _Held(tensor, key, self)

    @staticmethod
    def unpack(held: Any) -> Tensor:
        return held.tensor if isinstance(held, _Held) else held

    def release(self, key: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self._live[key]

    def holds(self, t: Tensor) -> bool:
        return storage_key(t) in self._live

    @contextmanager
    def hooks(self) -> Iterator["SavedBytes"]:
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield self


class _Held:
    __slots__ = ("tensor", "key", "tracker")

    def __init__(self, tensor: Tensor, key: int, tracker: SavedBytes) -> None:
        self.tensor, self.key, self.tracker = tensor, key, tracker

    def __del__(self) -> None:
        self.tracker.release(self.key)
