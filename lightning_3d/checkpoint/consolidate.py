"""Turn a sharded checkpoint into one dense file, or into a Hugging Face model directory.

Runs in one process, needs no GPU and not the world size the checkpoint was written with. The
Hugging Face export (:func:`export_hf`, re-exported from :mod:`lightning_3d.checkpoint.hf_export`)
streams tensor by tensor with the mapping the model family's adapter gives.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

import lightning as L
import torch
from torch import Tensor

from lightning_3d.checkpoint.sharded import LazyDense, LazyOptimizerState, ShardedCheckpoint, latest_complete

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def dense_state_dict(checkpoint: ShardedCheckpoint, dtype: Optional[torch.dtype] = None) -> dict[str, Tensor]:
    state = dict(LazyDense(checkpoint, "model").items())
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    return state


def _indexed_optimizer_states(checkpoint: ShardedCheckpoint, groups_per_optimizer: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """torch's own optimizer ``state_dict`` format (parameters numbered in group order)."""
    out = []
    for index, groups in enumerate(groups_per_optimizer):
        lazy = LazyOptimizerState(checkpoint, index)
        names = [n for g in groups for n in g["params"]]
        numbered, offset = [], 0
        for g in groups:
            numbered.append({**g, "params": list(range(offset, offset + len(g["params"])))})
            offset += len(g["params"])
        out.append({"state": {i: lazy[n] for i, n in enumerate(names) if n in lazy}, "param_groups": numbered})
    return out


def consolidate(path: str, out: str, dtype: Optional[str] = None, weights_only: bool = False) -> dict[str, Any]:
    """Write ``out`` (``.pt``/``.ckpt`` or ``.safetensors``): the dense state dict, and unless
    ``weights_only`` the rest of a Lightning checkpoint (optimizer state in torch's format included),
    loadable by ``LightningModule.load_from_checkpoint`` or ``nn.Module.load_state_dict``."""
    checkpoint = ShardedCheckpoint(latest_complete(Path(path), fallback=False))
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: choose one of {list(DTYPES)}.")
    state = dense_state_dict(checkpoint, DTYPES.get(dtype) if dtype else None)
    target = Path(out)
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.suffix == ".safetensors":
        try:
            from safetensors.torch import save_file
        except ImportError as err:  # pragma: no cover - safetensors comes with transformers ([hf])
            raise ImportError("writing .safetensors needs the safetensors package: pip install safetensors") from err
        if not weights_only:
            raise ValueError("a .safetensors file holds tensors only: pass weights_only=True (--weights-only).")
        save_file({k: v.contiguous().clone() for k, v in state.items()}, str(target))
    else:
        obj: Any = state
        if not weights_only:
            meta = checkpoint.meta()
            groups = meta.pop("optimizer_param_groups", [])
            obj = {**meta, "state_dict": state, "optimizer_states": _indexed_optimizer_states(checkpoint, groups)}
        torch.save(obj, target)
    return {"out": str(target), "tensors": len(state), "bytes": target.stat().st_size, "from": str(checkpoint.path)}


def load_from_checkpoint(cls: type, path: Union[str, Path], strict: bool = True, **overrides: Any) -> Any:
    """``MyModule.load_from_checkpoint(path)`` for any checkpoint this strategy wrote, in one process.

    Lightning's classmethod reads one file; a sharded checkpoint is a directory (IsADirectoryError).
    Here its pieces are assembled into dense tensors, the module is built from the saved
    hyper-parameters (``overrides`` replace some), ``configure_model()`` runs if the module builds its
    model there (a ``from_pretrained`` model's meta parameters are then replaced, not copied into),
    ``on_load_checkpoint`` sees the checkpoint, and the weights are loaded. A file goes to Lightning's
    own ``load_from_checkpoint``."""
    target = Path(path)
    if target.is_file():
        return cls.load_from_checkpoint(str(target), strict=strict, **overrides)
    checkpoint = ShardedCheckpoint(latest_complete(target, fallback=False))
    meta = checkpoint.meta()
    state = dense_state_dict(checkpoint)
    hparams = {k: v for k, v in dict(meta.get("hyper_parameters") or {}).items() if k != "_instantiator"}  # (LightningCLI's)
    module = cls(**{**hparams, **overrides})
    if type(module).configure_model is not L.LightningModule.configure_model:
        module.configure_model()
    module.on_load_checkpoint({**meta, "state_dict": state})
    on_meta = any(p.is_meta for p in module.parameters())
    module.load_state_dict(state, strict=strict, assign=on_meta)
    return module


# -- Hugging Face export: streamed tensor by tensor (hf_export.py); the name stays importable from here --------
from lightning_3d.checkpoint.hf_export import export_hf  # noqa: E402,F401
