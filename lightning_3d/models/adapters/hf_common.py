"""Glue shared by the Hugging Face families: matching by class, pipeline inputs/masks/head/output,
the plans' finalize step, shapes of Llama-like configs, and the identity export.

``transformers`` is imported only when a Hugging Face model or config is actually in use.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import Tensor, nn

from lightning_3d.core.layout_rules import ModelDims
from lightning_3d.core.model_shape import ModelShape
from lightning_3d.models.adapters import hf_moe
from lightning_3d.models.adapters.base import ExportTensor, ModelAdapter
from lightning_3d.models.adapters.hf_context_parallel import before_split, wire_context_parallel
from lightning_3d.models.adapters.hf_sequence import _with_loss, first_output, hf_inputs, hf_loss_inputs, hf_output, hf_target_count
from lightning_3d.pipeline.sequences import HeadOutput, Inputs, LayerSequence

if TYPE_CHECKING:
    from lightning_3d.context_parallel.apply import ContextParallel


# -- pipeline pieces of families with a sequence of their own (GPT-2) -------------------------------------------
def _hf_positions(batch: Inputs, hidden: Tensor) -> Tensor:
    """The micro-batch's ``position_ids`` if the batch has them, else ``0..T-1`` (as HF's forward)."""
    if "_positions" not in batch:
        given = batch.get("position_ids")
        batch["_positions"] = given if given is not None else torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
    return batch["_positions"]


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


def _hf_head(model: nn.Module, norm: nn.Module) -> Callable[[Tensor, Inputs], HeadOutput]:
    def head(x: Tensor, batch: Inputs) -> HeadOutput:
        logits = model.lm_head(norm(x))
        if batch["labels"] is None:
            return HeadOutput(logits=logits)
        loss = model.loss_function(  # shift_labels: shifted on whole sequences before a context-parallel cut
            logits=logits, labels=batch["labels"], vocab_size=model.config.vocab_size, shift_labels=batch.get("shift_labels")
        )
        return HeadOutput(loss=loss)

    return head


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
        inputs=hf_inputs,
        embed=embed,
        block=block,
        head=_hf_head(model, norm),
        target_count=hf_target_count,
        output=hf_output,
        loss_of=lambda out: getattr(out, "loss", None),
        with_loss=_with_loss,
        loss_inputs=hf_loss_inputs,
        before_split=before_split,
    )


# -- shapes --------------------------------------------------------------------------------------------------
CONFIG_LABELS = dict(
    n_layer="num_hidden_layers", hidden="hidden_size", n_head="num_attention_heads",
    n_kv_head="num_key_value_heads", ffn="intermediate_size",
)


def _config_int(c: Any, *names: str, default: Optional[int] = None) -> int:
    for name in names:
        value = getattr(c, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    if default is None:
        raise ValueError(f"{type(c).__name__} has none of {names}: lightning_3d cannot read the model's sizes.")
    return default


def config_dims(c: Any) -> ModelDims:
    """The sizes tensor and pipeline parallelism split, from a transformers config's standard fields
    (``attribute_map`` gives GPT-2- and NeoX-style configs the same names)."""
    hidden = _config_int(c, "hidden_size")
    heads = _config_int(c, "num_attention_heads")
    return ModelDims(
        _config_int(c, "num_hidden_layers"), hidden, heads, _config_int(c, "num_key_value_heads", default=heads),
        _config_int(c, "intermediate_size", "n_inner", "ffn_dim", default=4 * hidden), labels=dict(CONFIG_LABELS),
        # Mixtral, Qwen3-MoE, OLMoE (num_local_experts / num_experts), DeepSeek-V3 (n_routed_experts; its shared
        # experts' width, which tensor parallelism splits)
        n_experts=(experts := _config_int(c, "num_local_experts", "num_experts", "n_routed_experts", default=0)),
        shared_expert_width=_config_int(c, "n_shared_experts", default=0) * _config_int(c, "moe_intermediate_size", "intermediate_size") if experts else 0,
    )


def config_shape(model: nn.Module, seq_len: int) -> ModelShape:
    """The planner's description of a transformers decoder: sizes from its config, the MLP's kind,
    the norm and the position table from its modules (GPT-2-style biases only where the MLP has them)."""
    c = model.config
    dims = config_dims(c)
    names = [name for name, _ in model.named_modules()]
    classes = {type(m).__name__ for m in model.modules()}
    gated = any(n.endswith(("gate_proj", "gate_up_proj", "w1")) for n in names)
    mlp_bias = any(getattr(m, "bias", None) is not None for n, m in model.named_modules() if ".mlp." in n and isinstance(m, nn.Linear))
    return ModelShape(
        n_layer=dims.n_layer, hidden=dims.hidden, n_head=dims.n_head, n_kv_head=dims.n_kv_head, ffn=dims.ffn,
        vocab=_config_int(c, "vocab_size"), seq_len=seq_len, gated_mlp=gated,
        tied_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        learned_positions=any(n.endswith(("wpe", "embed_positions")) for n in names), bias=mlp_bias,
        dropout=max(float(getattr(c, k, 0.0) or 0.0) for k in ("attention_dropout", "hidden_dropout", "resid_pdrop")) > 0,
        rms_norm=any("RMSNorm" in k for k in classes),
        attention_head_dim=head_dim if isinstance(head_dim := getattr(c, "head_dim", None), int) and head_dim != dims.hidden // dims.n_head else None,
        **_moe_shape(model, dims),
    )


def _moe_shape(model: nn.Module, dims: ModelDims) -> dict[str, Any]:
    """A transformers MoE decoder's experts, for the FLOPs and memory counts: the blocks whose MLP has
    ``experts`` (Mixtral, Qwen3-MoE, OLMoE; DeepSeek-V3's dense first blocks have none), ``top_k``
    (``num_experts_per_tok``), the experts' width (``moe_intermediate_size``, else ``intermediate_size``)
    and shared experts (DeepSeek's ``n_shared_experts`` of that width)."""
    if not dims.n_experts:
        return {}
    c = model.config
    top_k = _config_int(c, "num_experts_per_tok", default=0)
    if not top_k:  # a family that names it otherwise: counted dense, as before (the MFU is then low, never a crash)
        return {}
    blocks = sum(1 for m in model.modules() if isinstance(getattr(m, "experts", None), nn.Module))
    return {
        "n_experts": dims.n_experts, "top_k": top_k, "n_shared_experts": _config_int(c, "n_shared_experts", default=0),
        "expert_ffn": _config_int(c, "moe_intermediate_size", "intermediate_size"),
        "moe_blocks": blocks or None,  # (no module named experts: every block, from the config)
    }


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

    def context_parallel(self, model: nn.Module, cp: Optional["ContextParallel"]) -> None:
        """transformers' attention interface and whole-sequence labels and positions
        (:mod:`~lightning_3d.models.adapters.hf_context_parallel`)."""
        wire_context_parallel(model, cp)

    # transformers' stacked experts (@use_experts_implementation), split by lightning_3d.moe's dispatch
    def moe_blocks(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        return hf_moe.moe_blocks(model)

    def expert_refusal(self, model: nn.Module, layout: Any) -> Optional[str]:
        return hf_moe.expert_refusal(model, layout)

    def apply_expert_parallel(self, model: nn.Module, **split: Any) -> int:
        return hf_moe.apply_expert_parallel(model, **split)

    def average_router_loss(self, model: nn.Module, replicas: Any, context_parallel: int) -> None:
        hf_moe.average_router_loss(model, replicas, context_parallel)

    def hf_export(self, model_config: Any) -> tuple[Any, list[ExportTensor]]:
        """The model's own state-dict keys (listed from a model built on the meta device), each from
        the tensor of the same name; the output embedding is left out when it is tied to the input's
        (``tie_word_embeddings``: ``from_pretrained`` re-ties it)."""
        import transformers

        config = hf_config(model_config, self.hf_model_types[0] if self.hf_model_types else "")
        if not self.builds_hf_model_type(config.model_type):
            raise ValueError(f"the {self.name!r} adapter does not export model_type {config.model_type!r}.")
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        skip: set[str] = set()
        output = model.get_output_embeddings()
        if getattr(config, "tie_word_embeddings", False) and output is not None:
            skip = {f"{name}.weight" for name, module in model.named_modules() if module is output}
        return config, [ExportTensor(key, (key,)) for key in model.state_dict() if key not in skip]
