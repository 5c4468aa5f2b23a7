"""Hugging Face ``Qwen2ForCausalLM``: Llama's architecture with biases on the q/k/v projections,
grouped-query attention, and an optional sliding window on some layers (``config.layer_types``).

The tensor-parallel split is Llama's (column-parallel q/k/v split their biases with their rows);
the pipeline differs only in the mask: a sliding-window layer gets the sliding causal mask HF's
``Qwen2Model.forward`` would build for it.
"""

from __future__ import annotations

import sys
from typing import Any

from torch import Tensor, nn

from lightning_3d.layout_rules import ModelDims
from lightning_3d.models.adapters.hf_common import (
    HFAdapter,
    _first,
    _hf_count,
    _hf_finalize,
    _hf_head,
    _hf_inputs,
    _hf_loss_of,
    _hf_mask,
    _hf_output,
    _hf_positions,
    _hf_with_loss,
    llama_like_dims,
    llama_like_shape,
)
from lightning_3d.models.adapters.llama import llama_styles
from lightning_3d.models.adapters.registry import register_adapter
from lightning_3d.pipeline.sequences import Inputs, LayerSequence
from lightning_3d.planner.model_shape import ModelShape
from lightning_3d.tensor_parallel.plans import TensorParallelPlan

SLIDING = "sliding_attention"


def _sliding_mask(model: nn.Module, batch: Inputs, hidden: Tensor) -> Any:
    """The sliding-window causal (and padding) mask of this micro-batch, built once per micro-batch
    and piece, with the arguments :func:`_hf_mask` gives the full causal mask."""
    if "_sliding_mask" not in batch:
        create = sys.modules[type(model).__module__].create_sliding_window_causal_mask
        batch["_sliding_mask"] = create(
            config=model.config,
            inputs_embeds=hidden,
            attention_mask=batch.get("attention_mask"),
            cache=None,
            position_ids=_hf_positions(batch, hidden),
        )
    return batch["_sliding_mask"]


def qwen2_sequence(model: nn.Module) -> LayerSequence:
    inner = model.model

    def block(layer: nn.Module, x: Tensor, batch: Inputs) -> Tensor:
        positions = _hf_positions(batch, x)
        if "_rope" not in batch:
            batch["_rope"] = inner.rotary_emb(x, position_ids=positions)
        sliding = getattr(layer.self_attn, "layer_type", None) == SLIDING
        mask = _sliding_mask(model, batch, x) if sliding else _hf_mask(model, batch, x)
        return _first(layer(x, attention_mask=mask, position_embeddings=batch["_rope"], position_ids=positions))

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


class Qwen2Adapter(HFAdapter):
    name = "qwen2"
    hf_model_types = ("qwen2",)
    class_name = "Qwen2ForCausalLM"

    def tp_plan(self, model: nn.Module) -> TensorParallelPlan:
        return TensorParallelPlan(
            name=self.class_name,
            styles=llama_styles(),
            check=self.check_tensor_parallel,
            finalize=_hf_finalize(model.config.vocab_size),
            supports_sequence_parallel=False,
        )

    def layer_sequence(self, model: nn.Module) -> LayerSequence:
        return qwen2_sequence(model)

    def dims(self, model: nn.Module) -> ModelDims:
        return llama_like_dims(model.config)

    def model_shape(self, model: nn.Module, seq_len: int) -> ModelShape:
        # ModelShape's ``bias`` means GPT-2's biases everywhere (MLP, norms); Qwen2's q/k/v biases
        # (hidden + 2 kv widths per layer, no FLOPs in GEMMs) are closer to none.
        return llama_like_shape(model.config, seq_len)


QWEN2 = register_adapter(Qwen2Adapter())
