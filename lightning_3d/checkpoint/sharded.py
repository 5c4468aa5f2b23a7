"""Sharded checkpoints: one directory, one file per rank, a manifest that says where every piece sits.

Layout of ``step=100.ckpt/``::

    manifest.json   format, step, layout, versions, per-file sizes and CRC32s, and for every
                    tensor piece: the parameter (or buffer / optimizer-state) name, its dense shape,
                    how its tensor-parallel slice sits in the dense tensor, and the flat range of
                    that slice this piece covers
    meta.pt         everything else Lightning saves (loops, LR schedulers, precision, callbacks)
    rank<r>.pt      rank r's pieces: plain tensors only (loads with ``weights_only=True``)

Every piece is "a flat range of a tensor-parallel slice of a dense tensor". That one description
covers plain data parallel (the whole slice), ZeRO-1/2 master and optimizer slices (a range of a
flat bucket intersected with one parameter), FSDP2 (ZeRO-3) row chunks and pipeline stages (each
stage writes the layers it holds). Reading assembles the dense tensor of a name from its pieces,
so a checkpoint loads under any layout, or with no strategy at all. (torch.distributed.checkpoint
needs rectangular chunks; ZeRO's flat slices cut parameters mid-row, hence this format.)

Writes go to ``<name>.tmp-<run id>.<token>/``; the manifest is written last and the directory
renamed into place only after every rank has finished, so a crash mid-save never touches the
previous checkpoint, and a directory without a manifest is ignored. That temporary directory is
also the evidence of an interrupted save: only a path whose save really began (its ``.tmp-``
sibling exists) falls back to the newest complete checkpoint *of the same run* (the run id is in
the temporary name and in every manifest). Any other missing path is an error: a mistyped
``ckpt_path`` must never resume from whatever checkpoint happens to sit beside it.
"""

from __future__ import annotations

import copy
import errno
import json
import os
import shutil
import time
import warnings
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_3d.checkpoint.atomic import replace_directory
from lightning_3d.tensor_parallel.spec import assemble_dense

FORMAT = "lightning_3d.sharded/1"
MANIFEST = "manifest.json"
META = "meta.pt"


class CheckpointError(RuntimeError):
    pass


@dataclass
class Piece:
    """A flat range ``[start, end)`` of the tensor-parallel slice ``tp`` of the dense tensor ``name``."""

    kind: str  # "model", or "optim/<index>/<state name>"
    name: str
    tp: dict
    local_shape: list[int]
    start: int
    end: int
    dtype: str
    key: str = ""
    file: str = ""


@dataclass
class RankShard:
    """What one rank writes: its pieces, per-parameter optimizer scalars, and their tensors."""

    rank: int
    pieces: list[Piece] = field(default_factory=list)
    tensors: dict[str, Tensor] = field(default_factory=dict)
    scalars: dict[str, dict[str, Any]] = field(default_factory=dict)  # "optim/<i>" -> name -> {"step": ...}
    meta: Optional[dict[str, Any]] = None  # this rank's own checkpoint dict (see ShardedCheckpointer.save)
    extras: list[dict[str, Any]] = field(default_factory=list)  # signatures of its non-scalar tensors

    def add(self, kind: str, name: str, tp: dict, local_shape: list[int], start: int, end: int, flat: Tensor) -> None:
        key = f"{len(self.pieces)}"
        self.pieces.append(Piece(kind, name, tp, list(local_shape), start, end, str(flat.dtype).replace("torch.", ""), key))
        self.tensors[key] = flat.detach().reshape(-1).to("cpu", copy=True)


# -- tensors that hooks put into Lightning's checkpoint dict (per rank) --------------------------------


def copy_with_tensors(obj: Any, on_tensor: Callable[[tuple, Tensor], Tensor], path: tuple = ()) -> Any:
    """A copy of nested dicts (str or int keys) and lists in which every tensor ``t`` at ``path`` is
    ``on_tensor(path, t)``; anything else is shared, not copied (tensors inside tuples or objects too)."""
    if isinstance(obj, Tensor):
        return on_tensor(path, obj)
    if isinstance(obj, dict):
        out = copy.copy(obj)
        for key, value in obj.items():
            if isinstance(key, (str, int)) and not isinstance(key, bool):
                out[key] = copy_with_tensors(value, on_tensor, path + (key,))
        return out
    if isinstance(obj, list):
        return [copy_with_tensors(value, on_tensor, path + (i,)) for i, value in enumerate(obj)]
    return obj


