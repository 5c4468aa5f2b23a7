"""Context parallelism for Hugging Face causal LMs, through transformers' own attention interface.

Three things differ from one process when each cp rank holds only its chunks of every sequence,
and each is handled where the model would otherwise see the cut:

* **the label shift**: HF's loss shifts labels by one inside the model, which at every chunk edge
  would pair a token with a target from another rank. Before the split the labels are shifted on
  the whole sequence and passed as ``shift_labels`` (HF's loss and our vocabulary-parallel one take
  them as they are); ``labels`` still travels so the model computes its loss.
* **positions**: ``position_ids`` are made explicit (``0..T-1``) before the split, so each rank's
  rotary tables (or GPT-2's learned positions) are the true ones of its tokens.
* **attention**: an attention function registered with transformers (``AttentionInterface``) under
  :data:`ATTENTION` attends each local query over the whole sequence through the cp group (ring or
  all-to-all, :class:`~lightning_3d.context_parallel.apply.ContextParallel`), with the module's own
  ``scaling``, sliding window and soft cap. transformers builds no mask for a custom
  implementation; causality is the kernels', so a padding mask is refused (one host read, only when
  a mask is passed).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

if TYPE_CHECKING:
    from lightning_3d.context_parallel.apply import ContextParallel

ATTENTION = "lightning_3d_context_parallel"
# attention-function arguments that change what attention computes and that the cp kernels do not take
UNSUPPORTED_KWARGS = ("s_aux", "sinks", "position_bias", "attention_chunk_size", "chunk_size", "attn_bias")
CP_ATTR = "_lightning_3d_context_parallel"
SAVED_ATTR = "_lightning_3d_attn_implementation"


def context_parallel_attention(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor], dropout: float = 0.0,
    scaling: Optional[float] = None, sliding_window: Optional[int] = None, softcap: Optional[float] = None, **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-function contract: q (B, heads, T_local, d), k/v (B, kv_heads,
    T_local, d) -> (output (B, T_local, heads, d), no weights)."""
    cp: Optional[ContextParallel] = getattr(module, CP_ATTR, None)
    if cp is None:
        raise RuntimeError(
            f"{type(module).__name__} calls lightning_3d's context-parallel attention outside a context-parallel set-up; "
            f"set the model's attn_implementation back (e.g. 'sdpa')."
        )
    unknown = sorted(k for k, v in kwargs.items() if v is not None and k in UNSUPPORTED_KWARGS)
    if unknown or kwargs.get("is_causal") is False:
        raise ValueError(
            f"context_parallel={cp.size}: {type(module).__name__} asks its attention for {unknown or ['is_causal=False']} "
            f"(attention sinks, position biases, chunks or bidirectional attention), which context-parallel attention "
            f"does not compute; use context_parallel=1."
        )
    total = query.shape[2] * cp.size
    window = sliding_window if sliding_window is not None and sliding_window < total else None
    out = cp.attention(query, key, value, dropout, scale=scaling, window=window, softcap=softcap)
    return out.transpose(1, 2).contiguous(), None


