"""Models as layer sequences: ``inputs -> embed -> blocks[0..n) -> head``.

This is the contract a model meets to be pipelined. Only one tensor (the hidden states) crosses
a stage boundary; everything else a piece needs (targets, positions, masks) is recomputed from
the batch, which every pipeline rank loads. Built-in sequences exist for the reference GPT and
Hugging Face ``LlamaForCausalLM`` / ``GPT2LMHeadModel``; a user's model declares its own by
defining ``pipeline_sequence(self) -> LayerSequence``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

Inputs = dict[str, Any]


@dataclass
class HeadOutput:
    loss: Optional[Tensor] = None  # mean over this micro-batch's counted targets
    logits: Optional[Tensor] = None


@dataclass
class LayerSequence:
    """How to run a model piece by piece.

    Args:
        blocks: the repeated layers (``hidden -> hidden``) that pipeline stages divide.
        blocks_name: their attribute path inside the model (unowned blocks are replaced by stubs).
        embed_modules / head_modules: module paths only the first / last stage needs.
        inputs: ``forward``'s ``(args, kwargs)`` -> named tensors (split along dim 0 into micro-batches).
        embed: named micro-batch inputs -> hidden states.
        block: ``(layer, hidden, inputs)`` -> hidden states.
        head: ``(hidden, inputs)`` -> :class:`HeadOutput` (the loss when targets are present).
        target_count: how many targets a micro-batch's loss averages over (weights micro-batch losses,
            so uneven micro-batches and ignored labels give the full-batch mean).
        output: ``(loss, logits)`` -> what ``forward`` returns at ``pipeline_parallel=1``.
        loss_of: what ``forward`` returned -> its loss (``None`` without targets).
        with_loss: ``(what forward returned, new loss)`` -> the same output carrying the new loss.
    """

    blocks: nn.ModuleList
    blocks_name: str
    embed_modules: tuple[str, ...]
    head_modules: tuple[str, ...]
    inputs: Callable[[tuple, dict], Inputs]
    embed: Callable[[Inputs], Tensor]
    block: Callable[[nn.Module, Tensor, Inputs], Tensor]
    head: Callable[[Tensor, Inputs], HeadOutput]
    target_count: Callable[[Inputs], int]
    output: Callable[[Optional[Tensor], Optional[Tensor]], Any]
    loss_of: Callable[[Any], Optional[Tensor]] = field(default=lambda out: _tensor_loss_of(out))
    with_loss: Callable[[Any, Tensor], Any] = field(default=lambda out, loss: loss)


def _tensor_loss_of(out: Any) -> Optional[Tensor]:
    """A forward that returns a 0-dim tensor with targets (a loss) and logits without."""
    return out if isinstance(out, Tensor) and out.dim() == 0 else None


def _arg(args: tuple, kwargs: dict, index: int, name: str) -> Any:
    return args[index] if len(args) > index else kwargs.get(name)


def gpt_sequence(model: nn.Module) -> LayerSequence:
    from lightning_3d.models.gpt import IGNORE_INDEX

    def inputs(args: tuple, kwargs: dict) -> Inputs:
        return {"input_ids": _arg(args, kwargs, 0, "input_ids"), "targets": _arg(args, kwargs, 1, "targets")}

    def head(x: Tensor, batch: Inputs) -> HeadOutput:
        out = model.head(x, batch["targets"])
        return HeadOutput(loss=out) if batch["targets"] is not None else HeadOutput(logits=out)

    return LayerSequence(
        blocks=model.blocks,
        blocks_name="blocks",
        # With rotary positions there is no wpe: positions enter inside each block's attention.
        embed_modules=("wte", "wpe", "drop") if model.config.position == "learned" else ("wte", "drop"),
        head_modules=("ln_f", "lm_head"),
        inputs=inputs,
        embed=lambda batch: model.embed(batch["input_ids"]),
        block=lambda layer, x, batch: layer(x),
        head=head,
        # the loss averages over the targets that are not masked: weigh micro-batches by those
        target_count=lambda batch: int((batch["targets"] != IGNORE_INDEX).sum()) if batch["targets"] is not None else 0,
        output=lambda loss, logits: loss if loss is not None else logits,
    )


def _hf_inputs(args: tuple, kwargs: dict) -> Inputs:
    """``input_ids``, ``labels`` (-100 ignored), ``attention_mask`` (1 = token, 0 = padding) and
    ``position_ids``: what supervised fine-tuning batches carry. Each is split along the batch with
    the micro-batches, and each piece rebuilds the mask and positions of its micro-batch exactly as
    the Hugging Face model's own forward does, so padding gives the one-process result."""
    known = {"input_ids", "labels", "attention_mask", "position_ids", "use_cache"}
    unsupported = {k for k, v in kwargs.items() if v is not None} - known
    if unsupported:
        raise NotImplementedError(
            f"pipelined Hugging Face models take {sorted(known - {'use_cache'})}; got {sorted(unsupported)}. "
            f"Compute other inputs inside the model, or use pipeline_parallel=1."
        )
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.dim() != 2:
        raise ValueError(
            f"pipelined Hugging Face models take a 2-D attention_mask [batch, sequence] (1 = token, 0 = padding); "
            f"got shape {tuple(mask.shape)}. Pass the tokenizer's padding mask, not a 4-D attention bias."
        )
    return {
        "input_ids": _arg(args, kwargs, 0, "input_ids"),
        "labels": kwargs.get("labels"),
        "attention_mask": mask,
        "position_ids": kwargs.get("position_ids"),
    }


