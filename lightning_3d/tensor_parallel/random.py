"""Dropout randomness for tensor-parallel regions.

Inside a tensor-parallel region each rank holds different heads or features, so its dropout
masks must differ from its tp peers'; in replicated regions masks must be identical (the
default generator, seeded alike on every rank, already is). :class:`RNGStatesTracker` keeps a
separate generator state per name and swaps it into the default generator of the device inside
:meth:`~RNGStatesTracker.fork`, so unmodified modules (``nn.Dropout``, SDPA's dropout) draw from
it. :meth:`~RNGStatesTracker.checkpoint_context` makes activation recompute replay the same masks.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable, Optional

import torch
from torch import Tensor

TENSOR_PARALLEL_RNG = "tensor-parallel"
_SEED_OFFSET = 2718


def _get_state(device_type: str) -> Tensor:
    return torch.cuda.get_rng_state() if device_type == "cuda" else torch.get_rng_state()


def _set_state(device_type: str, state: Tensor) -> None:
    if device_type == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def tensor_parallel_seed(base_seed: int, tp_rank: int) -> int:
    """Distinct per tp rank, shared by data-parallel replicas (as in Megatron)."""
    return base_seed + _SEED_OFFSET + tp_rank


class RNGStatesTracker:
    """Named generator states swapped into the default generator of ``device_type``."""

    def __init__(self, device_type: str = "cpu") -> None:
        self.device_type = device_type
        self._states: dict[str, Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        if name in self._states:
            raise ValueError(f"RNG state {name!r} already exists.")
        generator = torch.Generator(device=self.device_type).manual_seed(seed)
        self._states[name] = generator.get_state()

    def get_states(self) -> dict[str, Tensor]:
        return {k: v.clone() for k, v in self._states.items()}

    def set_states(self, states: dict[str, Tensor]) -> None:
        self._states = {k: v.clone() for k, v in states.items()}

    @contextmanager
    def fork(self, name: str = TENSOR_PARALLEL_RNG) -> Iterator[None]:
        """Run the body with generator state ``name``; the default state is untouched by it."""
        if name not in self._states:
            raise KeyError(f"RNG state {name!r} was not added to the tracker.")
        original = _get_state(self.device_type)
        _set_state(self.device_type, self._states[name])
        try:
            yield
        finally:
            self._states[name] = _get_state(self.device_type)
            _set_state(self.device_type, original)

    def checkpoint_context(self) -> tuple[Any, Any]:
        """``context_fn`` for ``torch.utils.checkpoint``: recompute sees the tracker as forward did.

        torch restores the default generator for recompute itself; this restores ours.
        """
        saved: dict[str, Tensor] = {}

        @contextmanager
        def forward_context() -> Iterator[None]:
            saved.update(self.get_states())
            yield

        @contextmanager
        def recompute_context() -> Iterator[None]:
            current = self.get_states()
            self.set_states(saved)
            try:
                yield
            finally:
                self.set_states(current)

        return forward_context(), recompute_context()

    def checkpoint(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``torch.utils.checkpoint`` (non-reentrant) that replays tensor-parallel dropout exactly."""
        return torch.utils.checkpoint.checkpoint(
            function, *args, use_reentrant=False, context_fn=self.checkpoint_context, **kwargs
        )


def run_forward_in_rng_region(module: torch.nn.Module, tracker: RNGStatesTracker, name: str = TENSOR_PARALLEL_RNG) -> None:
    """Make ``module``'s forward draw its randomness from ``tracker``'s state ``name``."""
    original = module.forward

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with tracker.fork(name):
            return original(*args, **kwargs)

    module.forward = forward  # type: ignore[method-assign]


def seed_tracker(tracker: RNGStatesTracker, tp_rank: int, base_seed: Optional[int] = None) -> None:
    tracker.add(TENSOR_PARALLEL_RNG, tensor_parallel_seed(torch.initial_seed() if base_seed is None else base_seed, tp_rank))