def describe_path(path: list) -> str:
    return "checkpoint" + "".join(f"[{key!r}]" for key in path)


def tensor_signature(t: Tensor) -> dict[str, Any]:
    """Shape, dtype and CRC32 of a CPU tensor's bytes: equal on every rank means replicated."""
    t = t.contiguous()
    crc = zlib.crc32(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else 0
    return {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""), "crc32": crc}


# -- writing ----------------------------------------------------------------------------------------
def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_file(path: Path, obj: Any) -> dict[str, int]:
    """``torch.save`` + fsync; returns size and CRC32 for the manifest."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": path.stat().st_size, "crc32": _crc32(path)}


def write_rank_shard(tmp_dir: Path, shard: RankShard) -> dict[str, Any]:
    """Write a rank's tensors; returns what the manifest needs about them. A full disk is named as
    such (the save is staged: the checkpoints already there are untouched)."""
    try:
        return _write_rank_shard(tmp_dir, shard)
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        final = tmp_dir.name.split(".tmp-")[0]
        raise CheckpointError(
            f"no space left on the device of {tmp_dir.parent} (quota or disk full) while rank {shard.rank} wrote checkpoint "
            f"{final}: nothing of it was published, and the complete checkpoints beside it are intact. Free space "
            f"(keep_last_k=N removes older checkpoints) or save elsewhere, then resume from the last one."
        ) from None


def _write_rank_shard(tmp_dir: Path, shard: RankShard) -> dict[str, Any]:
    name = f"rank{shard.rank}.pt"
    info = write_file(tmp_dir / name, shard.tensors)
    for piece in shard.pieces:
        piece.file = name
    written = {"file": name, "info": info, "pieces": [asdict(p) for p in shard.pieces], "scalars": shard.scalars}
    if shard.meta is not None:
        meta_name = f"rank{shard.rank}.meta.pt"
        written["extras"] = {"file": meta_name, "info": write_file(tmp_dir / meta_name, shard.meta), "tensors": shard.extras}
    return written


def temporary_dir(final: Path, token: str, run_id: str) -> Path:
    """Where a save is staged; its name carries the run id, so an interrupted save says whose it was."""
    return final.with_name(f"{final.name}.tmp-{run_id}.{token}")


def _interrupted_runs(final: Path) -> set[Optional[str]]:
    """Run ids of saves to ``final`` that began and never finished (``None``: a staging directory
    of an older format, whose run is unknown)."""
    prefix = f"{final.name}.tmp-"
    runs: set[Optional[str]] = set()
    for child in final.parent.iterdir() if final.parent.is_dir() else []:
        if child.is_dir() and child.name.startswith(prefix):
            run, dot, _ = child.name[len(prefix) :].rpartition(".")
            runs.add(run if dot else None)
    return runs


def publish(tmp_dir: Path, final: Path, manifest: dict[str, Any], meta: dict[str, Any]) -> None:
    """Rank 0, after every rank wrote its file: meta, manifest (last), then rename into place."""
    manifest["files"][META] = write_file(tmp_dir / META, meta)
    manifest_path = tmp_dir / MANIFEST
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)
        f.flush()
        os.fsync(f.fileno())
    replace_directory(tmp_dir, final, final.with_name(f"{final.name}.replaced-{os.getpid()}-{time.time_ns()}"))


def build_manifest(
    step: int,
    layout: dict[str, Any],
    written: list[dict[str, Any]],
    ties: list[list[str]],
    run_id: Optional[str] = None,
    model: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    import lightning
    from lightning_3d.core import __version__

    scalars: dict[str, dict[str, Any]] = defaultdict(dict)
    for w in written:
        for kind, by_name in w["scalars"].items():
            scalars[kind].update(by_name)
    files = {w["file"]: w["info"] for w in written}
    files.update({w["extras"]["file"]: w["extras"]["info"] for w in written if w.get("extras")})
    return {
        "format": FORMAT,
        "step": step,
        "run_id": run_id,
        "layout": layout,
        "model": model,
        "versions": {"lightning_3d": __version__, "torch": torch.__version__, "lightning": lightning.__version__},
        "created": time.time(),
        "files": files,
        "pieces": [p for w in written for p in w["pieces"]],
        "scalars": dict(scalars),
        "ties": ties,
        # ranks that wrote their own checkpoint dict (rank<r>.meta.pt) and its non-scalar tensors
        "extras": {str(i): {"file": w["extras"]["file"], "tensors": w["extras"]["tensors"]} for i, w in enumerate(written) if w.get("extras")},
    }


def keep_last(parent: Path, k: int, protect: Path) -> list[Path]:
    """Delete complete checkpoints in ``parent`` beyond the newest ``k`` (by step); returns them."""
    complete = sorted(complete_checkpoints(parent), key=lambda c: (c[1], c[0].stat().st_mtime))
    removed = []
    for path, _ in complete[: max(0, len(complete) - k)]:
        if path != protect:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


# -- reading ------------------------------------------------------------------------------------------
def is_sharded(path: Path) -> bool:
    return path.is_dir()


def read_manifest(path: Path) -> dict[str, Any]:
    manifest_path = path / MANIFEST
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist.{_beside(path)}")
    if not manifest_path.is_file():
        raise CheckpointError(
            f"{path} is not a complete lightning_3d sharded checkpoint (no {MANIFEST}): give the directory a save "
            f"wrote (e.g. .../step=100.ckpt), or a consolidated .ckpt file."
        )
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(
            f"{manifest_path} is not valid JSON ({err}): the checkpoint's index was damaged; resume from another "
            f"checkpoint (the files beside it are unreadable without it)."
        ) from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{manifest_path} is not a lightning_3d manifest (a JSON object); resume from another checkpoint.")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"{path}: unknown checkpoint format {manifest.get('format')!r} (expected {FORMAT}); it was written by another "
            f"tool or version: load it with the version that wrote it, or pass a lightning_3d checkpoint."
        )
    return manifest


def _beside(path: Path, limit: int = 5) -> str:
    """A hint for a path that does not exist: the checkpoints that do, in its directory."""
    found = sorted(complete_checkpoints(path.parent), key=lambda c: (c[1], c[0].name))
    if not found:
        return ""
    names = ", ".join(p.name for p, _ in found[-limit:])
    return f" Complete checkpoints in {path.parent}: {names}{' ...' if len(found) > limit else ''}."


def complete_checkpoints(parent: Path) -> list[tuple[Path, int]]:
    """(path, step) of every complete sharded checkpoint directly inside ``parent``."""
    out = []
    for child in parent.iterdir() if parent.is_dir() else []:
        if child.is_dir() and ".tmp-" not in child.name and ".replaced-" not in child.name and (child / MANIFEST).is_file():
            try:
                out.append((child, int(read_manifest(child)["step"])))
            except (CheckpointError, ValueError, KeyError, json.JSONDecodeError):
                continue
    return out


def latest_complete(path: Path, fallback: bool = True) -> Path:
    """``path`` itself when complete. When a save to ``path`` began and was interrupted (its staging
    directory exists and ``path`` does not), the newest complete checkpoint of the same run beside
    it, with a warning (``fallback=False``, for offline tools: an error naming it). Anything else
    is an error that says what is wrong with ``path``."""
    if (path / MANIFEST).is_file():
        return path
    if path.exists():
        read_manifest(path)  # raises: a directory (or file) that is not a sharded checkpoint
    runs = _interrupted_runs(path)
    if not runs:
        raise CheckpointError(f"checkpoint {path} does not exist.{_beside(path)}")
    known = {r for r in runs if r is not None}
    staged = [c for c in path.parent.iterdir() if c.name.startswith(f"{path.name}.tmp-") and (c / MANIFEST).is_file()]
    manifests = {c: _manifest_or_none(c) for c in [p for p, _ in complete_checkpoints(path.parent)] + staged}  # staged: crashed between its renames
    candidates = [c for c, manifest in manifests.items() if manifest.get("run_id") in known]
    if not candidates:
        raise CheckpointError(
            f"checkpoint {path} does not exist: its save was interrupted, and no complete checkpoint of the same run "
            f"is beside it.{_beside(path)} Pass one of them explicitly as ckpt_path."
        )
    # the newest *written*, not the highest step: a run rolled back to an earlier step continues from there
    best = max(candidates, key=lambda c: (manifests[c].get("created", 0.0), c.stat().st_mtime))
    if not fallback:
        raise CheckpointError(
            f"checkpoint {path} does not exist: its save was interrupted. The newest complete checkpoint of the same "
            f"run is {best}; pass that path instead."
        )
    warnings.warn(
        f"lightning_3d: the save of {path} was interrupted (it is incomplete); resuming from {best}, the newest "
        f"complete checkpoint of the same run, instead.",
        stacklevel=2,
    )
    return best


def _manifest_or_none(path: Path) -> dict[str, Any]:
    try:
        return read_manifest(path)
    except (CheckpointError, ValueError, json.JSONDecodeError):
        return {}


class ShardedCheckpoint:
    """Read access to a sharded checkpoint: dense tensors by name, assembled from their pieces."""

    def __init__(self, path: Path, weights_only: bool = True) -> None:
        self.path = path
        self.manifest = read_manifest(path)
        self.weights_only = weights_only
        self._files: dict[str, dict[str, Tensor]] = {}
        self._verified: set[str] = set()
        self._by_name: dict[tuple[str, str], list[Piece]] = defaultdict(list)
        for record in self.manifest["pieces"]:
            piece = Piece(**record)
            self._by_name[(piece.kind, piece.name)].append(piece)
        self.ties: dict[str, list[str]] = {n: group for group in self.manifest.get("ties", []) for n in group}

    def verify(self, name: str) -> None:
        expected = self.manifest["files"].get(name)
        path = self.path / name
        if expected is None or not path.is_file():
            raise CheckpointError(
                f"checkpoint file {path} is missing (listed in {MANIFEST}): the checkpoint was copied incompletely; copy "
                f"the whole directory again, or resume from another checkpoint."
            )
        if path.stat().st_size != expected["bytes"] or _crc32(path) != expected["crc32"]:
            raise CheckpointError(
                f"checkpoint file {path} is corrupt or truncated (size/CRC32 differ from {MANIFEST}); restore it or "
                f"resume from another checkpoint."
            )

    def _file(self, name: str) -> dict[str, Tensor]:
        if name not in self._files:
            if name not in self._verified:
                self.verify(name)
                self._verified.add(name)
            self._files[name] = torch.load(self.path / name, map_location="cpu", weights_only=True, mmap=True)
        return self._files[name]

    def release(self) -> None:
        """Unmap the rank files. Pages of a mapped file that were read count towards the process's
        resident memory until it is unmapped, so a reader that streams the whole checkpoint (an
        export) releases after each tensor; files are mapped again (not re-verified) on demand."""
        self._files.clear()

    def meta(self, name: str = META) -> dict[str, Any]:
        """Lightning's checkpoint dict as rank 0 had it (``meta.pt``), or as rank r had it
        (``rank<r>.meta.pt``, written where hooks put non-scalar tensors into it)."""
        self.verify(name)
        try:
            return torch.load(self.path / name, map_location="cpu", weights_only=self.weights_only)
        except Exception as err:  # noqa: BLE001 - pickle errors come in many types
            raise CheckpointError(
                f"{self.path / name} holds objects beyond tensors and plain data and was not loaded "
                f"(weights_only=True protects against code in checkpoints). If you trust the file, load with "
                f"trainer.fit(..., weights_only=False). Cause: {err}"
            ) from err

    def names(self, kind: str) -> list[str]:
        return sorted({n for k, n in self._by_name if k == kind})

    def canonical(self, kind: str, name: str) -> Optional[str]:
        """The name ``name``'s data was stored under (a tied weight is stored once, under one name)."""
        if (kind, name) in self._by_name:
            return name
        return next((n for n in self.ties.get(name, []) if (kind, n) in self._by_name), None)

    def dense_info(self, kind: str, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        """(dense shape, dtype) of ``name`` from the manifest alone: no tensor data is read."""
        canonical = self.canonical(kind, name)
        if canonical is None:
            raise KeyError(f"{name!r} ({kind}) is not in checkpoint {self.path}.")
        piece = self._by_name[(kind, canonical)][0]
        return tuple(piece.tp["full_shape"]), getattr(torch, piece.dtype)

    def dense(self, kind: str, name: str) -> Tensor:
        """The dense tensor ``name`` (any layout wrote it), assembled from its pieces."""
        canonical = self.canonical(kind, name)
        if canonical is None:
            raise KeyError(f"{name!r} ({kind}) is not in checkpoint {self.path}.")
        pieces = self._by_name[(kind, canonical)]
        slices: dict[int, Tensor] = {}
        covered: dict[int, int] = defaultdict(int)
        for piece in pieces:
            rank = piece.tp.get("rank", 0)
            if rank not in slices:
                numel = 1
                for d in piece.local_shape:
                    numel *= d
                slices[rank] = torch.empty(numel, dtype=getattr(torch, piece.dtype))
            slices[rank][piece.start : piece.end].copy_(self._file(piece.file)[piece.key])
            covered[rank] += piece.end - piece.start
        local_shape = pieces[0].local_shape
        numel = slices[next(iter(slices))].numel()
        world = int(pieces[0].tp.get("world", 1)) if pieces[0].tp.get("dim") is not None else 1
        incomplete = sorted({r for r, n in covered.items() if n < numel} | (set(range(world)) - set(slices)))
        if incomplete:
            raise CheckpointError(
                f"{self.path}: pieces of {name!r} are missing (tensor-parallel ranks {incomplete}): {MANIFEST} does not "
                f"cover the whole tensor; the checkpoint was edited or copied incompletely. Resume from another checkpoint."
            )
        return assemble_dense({r: t.view(local_shape) for r, t in slices.items()}, pieces[0].tp)

    def scalars(self, kind: str) -> dict[str, dict[str, Any]]:
        return self.manifest.get("scalars", {}).get(kind, {})


class LazyDense(Mapping):
    """A read-only ``{name: dense tensor}`` view that assembles a tensor only when it is asked for."""

    def __init__(self, checkpoint: ShardedCheckpoint, kind: str) -> None:
        self.checkpoint, self.kind = checkpoint, kind
        stored = checkpoint.names(kind)
        self._keys = stored + [n for n in checkpoint.ties if n not in stored and checkpoint.canonical(kind, n)]

    def __getitem__(self, name: str) -> Tensor:
        return self.checkpoint.dense(self.kind, name)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.checkpoint.canonical(self.kind, name) is not None

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


class LazyOptimizerState(Mapping):
    """``{param name: {state name: dense tensor or scalar}}`` for optimizer ``index``, assembled lazily."""

    def __init__(self, checkpoint: ShardedCheckpoint, index: int) -> None:
        self.checkpoint, self.prefix = checkpoint, f"optim/{index}/"
        names: dict[str, set[str]] = defaultdict(set)
        for kind, name in checkpoint._by_name:
            if kind.startswith(self.prefix):
                names[name].add(kind[len(self.prefix) :])
        self._states = names
        self._scalars = checkpoint.scalars(f"optim/{index}")
        for alias, group in checkpoint.ties.items():
            canonical = next((n for n in group if n in names), None)
            if canonical is not None and alias not in names:
                self._states[alias] = names[canonical]
                if canonical in self._scalars:
                    self._scalars[alias] = self._scalars[canonical]

    def __getitem__(self, name: str) -> dict[str, Any]:
        entry: dict[str, Any] = {k: (torch.tensor(v) if isinstance(v, float) else v) for k, v in self._scalars.get(name, {}).items()}
        for state in self._states[name]:
            entry[state] = self.checkpoint.dense(self.prefix + state, name)
        return entry

    def __contains__(self, name: object) -> bool:
        return name in self._states

    def __iter__(self) -> Iterator[str]:
        return iter(self._states)

    def __len__(self) -> int:
        return len(self._states)