def before_split(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Whole-sequence inputs made explicit before the cut (see the module docstring)."""
    ids = args[0] if args else kwargs.get("input_ids")
    if not isinstance(ids, Tensor) or ids.dim() != 2:
        return args, kwargs
    batch, length = ids.shape
    mask = kwargs.get("attention_mask")
    if mask is not None:
        padded = (~mask.bool()).any().to(torch.int32).reshape(1)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(padded, op=dist.ReduceOp.MAX)  # every rank refuses together (none waits in a collective)
        if bool(padded.item()):
            raise ValueError(
                "context parallelism takes no padding mask (attention is causal over whole sequences on every rank): "
                "pack sequences to full length, or use context_parallel=1 for padded batches."
            )
        kwargs["attention_mask"] = None
    if kwargs.get("position_ids") is None:
        kwargs["position_ids"] = torch.arange(length, device=ids.device).unsqueeze(0).expand(batch, length)
    labels = kwargs.get("labels")
    if labels is not None and kwargs.get("shift_labels") is None:
        kwargs["shift_labels"] = F.pad(labels[:, 1:], (0, 1), value=-100)
    return args, kwargs


def _source(cls: type) -> str:
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return ""


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    """The decoder layers' attention modules (``self_attn`` / ``attn`` / ``attention``)."""
    out = []
    for module in model.modules():
        for name in ("self_attn", "attn", "attention"):
            child = getattr(module, name, None)
            if isinstance(child, nn.Module) and child is not module and child not in out:
                out.append(child)
    return out


def _windows(config: Any) -> tuple[bool, bool]:
    """(sliding layers, chunked layers) the config declares."""
    types = set(getattr(config, "layer_types", None) or ())
    sliding = "sliding_attention" in types or (
        not types and getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)
    )
    chunked = "chunked_attention" in types or getattr(config, "attention_chunk_size", None) is not None
    return sliding, chunked


def _refusals(model: nn.Module, cp: "ContextParallel") -> list[str]:
    config = model.config
    out = []
    attentions = _attention_modules(model)
    sources = {type(a): _source(type(a)) for a in attentions}
    own = sorted({c.__name__ for c, src in sources.items() if "ALL_ATTENTION_FUNCTIONS" not in src and "attention_interface" not in src})
    if not attentions or own:
        out.append(
            f"attention modules {own or '(none found)'} that compute attention themselves instead of through "
            f"transformers' attention interface, which is where context parallelism attends over the whole sequence"
        )
    passes_window = all("sliding_window" in src for src in sources.values())
    sliding, chunked = _windows(config)
    if chunked:
        out.append("chunked attention layers (attention_chunk_size / layer_types), which context-parallel attention has not")
    if sliding and not passes_window:
        out.append("sliding-window layers whose window is only in their mask, which context-parallel attention never sees")
    elif sliding and cp.mode == "ring":
        out.append(
            f"sliding-window layers (sliding_window={getattr(config, 'sliding_window', None)}), which the ring cannot "
            f"compute (its blocks are causal or full); context_parallel_mode='all_to_all' computes them (or set "
            f"sliding_window=None if the window is at least the sequence length)"
        )
    if any("s_aux" in src or "sinks" in src for src in sources.values()):
        out.append("attention sinks, which context-parallel attention has not")
    for name in ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob"):
        rate = float(getattr(config, name, 0.0) or 0.0)
        if rate > 0:
            out.append(f"its {name}={rate} applies dropout to attention probabilities, which context-parallel attention has not (set it to 0.0)")
    if getattr(config, "use_bidirectional_attention", False):
        out.append("its use_bidirectional_attention=True asks for attention in both directions; context-parallel attention is causal")
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None and cp.mode == "ring":
        out.append(
            f"its attn_logit_softcapping={softcap} soft-caps attention scores, which the ring cannot (its blocks merge raw "
            f"scores); context_parallel_mode='all_to_all' computes it"
        )
    return out


def wire_context_parallel(model: nn.Module, cp: Optional["ContextParallel"]) -> None:
    """Point ``model``'s attention at the cp group (``cp=None``: its own implementation again)."""
    if cp is None:
        if hasattr(model, SAVED_ATTR):
            model.config._attn_implementation = getattr(model, SAVED_ATTR)
            delattr(model, SAVED_ATTR)
            for module in model.modules():
                if hasattr(module, CP_ATTR):
                    delattr(module, CP_ATTR)
        return
    reasons = _refusals(model, cp)
    if reasons:
        raise ValueError(f"context_parallel={cp.size} cannot run {type(model).__name__}: " + "; ".join(reasons) + ". Or use context_parallel=1.")
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, context_parallel_attention)
    if not hasattr(model, SAVED_ATTR):
        setattr(model, SAVED_ATTR, model.config._attn_implementation)
    model.config._attn_implementation = ATTENTION
    for module in model.modules():
        setattr(module, CP_ATTR, cp)
