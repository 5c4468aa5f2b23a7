"""Consolidated (dense) state dicts for tensor-parallel models and their optimizers.

Checkpoints hold the *dense* tensors, so they load at any tensor-parallel degree and into a
plain model without the strategy: saving gathers every sharded parameter (and its optimizer
state) over the tp group, loading re-splits it for the rank. Gathering costs memory
proportional to the full model on every rank; sharded checkpoints that never gather are the
checkpoint milestone's job.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_3d.tensor_parallel.spec import TPSpec, gather_full, get_spec, shard_like


def _sharded_spec(t: Any) -> Optional[TPSpec]:
    spec = get_spec(t) if isinstance(t, Tensor) else None
    return spec if spec is not None and spec.is_sharded else None


def full_state_dict(module: nn.Module) -> dict[str, Any]:
    """``module.state_dict()`` with every tensor-parallel shard gathered (collective over tp)."""
    out: dict[str, Any] = {}
    for key, value in module.state_dict(keep_vars=True).items():
        spec = _sharded_spec(value)
        tensor = value.detach() if isinstance(value, Tensor) else value
        out[key] = gather_full(tensor, spec) if spec is not None else tensor
    return out


def shard_state_dict(module: nn.Module, full: dict[str, Any]) -> dict[str, Any]:
    """Re-split a dense state dict for this rank's (possibly tensor-parallel) ``module``."""
    local = module.state_dict(keep_vars=True)
    out = dict(full)
    for key, value in full.items():
        spec = _sharded_spec(local.get(key))
        if spec is not None and isinstance(value, Tensor):
            out[key] = shard_like(value, spec)
    return out


def _flat_params(optimizer: Optimizer) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def full_optimizer_state(optimizer: Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with per-parameter state tensors gathered like their parameters."""
    state = optimizer.state_dict()
    # state_dict() shares the per-parameter dicts with the live optimizer: copy before replacing.
    state["state"] = {index: dict(entry) for index, entry in state["state"].items()}
    params = _flat_params(optimizer)
    for index in sorted(state["state"]):
        spec = _sharded_spec(params[index])
        if spec is None:
            continue
        entry = state["state"][index]
        for name, value in entry.items():
            if isinstance(value, Tensor) and value.shape == params[index].shape:
                entry[name] = gather_full(value, spec)
    return state


def load_sharded_optimizer_state(optimizer: Optimizer, full: dict[str, Any]) -> None:
    """Load a dense optimizer state, keeping this rank's slice of every sharded parameter's state."""
    state = copy.copy(full)
    state["state"] = {k: dict(v) for k, v in full["state"].items()}
    params = _flat_params(optimizer)
    for index, entry in state["state"].items():
        spec = _sharded_spec(params[int(index)])
        if spec is None:
            continue
        for name, value in entry.items():
            if isinstance(value, Tensor) and tuple(value.shape) == spec.full_shape:
                entry[name] = shard_like(value, spec)
    optimizer.load_state_dict(state)
