"""ZeRO stage 3 on torch's FSDP2 (``fully_shard``).

FSDP2 shards every parameter over the data-parallel mesh, all-gathers a layer's parameters just
before it runs (prefetching the next layer) and reduce-scatters its gradients right after, so no
rank holds the full model between layers. It composes with our tensor parallelism because our
tensor-parallel parameters are ordinary tensors holding this rank's slice: FSDP2 simply shards
that slice further over the dp ranks that share it.

Units: every child of every ``nn.ModuleList`` (the transformer blocks) becomes one FSDP unit,
then each top-level child of the LightningModule that owns parameters (the model itself). A module
whose own parameters are expert slices (expert parallelism) is a unit first, sharded over their
expert replicas instead, with its gradients divided by the number of weight replicas as every
unit's are (an expert slice's gradient already sums its expert group's rows).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from lightning_3d.core.param_meta import EMPTY, meta_of, replica_mesh_of, set_meta
from lightning_3d.testing.strict_comm import mark_host


def fsdp_units(root: nn.Module) -> list[nn.Module]:
    """Blocks first (children of ModuleLists), then the top-level children that own parameters."""
    units: list[nn.Module] = []
    for module in root.modules():
        if isinstance(module, nn.ModuleList):
            units.extend(child for child in module if any(True for _ in child.parameters()))
    units.extend(child for child in root.children() if any(True for _ in child.parameters()))
    return units


def partial_replica_units(root: nn.Module) -> list[tuple[nn.Module, DeviceMesh]]:
    """Modules whose own parameters only some weight replicas hold (expert slices), with their mesh."""
    out = []
    for module in root.modules():
        meshes = {id(m): m for p in module.parameters(recurse=False) if (m := replica_mesh_of(p)) is not None}
        if len(meshes) > 1:
            raise ValueError(f"{type(module).__name__} holds parameters of several expert-replica meshes; one unit cannot shard them.")
        if meshes:
            if any(replica_mesh_of(p) is None for p in module.parameters(recurse=False)):
                raise ValueError(f"{type(module).__name__} mixes expert slices with whole parameters; ZeRO-3 shards each over other ranks.")
            out.append((module, next(iter(meshes.values()))))
    return out


def apply_zero3(
    root: nn.Module,
    dp_mesh: DeviceMesh,
    compute_dtype: Optional[torch.dtype] = None,
    reduce_dtype: Optional[torch.dtype] = None,
    cpu_offload: bool = False,
) -> list[FSDPModule]:
    """Shard ``root``'s submodules in place; tensor-parallel specs survive the parameter swap."""
    if any(True for _ in root.parameters(recurse=False)):
        names = [n for n, _ in root.named_parameters(recurse=False)]
        raise ValueError(
            f"zero_stage=3 shards the LightningModule's submodules, but {type(root).__name__} owns parameters "
            f"directly ({names}); move them into a submodule."
        )
    metas = {name: meta_of(p) for name, p in root.named_parameters(remove_duplicate=False)}
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=reduce_dtype)
    extra: dict[str, Any] = {}
    if cpu_offload:  # sharded parameters and gradients in host memory; the optimizer step runs there
        extra["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    top: list[FSDPModule] = []
    top_level = set(map(id, root.children()))
    for unit, mesh in partial_replica_units(root):  # inner units first (FSDP2 shards children before parents)
        sharded = fully_shard(unit, mesh=mesh, mp_policy=policy, **extra)
        sharded.set_gradient_divide_factor(float(dp_mesh.size()))  # sum over the expert replicas / R
        if mesh.size() > 1:  # a sum, then the division (gloo has no PREMUL_SUM); on one rank FSDP2 divides
            sharded.set_force_sum_reduction_for_comms(True)  # once by itself, and a forced sum would divide twice
    for unit in fsdp_units(root):
        sharded = fully_shard(unit, mesh=dp_mesh, mp_policy=policy, **extra)
        if id(unit) in top_level:
            top.append(sharded)
    root._parameter_metas = metas  # type: ignore[assignment]
    root._zero3_cpu_offload = cpu_offload  # type: ignore[assignment]
    restore_specs(root)
    return top


def restore_specs(root: nn.Module) -> None:
    """Put the parameter records (tensor-parallel specs first) back on FSDP2's parameters. FSDP2 swaps the Parameter objects
    when sharding and again when the module is moved (Lightning's teardown calls ``.cpu()``); a
    parameter without its spec would be saved as if every tp rank held the whole tensor. Under CPU
    offload the new parameters are marked as host memory for strict mode."""
    metas = getattr(root, "_parameter_metas", {})
    offloaded = getattr(root, "_zero3_cpu_offload", False)
    for name, p in root.named_parameters(remove_duplicate=False):
        meta = metas.get(name, EMPTY)
        if meta is not EMPTY and meta_of(p) is EMPTY:  # a new Parameter: its record, without the hook it lost
            hook = meta.sequence_parallel_hook  # (its sum over tp happens before each optimizer step instead)
            group = hook.group if hook is not None else meta.partial_gradient_group
            set_meta(p, replace(meta, sequence_parallel_hook=None, partial_gradient_group=group))
        if offloaded:  # strict mode: these shards (and their gradients) are host memory on a GPU machine
            mark_host(p, f"ZeRO-3 CPU offload: the shard of {name} (and its gradient) lives on the host")


@contextmanager
def _per_rank_random(seed: int, device: torch.device, mesh: Optional[DeviceMesh]) -> Iterator[None]:
    """Random ops on DTensor chunks draw locally, from a generator seeded per rank. DTensor's own
    RNG (on CUDA) offsets only by a chunk's place in the dp mesh, so tensor-parallel peers -- which
    hold different slices of a weight -- would draw identical values (duplicated heads)."""
    from torch.distributed.tensor import _random as dtensor_random

    tracker = getattr(dtensor_random, "_rng_tracker", None)
    if tracker is None and mesh is not None and device.type == "cuda":
        tracker = dtensor_random._rng_tracker = dtensor_random.OffsetBasedRNGTracker(mesh)
    enabled = getattr(tracker, "distribute_region_enabled", None)
    if tracker is not None:
        tracker.distribute_region_enabled = False
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type):
            torch.default_generator.manual_seed(seed)
            if device.type == "cuda":
                torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()].manual_seed(seed)
            yield
    finally:
        if tracker is not None:
            tracker.distribute_region_enabled = enabled


