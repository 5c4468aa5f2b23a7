"""Saving and loading sharded checkpoints across ranks (what the strategy delegates to).

Save: every rank writes its own file into a temporary directory (optionally from a background
thread, so training goes on), then -- at the next synchronization point -- rank 0 gathers the
piece lists, writes the manifest and renames the directory into place. Load: the newest complete
checkpoint at or beside the path, read lazily, so each rank assembles only the tensors it holds.
"""

from __future__ import annotations

import json
import time
import uuid
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn

from lightning_3d.checkpoint.collect import collect_model, collect_optimizer, merge_param_groups, named_param_groups, rng_tensors
from lightning_3d.checkpoint.compatibility import model_record
from lightning_3d.checkpoint.sharded import (
    CheckpointError,
    copy_with_tensors,
    describe_path,
    tensor_signature,
    LazyDense,
    LazyOptimizerState,
    RankShard,
    ShardedCheckpoint,
    build_manifest,
    keep_last,
    latest_complete,
    publish,
    temporary_dir,
    write_rank_shard,
)
from lightning_3d.core.config import check_keep_last_k
from lightning_3d.core.topology import Topology


def own_meta(shard: RankShard, checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Lightning's checkpoint dict without the model and optimizer states (the pieces hold them), its
    tensors copied to the host now (an asynchronous save writes later; a DTensor as its local shard).
    Rank 0's copy becomes ``meta.pt``. A rank whose dict holds non-scalar tensors -- what a hook put
    there from this rank's shards, e.g. EMA weights -- also writes its own copy (``rank<r>.meta.pt``),
    restored on the same rank when the layout is unchanged; their signatures go to the manifest."""

    def host_copy(path: tuple, t: Tensor) -> Tensor:
        local = t.to_local() if hasattr(t, "to_local") else t
        local = local.detach().to("cpu", copy=True)
        if local.numel() > 1:
            shard.extras.append({"path": list(path), **tensor_signature(local)})
        return local

    rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    meta = copy_with_tensors(rest, host_copy)
    if shard.extras:
        shard.meta = meta
    return meta


def rank_meta(reader: ShardedCheckpoint, checkpoint: dict[str, Any], same_layout: bool, layout: dict[str, Any]) -> dict[str, Any]:
    """What replaces rank 0's entries of the checkpoint dict on this rank: this rank's own dict when the
    layout is unchanged. Under another layout rank 0's dict stands for every rank, which is right only
    for values every rank held alike: non-scalar tensors that differed between ranks (state kept per
    shard) cannot be re-cut without knowing what they are, and are refused."""
    extras: dict[str, Any] = reader.manifest.get("extras") or {}
    if not extras:
        return {}
    if same_layout:
        mine = extras.get(str(dist.get_rank()))
        if mine is None:
            return {}
        own = reader.meta(mine["file"])
        own.pop("optimizer_param_groups", None)  # rank 0's meta.pt holds every rank's groups, merged
        return own
    ranks = sum(1 for name in reader.manifest["files"] if name.startswith("rank") and not name.endswith(".meta.pt"))
    seen: dict[str, list[tuple]] = {}
    for entry in extras.values():
        for record in entry["tensors"]:
            seen.setdefault(json.dumps(record["path"]), []).append((tuple(record["shape"]), record["dtype"], record["crc32"]))
    differ = [json.loads(p) for p, sigs in seen.items() if len(sigs) < ranks or len(set(sigs)) > 1]
    if not differ:
        return {}
    shown = ", ".join(describe_path(p) for p in differ[:4]) + (f" and {len(differ) - 4} more" if len(differ) > 4 else "")
    raise CheckpointError(
        f"checkpoint {reader.path} holds tensors that differ between ranks outside the model and optimizer states "
        f"({shown}): a callback or hook saved state of each rank's own shards (e.g. EMA weights). They come back on "
        f"the same rank only under the layout that wrote them ({reader.manifest['layout']}); this job's layout is "
        f"{layout}, and they cannot be re-cut for it. Resume under the writing layout, or remove that state (the "
        f"callback) from the checkpoint's writer and save again."
    )


def is_same_layout(saved: dict[str, Any], current: dict[str, Any]) -> bool:
    """Whether a checkpoint's layout is this job's (same ranks, same roles); a layout saved before
    context (expert) parallelism existed has no ``"cp"`` (``"ep"``): it was 1."""
    return {"cp": 1, "ep": 1, **saved} == current


class ShardedCheckpointer:
    def __init__(self, topology: Topology, tracker: Any = None, async_save: bool = False, keep_last_k: Optional[int] = None) -> None:
        check_keep_last_k(keep_last_k)
        self.topology, self.tracker = topology, tracker
        self.async_save, self.keep_last_k = async_save, keep_last_k
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt") if async_save else None
        self._pending: Optional[tuple[Future, tuple]] = None
        self.last_stats: dict[str, float] = {}
        self.run_id: Optional[str] = None  # a resumed run keeps its checkpoint's id (see latest_complete)

    # -- save -----------------------------------------------------------------------------------------
    def save(
        self,
        checkpoint: dict[str, Any],
        filepath: str,
        module: nn.Module,
        optimizers: list[Any],
        names: dict[int, list[str]],
        aliases: list[list[str]],
        layout: dict[str, Any],
    ) -> None:
        self.finalize()
        start = time.perf_counter()
        final = Path(filepath)
        if dist.get_rank() == 0:
            self.run_id = self.run_id or uuid.uuid4().hex[:16]
            token = [(self.run_id, f"{time.time_ns()}")]
        else:
            token = [None]
        dist.broadcast_object_list(token, src=0)
        self.run_id, stamp = token[0]
        tmp = temporary_dir(final, stamp, self.run_id)
        tmp.mkdir(parents=True, exist_ok=True)
        shard = RankShard(dist.get_rank())
        collect_model(shard, module, optimizers, self.topology)
        for index, optimizer in enumerate(optimizers):
            collect_optimizer(shard, index, optimizer, names, self.topology)
        shard.tensors.update(rng_tensors(self.tracker))
        groups = [named_param_groups(opt, names) for opt in optimizers]
        meta = own_meta(shard, checkpoint)
        step = int(checkpoint.get("global_step", 0))
        context = (groups, meta, tmp, final, step, layout, aliases, start, model_record(module))
        self.last_stats = {"bytes": float(sum(t.numel() * t.element_size() for t in shard.tensors.values()))}
        if self._executor is not None:
            self._pending = (self._executor.submit(write_rank_shard, tmp, shard), context)
            self.last_stats["blocking_s"] = time.perf_counter() - start
            return
        self._commit(write_rank_shard(tmp, shard), *context)
        self.last_stats["blocking_s"] = time.perf_counter() - start

    def finalize(self) -> None:
        """Commit an asynchronous save (collective: every rank calls it at the same points)."""
        if self._pending is None:
            return
        future, context = self._pending
        self._pending = None
        self._commit(future.result(), *context)

    def _commit(
        self,
        written: dict[str, Any],
        groups: list,
        meta: dict,
        tmp: Path,
        final: Path,
        step: int,
        layout: dict,
        aliases: list,
        start: float,
        model: dict[str, Any],
    ) -> None:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (written, groups))
        if dist.get_rank() == 0:
            manifest = build_manifest(step, layout, [w for w, _ in gathered], aliases, run_id=self.run_id, model=model)
            meta = dict(meta, optimizer_param_groups=merge_param_groups([g for _, g in gathered]))
            publish(tmp, final, manifest, meta)
            if self.keep_last_k is not None:
                keep_last(final.parent, self.keep_last_k, protect=final)
        dist.barrier()
        self.last_stats["total_s"] = time.perf_counter() - start

    def close(self) -> None:
        self.finalize()
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    # -- load -----------------------------------------------------------------------------------------
    def load(self, path: str, weights_only: bool, layout: dict[str, Any]) -> dict[str, Any]:
        self.finalize()
        reader = ShardedCheckpoint(self._resolve(Path(path)), weights_only=weights_only)
        self.run_id = reader.manifest.get("run_id") or self.run_id  # saves from here on continue its run
        checkpoint = dict(reader.meta())
        checkpoint["state_dict"] = LazyDense(reader, "model")
        groups = checkpoint.pop("optimizer_param_groups", [])
        checkpoint["optimizer_states"] = [{"state": LazyOptimizerState(reader, i), "param_groups": g} for i, g in enumerate(groups)]
        same_layout = is_same_layout(reader.manifest["layout"], layout)
        checkpoint.update(rank_meta(reader, checkpoint, same_layout, layout))
        if same_layout:  # same ranks, same roles: resume their random streams too
            self._restore_rng(reader)
        checkpoint["lightning_3d_checkpoint"] = str(reader.path)
        checkpoint["lightning_3d_layout"] = dict(reader.manifest["layout"])  # (what an elastic policy compares)
        return checkpoint

    @staticmethod
    def _resolve(path: Path) -> Path:
        """Which checkpoint ``path`` means, decided once on rank 0 and told to every rank (ranks that
        list a shared filesystem each could see it differently, and one would go on alone)."""
        answer: list[Any] = [None]
        if dist.get_rank() == 0:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    answer = [(str(latest_complete(path)), None, [str(w.message) for w in caught])]
                except CheckpointError as err:
                    answer = [(None, str(err), [])]
        dist.broadcast_object_list(answer, src=0)
        resolved, error, said = answer[0]
        if error is not None:
            raise CheckpointError(error)
        for message in said:
            rank_zero_warn(message)
        return Path(resolved)

    def _restore_rng(self, reader: ShardedCheckpoint) -> None:
        tensors = reader._file(f"rank{dist.get_rank()}.pt")
        if "rng/cpu" in tensors:
            torch.set_rng_state(tensors["rng/cpu"].clone())
        for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
            if f"rng/cuda{i}" in tensors:
                torch.cuda.set_rng_state(tensors[f"rng/cuda{i}"].clone(), i)
        if self.tracker is not None:
            states = {k[len("rng/tracker/") :]: v.clone() for k, v in tensors.items() if k.startswith("rng/tracker/")}
            if states:
                self.tracker.set_states(states)
