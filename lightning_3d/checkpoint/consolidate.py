"""Turn a sharded checkpoint into one dense file, or into a Hugging Face model directory.

Runs in one process, needs no GPU and not the world size the checkpoint was written with. What a
model's tensors are called in Hugging Face's format is the model family's knowledge: its adapter
gives the mapping, found through the adapter registry (the one way generic code reaches models).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_3d.checkpoint.sharded import LazyDense, LazyOptimizerState, ShardedCheckpoint, latest_complete
from lightning_3d.models.adapters.registry import adapter_for_hf_config, adapter_named

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


# -- Hugging Face export: the model family's adapter gives config and key mapping ----------------------------------
def _strip(state: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def export_hf(path: str, out_dir: str, prefix: str = "model.", hf_config: Optional[str] = None, dtype: Optional[str] = None) -> dict[str, Any]:
    """Write a ``from_pretrained``-loadable directory. ``hf_config`` (a config.json or a model
    directory) for Hugging Face models trained inside a LightningModule (the adapter of its
    ``model_type``); without it the checkpoint must hold the reference GPT (``GPTModule``: the ``gpt``
    adapter, which exports GPT-2 architecture)."""
    import transformers

    checkpoint = ShardedCheckpoint(latest_complete(Path(path), fallback=False))
    state = _strip(dense_state_dict(checkpoint), prefix)
    if hf_config is not None:
        model_config: Any = transformers.AutoConfig.from_pretrained(hf_config)
        adapter = adapter_for_hf_config(model_config)
    else:
        hparams = checkpoint.meta().get("hyper_parameters", {})
        if "config" not in hparams:
            raise ValueError("this checkpoint is not of GPTModule: pass hf_config=<config.json of the Hugging Face model>.")
        model_config, adapter = hparams["config"], adapter_named("gpt")
    config, tensors = adapter.hf_export(model_config)
    model = transformers.AutoModelForCausalLM.from_config(config)
    what = type(model).__name__
    lacking = sorted({s for t in tensors for s in t.sources if s not in state})
    if lacking:
        raise ValueError(f"export: the checkpoint does not match {what}: it lacks {lacking}.")
    missing, unexpected = model.load_state_dict({t.key: t.combine([state[s] for s in t.sources]) for t in tensors}, strict=False)
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"export: the checkpoint does not match {what}: missing {missing}, unexpected {unexpected}.")
    if dtype is not None:
        model = model.to(DTYPES[dtype])
    model.save_pretrained(out_dir)
    return {"out": out_dir, "model": what, "parameters": sum(p.numel() for p in model.parameters())}