def _hf_positions(batch: Inputs, hidden: Tensor) -> Tensor:
    """The micro-batch's ``position_ids`` if the batch has them, else ``0..T-1`` (as HF's forward)."""
    if "_positions" not in batch:
        given = batch.get("position_ids")
        batch["_positions"] = given if given is not None else torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
    return batch["_positions"]


def _hf_mask(model: nn.Module, batch: Inputs, hidden: Tensor) -> Any:
    """The causal (and padding) mask HF's forward would build for this micro-batch, built once per
    micro-batch and piece."""
    if "_mask" not in batch:
        create = sys.modules[type(model).__module__].create_causal_mask
        batch["_mask"] = create(
            config=model.config,
            inputs_embeds=hidden,
            attention_mask=batch.get("attention_mask"),
            cache=None,
            position_ids=_hf_positions(batch, hidden),
        )
    return batch["_mask"]


def _hf_count(batch: Inputs) -> int:
    labels = batch["labels"]
    return int((labels[..., 1:] != -100).sum()) if labels is not None else 0


def _hf_head(model: nn.Module, norm: nn.Module) -> Callable[[Tensor, Inputs], HeadOutput]:
    def head(x: Tensor, batch: Inputs) -> HeadOutput:
        logits = model.lm_head(norm(x))
        if batch["labels"] is None:
            return HeadOutput(logits=logits)
        return HeadOutput(loss=model.loss_function(logits=logits, labels=batch["labels"], vocab_size=model.config.vocab_size))

    return head


def _hf_output(loss: Optional[Tensor], logits: Optional[Tensor]) -> Any:
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return CausalLMOutputWithPast(loss=loss, logits=logits)


def _hf_loss_of(out: Any) -> Optional[Tensor]:
    return getattr(out, "loss", None)


def _hf_with_loss(out: Any, loss: Tensor) -> Any:
    out.loss = loss
    return out


def _first(out: Any) -> Tensor:
    return out[0] if isinstance(out, tuple) else out


def llama_sequence(model: nn.Module) -> LayerSequence:
    inner = model.model

    def block(layer: nn.Module, x: Tensor, batch: Inputs) -> Tensor:
        positions = _hf_positions(batch, x)
        if "_rope" not in batch:
            batch["_rope"] = inner.rotary_emb(x, position_ids=positions)
        return _first(layer(x, attention_mask=_hf_mask(model, batch, x), position_embeddings=batch["_rope"], position_ids=positions))

    return LayerSequence(
        blocks=inner.layers,
        blocks_name="model.layers",
        embed_modules=("model.embed_tokens",),
        head_modules=("model.norm", "lm_head"),
        inputs=_hf_inputs,
        embed=lambda batch: inner.embed_tokens(batch["input_ids"]),
        block=block,
        head=_hf_head(model, inner.norm),
        target_count=_hf_count,
        output=_hf_output,
        loss_of=_hf_loss_of,
        with_loss=_hf_with_loss,
    )


def gpt2_sequence(model: nn.Module) -> LayerSequence:
    inner = model.transformer

    def embed(batch: Inputs) -> Tensor:
        embeds = inner.wte(batch["input_ids"])
        return inner.drop(embeds + inner.wpe(_hf_positions(batch, embeds)))

    def block(layer: nn.Module, x: Tensor, batch: Inputs) -> Tensor:
        return _first(layer(x, None, _hf_mask(model, batch, x), position_ids=_hf_positions(batch, x)))

    return LayerSequence(
        blocks=inner.h,
        blocks_name="transformer.h",
        embed_modules=("transformer.wte", "transformer.wpe", "transformer.drop"),
        head_modules=("transformer.ln_f", "lm_head"),
        inputs=_hf_inputs,
        embed=embed,
        block=block,
        head=_hf_head(model, inner.ln_f),
        target_count=_hf_count,
        output=_hf_output,
        loss_of=_hf_loss_of,
        with_loss=_hf_with_loss,
    )


def builtin_sequence(module: nn.Module) -> Optional[LayerSequence]:
    """The layer sequence of a supported model (HF classes matched by name, no import)."""
    from lightning_3d.models.gpt import GPT

    declared = getattr(module, "pipeline_sequence", None)
    if callable(declared):
        return declared()
    if isinstance(module, GPT):
        return gpt_sequence(module)
    builder = {"LlamaForCausalLM": llama_sequence, "GPT2LMHeadModel": gpt2_sequence}.get(type(module).__name__)
    return builder(module) if builder is not None else None


def find_sequences(root: nn.Module) -> list[tuple[str, nn.Module, LayerSequence]]:
    """(name, module, sequence) for the outermost pipelinable models inside ``root``."""
    found: list[tuple[str, nn.Module, LayerSequence]] = []
    for name, module in root.named_modules():
        if any(name.startswith(prefix + ".") or prefix == "" for prefix, _, _ in found):
            continue
        sequence = builtin_sequence(module)
        if sequence is not None:
            found.append((name, module, sequence))
    return found
