"""Consolidated (dense) state dicts for tensor-parallel and ZeRO-3 models and their optimizers.

Checkpoints hold the *dense* tensors, so they load at any tensor-parallel degree or ZeRO stage
and into a plain model without the strategy: saving gathers every sharded parameter (FSDP2
DTensors over dp, then tensor-parallel slices over tp) and its optimizer state; loading re-splits.
Gathering costs memory proportional to the full model on every rank; sharded checkpoints that
never gather are the checkpoint milestone's job. ZeRO 1-2 optimizers produce the same dense
format themselves (:meth:`ZeroOptimizer.state_dict`).
"""

from __future__ import annotations

import copy
from typing import Any, Optional

from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_3d.core.distributed import current_compute_device
from lightning_3d.tensor_parallel.spec import TPSpec, gather_full, get_spec, shard_like


def _sharded_spec(t: Any) -> Optional[TPSpec]:
    spec = get_spec(t) if isinstance(t, Tensor) else None
    return spec if spec is not None and spec.differs_from_dense else None


def to_dense(value: Tensor, spec: Optional[TPSpec]) -> Tensor:
    """Gather a (DTensor and/or tensor-parallel) shard into the dense tensor (collective), where the
    shard lives. A shard in host memory (ZeRO-3 CPU offload) travels from the compute device: NCCL
    refuses host tensors."""
    value = value.detach()
    if not (hasattr(value, "full_tensor") or spec is not None):
        return value
    home, device = value.device, current_compute_device()
    if hasattr(value, "full_tensor"):
        from torch.distributed.tensor import DTensor

        local = value.to_local().to(device)
        value = DTensor.from_local(local, value.device_mesh, value.placements, shape=value.shape, stride=value.stride()).full_tensor()
    return (gather_full(value.to(device), spec) if spec is not None else value).to(home)


def to_local(dense: Tensor, like: Tensor, spec: Optional[TPSpec]) -> Tensor:
    """The part of ``dense`` that ``like`` (a local parameter or state tensor) holds on this rank."""
    local = shard_like(dense, spec) if spec is not None else dense
    if hasattr(like, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(local.to(like.device, like.dtype), like.device_mesh, like.placements)
    return local


def full_state_dict(module: nn.Module, overrides: Optional[dict[int, Tensor]] = None) -> dict[str, Any]:
    """``module.state_dict()`` with every shard gathered; ``overrides`` (id(param) -> dense tensor)
    replace parameters, e.g. by their fp32 master weights."""
    overrides = overrides or {}
    out: dict[str, Any] = {}
    for key, value in module.state_dict(keep_vars=True).items():
        if id(value) in overrides:
            out[key] = overrides[id(value)]
        elif isinstance(value, Tensor):
            out[key] = to_dense(value, _sharded_spec(value))
        else:
            out[key] = value
    return out


def shard_state_dict(module: nn.Module, full: dict[str, Any]) -> dict[str, Any]:
    """Re-split a dense state dict for this rank's (possibly sharded) ``module``."""
    local = module.state_dict(keep_vars=True)
    out = dict(full)
    for key, value in full.items():
        target = local.get(key)
        if isinstance(value, Tensor) and isinstance(target, Tensor):
            out[key] = to_local(value, target, _sharded_spec(target))
    return out


def _flat_params(optimizer: Optimizer) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _is_per_element(value: Any, param: Tensor) -> bool:
    return isinstance(value, Tensor) and value.shape == param.shape and value.dim() > 0


def full_optimizer_state(optimizer: Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with per-parameter state tensors gathered like their parameters."""
    state = optimizer.state_dict()
    # state_dict() shares the per-parameter dicts with the live optimizer: copy before replacing.
    state["state"] = {index: dict(entry) for index, entry in state["state"].items()}
    params = _flat_params(optimizer)
    for index in sorted(state["state"]):
        param = params[index]
        entry = state["state"][index]
        for name, value in entry.items():
            if _is_per_element(value, param):
                entry[name] = to_dense(value, _sharded_spec(param))
    return state


def load_sharded_optimizer_state(optimizer: Optimizer, full: dict[str, Any]) -> None:
    """Load a dense optimizer state, keeping this rank's part of every parameter's state."""
    state = copy.copy(full)
    state["state"] = {k: dict(v) for k, v in full["state"].items()}
    params = _flat_params(optimizer)
    for index, entry in state["state"].items():
        param = params[int(index)]
        spec = _sharded_spec(param)
        for name, value in entry.items():
            if isinstance(value, Tensor) and value.dim() > 0:
                entry[name] = to_local(value, param, spec)
    optimizer.load_state_dict(state)


# -- layout-independent optimizer keys and pipeline-stage merging --------------------------------------
def parameter_names(module: nn.Module) -> dict[int, list[str]]:
    """id(param) -> every name it has (tied parameters have several)."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def keyed_by_name(state: dict[str, Any], params: list[Tensor], names: dict[int, list[str]]) -> dict[str, Any]:
    """Replace an optimizer state's parameter indices by parameter names (stable across layouts)."""
    def name(i: Any) -> str:
        return names[id(params[int(i)])][0]

    return {
        "state": {name(i): v for i, v in state["state"].items()},
        "param_groups": [{**g, "params": [name(i) for i in g["params"]]} for g in state["param_groups"]],
    }


def keyed_by_index(state: dict[str, Any], optimizer: Any, names: dict[int, list[str]]) -> dict[str, Any]:
    """The inverse, for this rank's optimizer: entries for parameters it does not hold (other
    pipeline stages) are dropped; group hyper-parameters come from the saved groups."""
    if not state["state"] or isinstance(next(iter(state["state"])), int):
        return state  # index-keyed already
    params = _flat_params(optimizer)
    saved_state = state["state"]
    local: dict[int, Any] = {}
    for i, p in enumerate(params):  # look up only this rank's parameters (the state may be lazy)
        for alias in names[id(p)]:
            if alias in saved_state:
                local[i] = saved_state[alias]
                break
    groups, offset = [], 0
    for group, saved in zip(optimizer.param_groups, state["param_groups"]):
        groups.append({**saved, "params": list(range(offset, offset + len(group["params"])))})
        offset += len(group["params"])
    return {"state": local, "param_groups": groups}


def merge_over_group(value: dict[str, Any], group: Any) -> dict[str, Any]:
    """Union of every rank's dict (pipeline stages each hold part of the model)."""
    import torch.distributed as dist

    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, value, group=group)
    merged: dict[str, Any] = {}
    for part in parts:
        merged.update(part)
    return merged


def merge_optimizer_states(state: dict[str, Any], group: Any) -> dict[str, Any]:
    import torch.distributed as dist

    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, state, group=group)
    merged = {"state": {}, "param_groups": [dict(g, params=[]) for g in parts[0]["param_groups"]]}
    for part in parts:
        merged["state"].update(part["state"])
        for target, group_state in zip(merged["param_groups"], part["param_groups"]):
            target["params"].extend(n for n in group_state["params"] if n not in target["params"])
    return merged
