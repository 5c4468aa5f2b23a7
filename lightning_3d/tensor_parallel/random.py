"""Dropout randomness for tensor-parallel regions.

Inside a tensor-parallel region each rank holds different heads or features, so its dropout
masks must differ from its tp peers'; in replicated regions masks must be identical (the
default generator, seeded alike on every rank, already is). :class:`RNGStatesTracker` keeps a
separate generator state per name and swaps it into the default generator of the device inside
:meth:`~RNGStatesTracker.fork`, so unmodified modules (``nn.Dropout``, SDPA's dropout) draw from
it. :meth:`~RNGStatesTracker.checkpoint_context` makes activation recompute replay the same masks.

Pipeline stages run different layers, so they must not replay one another's random stream
either: every stage seeds its own states (Megatron offsets seeds by pipeline rank), and the
pipeline runtime runs each stage's forward inside :data:`PIPELINE_STAGE_RNG`. The default
generator outside the model (data loading, samplers) is left alone, so every pipeline rank still
loads the same batch.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from lightning_3d.core.eager import communicates
from lightning_3d.core.forward_wrappers import wrap_forward

TENSOR_PARALLEL_RNG = "tensor-parallel"
PIPELINE_STAGE_RNG = "pipeline-stage"
_SEED_OFFSET = 2718
_PIPELINE_SEED_OFFSET = 100  # per pipeline rank, as in Megatron


def _get_state(device_type: str) -> Tensor:
    return torch.cuda.get_rng_state() if device_type == "cuda" else torch.get_rng_state()


def _set_state(device_type: str, state: Tensor) -> None:
    if device_type == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def tensor_parallel_seed(base_seed: int, tp_rank: int, pp_rank: int = 0) -> int:
    """Distinct per tp rank and pipeline stage, shared by data-parallel replicas (as in Megatron)."""
    return base_seed + _SEED_OFFSET + tp_rank + _PIPELINE_SEED_OFFSET * pp_rank


def pipeline_stage_seed(base_seed: int, pp_rank: int) -> int:
    """The replicated-region stream of one pipeline stage (shared by its tp and dp peers)."""
    return base_seed + _PIPELINE_SEED_OFFSET * (pp_rank + 1)


class RNGStatesTracker:
    """Named generator states swapped into the default generator of ``device_type``."""

    def __init__(self, device_type: str = "cpu") -> None:
        self.device_type = device_type
        self._states: dict[str, Tensor] = {}
        self._outer: list[Tensor] = []  # default-generator states displaced by the open forks

    def add(self, name: str, seed: int) -> None:
        if name in self._states:
            raise ValueError(f"RNG state {name!r} already exists.")
        generator = torch.Generator(device=self.device_type).manual_seed(seed)
        self._states[name] = generator.get_state()

    def get_states(self) -> dict[str, Tensor]:
        return {k: v.clone() for k, v in self._states.items()}

    def set_states(self, states: dict[str, Tensor]) -> None:
        """Replace the named states given (others, e.g. added by a newer version, are kept)."""
        self._states.update({k: v.clone() for k, v in states.items()})

    def has(self, name: str) -> bool:
        return name in self._states

    @contextmanager
    def fork(self, name: str = TENSOR_PARALLEL_RNG) -> Iterator[None]:
        """Run the body with generator state ``name``; the default state is untouched by it."""
        if name not in self._states:
            raise KeyError(f"RNG state {name!r} was not added to the tracker.")
        self._outer.append(_get_state(self.device_type))
        _set_state(self.device_type, self._states[name])
        try:
            yield
        finally:
            self._states[name] = _get_state(self.device_type)
            _set_state(self.device_type, self._outer.pop())

    @contextmanager
    def outside(self) -> Iterator[None]:
        """Inside a fork, run the body with the state the fork displaced: a replicated part of a
        module whose forward is a tensor-parallel region (HF GPT-2's residual dropout)."""
        if not self._outer:
            yield
            return
        inner = _get_state(self.device_type)
        _set_state(self.device_type, self._outer[-1])
        try:
            yield
        finally:
            self._outer[-1] = _get_state(self.device_type)
            _set_state(self.device_type, inner)

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

        return forward_context(), Reenterable(recompute_context)

    def checkpoint(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``torch.utils.checkpoint`` (non-reentrant) that replays tensor-parallel dropout exactly."""
        return torch.utils.checkpoint.checkpoint(
            function, *args, use_reentrant=False, context_fn=self.checkpoint_context, **kwargs
        )


class Reenterable:
    """A context manager made afresh at each ``with``: a recompute may run more than once for one
    forward (each backward through a retained graph unpacks the saved tensors again), and a
    ``@contextmanager`` object can be entered only once."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make = make
        self._active: list[Any] = []

    def __enter__(self) -> Any:
        context = self._make()
        self._active.append(context)
        return context.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        return self._active.pop().__exit__(*exc)


def _wrap_forward(module: torch.nn.Module, kind: str, context: Callable[[], Any]) -> None:
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        @communicates  # (switching RNG states is host-side state a compiled graph would not replay)
        def forward(*args: Any, **kwargs: Any) -> Any:
            with context():
                return original(*args, **kwargs)

        return forward

    wrap_forward(module, kind, make)


def run_forward_in_rng_region(module: torch.nn.Module, tracker: RNGStatesTracker, name: str = TENSOR_PARALLEL_RNG) -> None:
    """Make ``module``'s forward draw its randomness from ``tracker``'s state ``name``."""
    _wrap_forward(module, f"rng_region:{name}", lambda: tracker.fork(name))


def run_forward_outside_rng_region(module: torch.nn.Module, tracker: RNGStatesTracker) -> None:
    """Make ``module``'s forward draw from the replicated stream even inside a tensor-parallel region."""
    _wrap_forward(module, "rng_outside", tracker.outside)


def seed_tracker(tracker: RNGStatesTracker, tp_rank: int, pp_rank: int = 0, base_seed: Optional[int] = None) -> None:
    base = torch.initial_seed() if base_seed is None else base_seed
    tracker.add(TENSOR_PARALLEL_RNG, tensor_parallel_seed(base, tp_rank, pp_rank))
    tracker.add(PIPELINE_STAGE_RNG, pipeline_stage_seed(base, pp_rank))


def seeded_tracker(device_type: str, tp_rank: int, pp_rank: int, base_seed: int) -> RNGStatesTracker:
    """A tracker for one rank, seeded from ``base_seed`` (the strategy's agreed seed; the dry run's recipe seed)."""
    tracker = RNGStatesTracker(device_type)
    seed_tracker(tracker, tp_rank, pp_rank, base_seed)
    return tracker


def agree_on_random_state(topology: Any, device: torch.device) -> int:
    """Give every rank of a model replica (its tp, cp and pp peers) the generator state and seed of the
    replica's first rank, and return that seed. Peers must load the same batch (a sampler drawing
    from the default generator; context-parallel peers each keep chunks of the same sequences) and
    draw replicated dropout alike, even when the user seeded each rank differently or not at all;
    data-parallel replicas keep their own."""
    import torch.distributed as dist

    # an unseeded process has a random 64-bit unsigned seed: fold it into int64 to send it
    seed = torch.tensor([torch.initial_seed() % (2**63 - 1)], dtype=torch.int64, device=device)
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    peers = (
        (topology.tp_group, topology.tp_source_rank()),
        (topology.cp_group, topology.cp_source_rank()),
        (topology.pp_group, topology.first_stage_rank()),
    )
    for group, src in peers:
        if dist.get_world_size(group) == 1:
            continue
        dist.broadcast(seed, src, group)
        for i, state in enumerate(states):
            moved = state.to(device)  # NCCL takes device tensors only
            dist.broadcast(moved, src, group)
            states[i] = moved.cpu()
    torch.set_rng_state(states[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(states[1], device)
    return int(seed.item())
