"""Glue shared by the Hugging Face families: matching by class, pipeline inputs/masks/head/output,
the plans' finalize step, shapes of Llama-like configs, and the identity export.

``transformers`` is imported only when a Hugging Face model or config is actually in use.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from lightning_3d.layout_rules import ModelDims
from lightning_3d.models.adapters.base import ExportTensor, ModelAdapter
from lightning_3d.pipeline.sequences import HeadOutput, Inputs, LayerSequence
from lightning_3d.planner.model_shape import ModelShape
from lightning_3d.tensor_parallel.cross_entropy import CausalLMLoss
from lightning_3d.tensor_parallel.plans import PlanContext, gather_logits_hook


# -- pipeline pieces (LayerSequence callables) -----------------------------------------------------------------
def _arg(args: tuple, kwargs: dict, index: int, name: str) -> Any:
    return args[index] if len(args) > index else kwargs.get(name)


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


def _hf_labels(args: tuple, kwargs: dict) -> Inputs:
    """The labels, whatever else an unpipelined HF forward is given (for the dp loss weighting)."""
    return {"labels": kwargs.get("labels")}


def _hf_positions(batch: Inputs, hidden: Tensor) -> Tensor:
    """The micro-batch's ``position_ids`` if the batch has them, else ``0..T-1`` (as HF's forward)."""
    if "_positions" not in batch:
        given = batch.get("position_ids")
        batch["_positions"] = given if given is not None else torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
    return batch["_positions"]


SLIDING = "sliding_attention"  # HF's layer_type of a sliding-window attention layer (Qwen2, Mistral)


def _hf_mask(model: nn.Module, batch: Inputs, hidden: Tensor, builder: str = "create_causal_mask") -> Any:
    """The causal (and padding) mask HF's forward would build for this micro-batch with ``builder``
    from the model's module (``create_sliding_window_causal_mask`` for sliding-window layers), built
    once per micro-batch, piece and builder."""
    key = f"_mask/{builder}"
    if key not in batch:
        create = getattr(sys.modules[type(model).__module__], builder)
        batch[key] = create(
            config=model.config,
            inputs_embeds=hidden,
            attention_mask=batch.get("attention_mask"),
            cache=None,
            position_ids=_hf_positions(batch, hidden),
        )
    return batch[key]


def _layer_mask(model: nn.Module, layer: nn.Module, batch: Inputs, hidden: Tensor) -> Any:
    """The mask of one decoder layer: sliding-window layers get the sliding causal mask."""
    sliding = getattr(getattr(layer, "self_attn", None), "layer_type", None) == SLIDING
    return _hf_mask(model, batch, hidden, "create_sliding_window_causal_mask" if sliding else "create_causal_mask")


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


# -- tensor parallel -------------------------------------------------------------------------------------------
def hf_layer_sequence(
    model: nn.Module,
    *,
    blocks: nn.ModuleList,
    blocks_name: str,
    embed_modules: tuple[str, ...],
    head_modules: tuple[str, ...],
    embed: Callable[[Inputs], Tensor],
    block: Callable[[nn.Module, Tensor, Inputs], Tensor],
    norm: nn.Module,
) -> LayerSequence:
    """A Hugging Face causal LM's layer sequence: the family gives its modules, embedding and block
    call; inputs, the head (final norm, ``lm_head``, HF's loss), target counts and outputs are common."""
    return LayerSequence(
        blocks=blocks,
        blocks_name=blocks_name,
        embed_modules=embed_modules,
        head_modules=head_modules,
        inputs=_hf_inputs,
        embed=embed,
        block=block,
        head=_hf_head(model, norm),
        target_count=_hf_count,
        output=_hf_output,
        loss_of=_hf_loss_of,
        with_loss=_hf_with_loss,
        loss_inputs=_hf_labels,
    )


def _hf_finalize(vocab_size: int) -> Callable[[nn.Module, PlanContext], None]:
    """After the plan: the loss becomes vocab-parallel (``model.loss_function``, what HF's forward
    calls) and logits returned without labels are gathered to the full vocabulary."""

    def finalize(m: nn.Module, ctx: PlanContext) -> None:
        m.loss_function = CausalLMLoss(ctx.tp_group, vocab_size)
        m.register_forward_hook(gather_logits_hook(vocab_size, ctx))

    return finalize


# -- shapes --------------------------------------------------------------------------------------------------
LLAMA_LABELS = dict(
    n_layer="num_hidden_layers", hidden="hidden_size", n_head="num_attention_heads",
    n_kv_head="num_key_value_heads", ffn="intermediate_size",
)


def llama_like_dims(c: Any) -> ModelDims:
    """Llama-shaped configs (Llama, Qwen2, Mistral, ...): the sizes tensor and pipeline parallelism split."""
    return ModelDims(
        c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads or c.num_attention_heads,
        c.intermediate_size, labels=dict(LLAMA_LABELS),
    )


def llama_like_shape(c: Any, seq_len: int) -> ModelShape:
    """The planner's description of a Llama-shaped config: SwiGLU (three ffn matrices), RMSNorm,
    rotary positions (no position table), no biases."""
    return ModelShape(
        n_layer=c.num_hidden_layers,
        hidden=c.hidden_size,
        n_head=c.num_attention_heads,
        n_kv_head=c.num_key_value_heads or c.num_attention_heads,
        ffn=c.intermediate_size,
        vocab=c.vocab_size,
        seq_len=seq_len,
        gated_mlp=True,
        tied_embeddings=bool(c.tie_word_embeddings),
        learned_positions=False,
        bias=False,
        dropout=float(getattr(c, "attention_dropout", 0.0) or 0.0) > 0,
        rms_norm=True,
    )


# -- the adapter base of Hugging Face families ---------------------------------------------------------------
def hf_config(model_config: Any, model_type: str) -> Any:
    """A ``transformers`` config object from a config object or its dict (``config.to_dict()``)."""
    if not isinstance(model_config, dict):
        return model_config
    from transformers import AutoConfig

    values = {k: v for k, v in model_config.items() if k != "model_type"}
    return AutoConfig.for_model(model_config.get("model_type", model_type), **values)


class HFAdapter(ModelAdapter):
    """A Hugging Face causal LM family, recognized by its class (``class_name``, defined in a
    ``transformers`` module; subclasses match too) without importing ``transformers``."""

    class_name: str = ""

    def matches(self, module: nn.Module) -> bool:
        return any(
            c.__name__ == self.class_name and c.__module__.startswith("transformers.") for c in type(module).__mro__
        )

    def hf_export(self, model_config: Any) -> tuple[Any, list[ExportTensor]]:
        """The model's own state-dict keys (listed from a model built on the meta device), each from
        the tensor of the same name; the output embedding is left out when it is tied to the input's
        (``tie_word_embeddings``: ``from_pretrained`` re-ties it)."""
        import transformers

        config = hf_config(model_config, self.hf_model_types[0])
        if config.model_type not in self.hf_model_types:
            raise ValueError(f"the {self.name!r} adapter exports model_type {self.hf_model_types}, not {config.model_type!r}.")
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        skip: set[str] = set()
        output = model.get_output_embeddings()
        if getattr(config, "tie_word_embeddings", False) and output is not None:
            skip = {f"{name}.weight" for name, module in model.named_modules() if module is output}
        return config, [ExportTensor(key, (key,)) for key in model.state_dict() if key not in skip]
