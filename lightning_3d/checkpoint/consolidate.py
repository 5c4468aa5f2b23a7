"""Turn a sharded checkpoint into one dense file, or into a Hugging Face model directory.

Runs in one process, needs no GPU and not the world size the checkpoint was written with.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

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


# -- Hugging Face export -----------------------------------------------------------------------------------
def _strip(state: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def _require_gpt2_architecture(cfg: Any) -> None:
    """GPT-2 has learned positions, a GELU MLP, LayerNorm and one key/value head per query head;
    a GPTConfig with Llama-style options has weights GPT-2 cannot hold (or would silently compute
    differently with), so refuse rather than write a model that loads but is wrong. ``bias=False``
    (zero biases) and untied heads (``tie_word_embeddings=False``) are representable and exported."""
    differences = [
        f"{name}={value!r} (GPT-2: {gpt2!r})"
        for name, value, gpt2 in (
            ("position", cfg.position, "learned"),
            ("mlp", cfg.mlp, "gelu"),
            ("norm", cfg.norm, "layernorm"),
            ("n_kv_head", cfg.kv_heads, cfg.n_head),
        )
        if value != gpt2
    ]
    if differences:
        raise ValueError(
            f"this GPT is not GPT-2 architecture ({', '.join(differences)}), so it cannot be exported as a "
            f"Hugging Face GPT2LMHeadModel; use `consolidate` (lightning-3d consolidate CKPT_DIR OUT) for a dense "
            f"checkpoint that GPTModule.load_from_checkpoint loads."
        )


def gpt_to_gpt2(state: dict[str, Tensor], config: dict[str, Any]) -> tuple[Any, dict[str, Tensor]]:
    """Our GPT's weights as a ``transformers`` GPT2LMHeadModel (same architecture: pre-norm blocks,
    tanh-GELU MLP, learned positions, tied head)."""
    from transformers import GPT2Config

    from lightning_3d.models.gpt import GPTConfig

    cfg = GPTConfig(**config)
    _require_gpt2_architecture(cfg)
    hf = GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.block_size, n_embd=cfg.n_embd, n_layer=cfg.n_layer, n_head=cfg.n_head,
        n_inner=cfg.ffn_dim, activation_function="gelu_new", resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout,
        attn_pdrop=cfg.dropout, layer_norm_epsilon=1e-5, tie_word_embeddings=cfg.tie_embeddings,
        bos_token_id=None, eos_token_id=None,
    )

    def bias(name: str, size: int) -> Tensor:
        return state.get(name, torch.zeros(size))

    out = {"transformer.wte.weight": state["wte.weight"], "transformer.wpe.weight": state["wpe.weight"]}
    e, f = cfg.n_embd, cfg.ffn_dim
    for i in range(cfg.n_layer):
        src, dst = f"blocks.{i}.", f"transformer.h.{i}."
        for norm in ("ln_1", "ln_2"):
            out[f"{dst}{norm}.weight"] = state[f"{src}{norm}.weight"]
            out[f"{dst}{norm}.bias"] = bias(f"{src}{norm}.bias", e)
        qkv = [f"{src}attn.{p}_proj" for p in "qkv"]
        out[f"{dst}attn.c_attn.weight"] = torch.cat([state[f"{n}.weight"] for n in qkv]).t().contiguous()
        out[f"{dst}attn.c_attn.bias"] = torch.cat([bias(f"{n}.bias", e) for n in qkv])
        out[f"{dst}attn.c_proj.weight"] = state[f"{src}attn.o_proj.weight"].t().contiguous()
        out[f"{dst}attn.c_proj.bias"] = bias(f"{src}attn.o_proj.bias", e)
        out[f"{dst}mlp.c_fc.weight"] = state[f"{src}mlp.fc.weight"].t().contiguous()
        out[f"{dst}mlp.c_fc.bias"] = bias(f"{src}mlp.fc.bias", f)
        out[f"{dst}mlp.c_proj.weight"] = state[f"{src}mlp.proj.weight"].t().contiguous()
        out[f"{dst}mlp.c_proj.bias"] = bias(f"{src}mlp.proj.bias", e)
    out["transformer.ln_f.weight"] = state["ln_f.weight"]
    out["transformer.ln_f.bias"] = bias("ln_f.bias", e)
    out["lm_head.weight"] = state["lm_head.weight"] if "lm_head.weight" in state else state["wte.weight"]
    return hf, out


def export_hf(path: str, out_dir: str, prefix: str = "model.", hf_config: Optional[str] = None, dtype: Optional[str] = None) -> dict[str, Any]:
    """Write a ``from_pretrained``-loadable directory. ``hf_config`` (a config.json or a model
    directory) for Hugging Face models trained inside a LightningModule; without it the checkpoint
    must hold the reference GPT (``GPTModule``), exported as GPT-2."""
    import transformers

    checkpoint = ShardedCheckpoint(latest_complete(Path(path), fallback=False))
    state = _strip(dense_state_dict(checkpoint), prefix)
    if hf_config is not None:
        config = transformers.AutoConfig.from_pretrained(hf_config)
    else:
        hparams = checkpoint.meta().get("hyper_parameters", {})
        if "config" not in hparams:
            raise ValueError("this checkpoint is not of GPTModule: pass hf_config=<config.json of the Hugging Face model>.")
        config, state = gpt_to_gpt2(state, hparams["config"])
    model = transformers.AutoModelForCausalLM.from_config(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"export: the checkpoint does not match {type(model).__name__}: missing {missing}, unexpected {unexpected}.")
    if dtype is not None:
        model = model.to(DTYPES[dtype])
    model.save_pretrained(out_dir)
    return {"out": out_dir, "model": type(model).__name__, "parameters": sum(p.numel() for p in model.parameters())}