def materialize_meta(
    root: nn.Module,
    device: torch.device,
    seed: int = 0,
    mesh: Optional[DeviceMesh] = None,
    initialize: Optional[Callable[[], Iterable[nn.Module]]] = None,
) -> bool:
    """Allocate this rank's shards of a model built on the meta device and initialize them.

    Returns whether anything was on the meta device. Initialization runs every module's
    ``reset_parameters``, children before parents, so a model-level one (``GPT.reset_parameters``)
    has the last word. Each rank initializes only its shards: the values are drawn from the same
    distributions as a dense init, not bit-identical to it. Memory is filled with NaN first, so a
    parameter or buffer that no ``reset_parameters`` wrote is found and named, never trained as
    whatever ``torch.empty`` left there.

    ``initialize`` fills some modules itself and returns them (a pretrained model reads its shards
    from its files: :func:`lightning_3d.checkpoint.pretrained.load_pretrained_`); ``reset_parameters`` then runs
    only outside them and their ancestors (whose model-level init would overwrite them). Parameters
    and buffers that were not on the meta device (a head built for real next to a pretrained
    backbone, the rotary ``inv_freq``) keep their values: ``to_empty`` would have dropped them.
    """
    if not any(_is_meta(p) for p in root.parameters()):
        return False
    kept = {name: _local(t).detach().clone() for name, t in root.named_parameters() if not _is_meta(t)}
    kept_buffers = {name: b for name, b in root.named_buffers() if not _local(b).is_meta}
    root.to_empty(device=device)
    restore_specs(root)  # to_empty() re-created FSDP2's parameters: initializers read their tp specs
    with torch.no_grad(), _per_rank_random(seed, device, mesh):
        for t in [*root.parameters(), *root.buffers()]:
            if t.is_floating_point():
                _local(t).fill_(float("nan"))
        for name, value in kept_buffers.items():
            root.get_buffer(name).copy_(value)
        filled = list(initialize() or ()) if initialize is not None else []
        skip = _filled_and_ancestors(root, filled)
        for module in reversed(list(root.modules())):
            reset: Any = getattr(module, "reset_parameters", None)
            if callable(reset) and module is not root and id(module) not in skip:
                reset()
        for name, value in kept.items():
            _local(root.get_parameter(name)).copy_(value)
    missing = [
        name
        for name, t in [*root.named_parameters(), *root.named_buffers()]
        if t.is_floating_point() and bool(torch.isnan(_local(t)).any())
    ]
    flag = torch.tensor(float(bool(missing)), device=device)
    if dist.is_available() and dist.is_initialized():  # every rank raises, or none does (no hang)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        what = f"{missing[:5] or 'parts held by other ranks'}{' and more' if len(missing) > 5 else ''}"
        by = "no reset_parameters()" if initialize is None else f"neither {getattr(initialize, '__name__', 'the initializer')} nor a reset_parameters()"
        raise ValueError(
            f"zero_stage=3 materialized the meta-device model, but {by} initialized {what}: their memory is "
            f"uninitialized. Give the modules that own them a reset_parameters() (or the model one that covers "
            f"them), or build them on a real device."
        )
    return True


def _filled_and_ancestors(root: nn.Module, filled: list[nn.Module]) -> set[int]:
    """ids of the modules inside ``filled`` and of every module containing one of them."""
    if not filled:
        return set()
    names = {id(m): name for name, m in root.named_modules()}
    roots = [names[id(m)] for m in filled if id(m) in names]
    out: set[int] = set()
    for name, module in root.named_modules():
        inside = any(r == "" or name == r or name.startswith(r + ".") for r in roots)
        above = any(name == "" or r.startswith(name + ".") for r in roots)
        if inside or above:
            out.add(id(module))
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _is_meta(p: torch.Tensor) -> bool:
    return _local(p).is_meta
