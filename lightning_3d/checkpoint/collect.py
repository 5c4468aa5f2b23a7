"""What each rank puts into a sharded checkpoint: its own pieces, nothing gathered.

* Parameters owned by a ZeRO-1/2 optimizer: the rank's fp32 master slice, cut at parameter
  boundaries (every data-parallel rank writes its slice; stage 0 with mixed precision: dp-rank 0).
* FSDP2 (ZeRO-3) parameters: the rank's row chunk of its tensor-parallel slice.
* Everything else (plain data parallel, frozen parameters, buffers): the whole tensor-parallel
  slice, written by data-parallel rank 0 only -- or, for an expert slice (expert parallelism), by the
  first of its expert replicas, so every slice of the stack is written once.
* Optimizer state follows its parameter; per-parameter scalars (Adam's ``step``) go to the manifest.
* A tied weight's copy on the last pipeline stage is skipped (the first stage writes it).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from lightning_3d.checkpoint.sharded import RankShard
from lightning_3d.core.param_meta import is_pipeline_duplicate, replica_mesh_of
from lightning_3d.core.topology import Topology
from lightning_3d.tensor_parallel.spec import get_spec, spec_record
from lightning_3d.zero.sharded_optimizer import ZeroOptimizer, _Bucket


def _is_dtensor(t: Tensor) -> bool:
    return hasattr(t, "to_local")


def _writes_whole(t: Tensor, topology: Topology) -> bool:
    """Whether this rank writes ``t`` whole: the first of the ranks holding it."""
    mesh = replica_mesh_of(t)
    return (mesh.get_local_rank() if mesh is not None else topology.dp_rank) == 0


def _row_chunk(t: Tensor) -> tuple[int, int]:
    """Flat range of this rank's FSDP2 row chunk (torch.chunk semantics over dim 0 of its mesh)."""
    rows = t.shape[0]
    row_size = math.prod(t.shape[1:])  # (not t[0]: indexing a DTensor gathers the whole parameter)
    per = -(-rows // t.device_mesh.size())
    first = min(rows, t.device_mesh.get_local_rank() * per)
    last = min(rows, first + per)
    local = t.to_local()
    if local.shape[0] != last - first:
        raise RuntimeError(f"unexpected FSDP2 shard shape {tuple(local.shape)} for rows {first}:{last} of {tuple(t.shape)}.")
    return first * row_size, last * row_size


def _zero_index(optimizers: list[Any]) -> dict[int, tuple[ZeroOptimizer, int, _Bucket]]:
    index = {}
    for opt in optimizers:
        if isinstance(opt, ZeroOptimizer):
            for slot, bucket in enumerate(opt.buckets):
                for p in bucket.params:
                    index[id(p)] = (opt, slot, bucket)
    return index


def collect_model(shard: RankShard, module: nn.Module, optimizers: list[Any], topology: Topology) -> None:
    zero = _zero_index(optimizers)
    masters: dict[tuple[int, int], Tensor] = {}  # one read per bucket (NVMe masters come from a file)
    state = module.state_dict(keep_vars=True)
    seen: set[int] = set()
    for name, value in state.items():
        if not isinstance(value, Tensor) or id(value) in seen or is_pipeline_duplicate(value):
            continue
        seen.add(id(value))
        tp = spec_record(get_spec(value), tuple(value.shape))
        if id(value) in zero:
            opt, slot, bucket = zero[id(value)]
            if opt.stage == 0 and not _writes_whole(value, topology):
                continue
            key = (id(opt), slot)
            if key not in masters:
                masters[key] = opt._master_of(slot, bucket)
            master = masters[key]
            for segment in bucket.segments:
                if bucket.params[segment.index] is value:
                    shard.add("model", name, tp, list(value.shape), segment.start, segment.end, segment.of(master))
        elif _is_dtensor(value):
            lo, hi = _row_chunk(value)
            shard.add("model", name, tp, list(value.shape), lo, hi, value.to_local())
        elif _writes_whole(value, topology):
            shard.add("model", name, tp, list(value.shape), 0, value.numel(), value)


def collect_optimizer(shard: RankShard, index: int, optimizer: Any, names: dict[int, list[str]], topology: Topology) -> None:
    """Pieces of optimizer ``index``'s per-parameter state, and its scalars."""
    scalars: dict[str, dict[str, Any]] = {}
    kind = f"optim/{index}/"

    def add_other(name: str, key: str, value: Any) -> None:
        """Scalars go to the manifest; a tensor shaped unlike its parameter (Adafactor's factored
        moments; only where parameters are whole, see zero/optimizer_kinds.py) is stored whole."""
        if isinstance(value, Tensor) and value.dim() > 0 and not _is_dtensor(value):
            if topology.dp_rank == 0:  # (expert slices are refused such optimizers: zero/optimizer_kinds.py)
                shape = list(value.shape)
                shard.add(kind + key, name, spec_record(None, tuple(shape)), shape, 0, value.numel(), value)
        else:
            scalars.setdefault(name, {})[key] = _plain(value)

    if isinstance(optimizer, ZeroOptimizer):
        for slot, bucket in enumerate(optimizer.buckets):
            if optimizer.stage == 0 and not _writes_whole(bucket.params[0], topology):
                continue
            for segment, state in optimizer.segment_states(slot, bucket):
                p = bucket.params[segment.index]
                if is_pipeline_duplicate(p):
                    continue
                name = names[id(p)][0]
                tp = spec_record(get_spec(p), tuple(p.shape))
                for key, value in state.items():
                    if isinstance(value, Tensor) and value.dim() == 1 and value.numel() == segment.numel:
                        shard.add(kind + key, name, tp, list(p.shape), segment.start, segment.end, value)
                    else:
                        add_other(name, key, value)
    else:
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p, {})
                if not state or is_pipeline_duplicate(p):
                    continue
                name = names[id(p)][0]
                tp = spec_record(get_spec(p), tuple(p.shape))
                for key, value in state.items():
                    if isinstance(value, Tensor) and value.shape == p.shape and value.dim() > 0:
                        if _is_dtensor(value):
                            lo, hi = _row_chunk(value)
                            shard.add(kind + key, name, tp, list(p.shape), lo, hi, value.to_local())
                        elif _writes_whole(p, topology):
                            shard.add(kind + key, name, tp, list(p.shape), 0, value.numel(), value)
                    else:
                        add_other(name, key, value)
    shard.scalars[f"optim/{index}"] = scalars


def named_param_groups(optimizer: Any, names: dict[int, list[str]]) -> list[dict[str, Any]]:
    """Hyper-parameters and parameter names of each group (this rank's parameters only)."""
    groups = []
    for group in optimizer.param_groups:
        entry = {k: _plain(v) for k, v in group.items() if k != "params"}
        entry["params"] = [names[id(p)][0] for p in group["params"] if not is_pipeline_duplicate(p)]
        groups.append(entry)
    return groups


def merge_param_groups(per_rank: list[list[list[dict[str, Any]]]]) -> list[list[dict[str, Any]]]:
    """Union over ranks (pipeline stages hold different parameters) of every optimizer's groups."""
    merged: list[list[dict[str, Any]]] = []
    for optimizer_groups in zip(*per_rank):
        groups = [dict(g, params=list(g["params"])) for g in optimizer_groups[0]]
        for other in optimizer_groups[1:]:
            for target, group in zip(groups, other):
                target["params"].extend(n for n in group["params"] if n not in target["params"])
        merged.append(groups)
    return merged


def _plain(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, tuple):
        return list(value)
    return value


def rng_tensors(tracker: Any) -> dict[str, Tensor]:
    """This rank's generator states (restored only when a checkpoint resumes on the same layout)."""
    out = {"rng/cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            out[f"rng/cuda{i}"] = state
    if tracker is not None:
        for name, state in tracker.get_states().items():
            out[f"rng/tracker/{name}"] = state
    return out
