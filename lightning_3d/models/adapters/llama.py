"""Hugging Face ``LlamaForCausalLM``: grouped-query attention, SwiGLU, RMSNorm, rotary positions."""

from __future__ import annotations

from torch import Tensor, nn

from lightning_3d.layout_rules import ModelDims
from lightning_3d.models.adapters.hf_common import (
    HFAdapter,
    _first,
    _hf_finalize,
    _hf_positions,
    _layer_mask,
    hf_layer_sequence,
    llama_like_dims,
    llama_like_shape,
)
from lightning_3d.models.adapters.registry import register_adapter
from lightning_3d.pipeline.sequences import Inputs, LayerSequence
from lightning_3d.planner.model_shape import ModelShape
from lightning_3d.tensor_parallel.plans import StyleSpec, TensorParallelPlan


def llama_styles(prefix: str = "model.layers.*") -> dict[str, StyleSpec]:
    """Megatron's split of a Llama-shaped decoder: q/k/v (and their biases, if any) column-parallel
    in head order, o row-parallel; gate/up column-parallel behind one input collective, down
    row-parallel. Grouped-query attention needs nothing more: a rank's query heads are exactly the
    ones its key/value heads serve (heads are split in order). Attention-probability dropout
    happens inside ``self_attn``, on this rank's heads."""
    return {
        "model.embed_tokens": "vocab",
        f"{prefix}.self_attn": ["prepare_input", "rng"],
        f"{prefix}.self_attn.q_proj": "column_prepared",
        f"{prefix}.self_attn.k_proj": "column_prepared",
        f"{prefix}.self_attn.v_proj": "column_prepared",
        f"{prefix}.self_attn.o_proj": "row",
        f"{prefix}.mlp": "prepare_input",
        f"{prefix}.mlp.gate_proj": "column_prepared",
        f"{prefix}.mlp.up_proj": "column_prepared",
        f"{prefix}.mlp.down_proj": "row",
        "lm_head": "vocab_head",
    }


def llama_sequence(model: nn.Module) -> LayerSequence:
    """Llama-shaped decoders (Llama, Qwen2, Mistral): rotary positions computed once per micro-batch
    and piece; each layer gets HF's causal mask, or the sliding-window one if it is a sliding layer."""
    inner = model.model

    def block(layer: nn.Module, x: Tensor, batch: Inputs) -> Tensor:
        positions = _hf_positions(batch, x)
        if "_rope" not in batch:
            batch["_rope"] = inner.rotary_emb(x, position_ids=positions)
        mask = _layer_mask(model, layer, batch, x)
        return _first(layer(x, attention_mask=mask, position_embeddings=batch["_rope"], position_ids=positions))

    return hf_layer_sequence(
        model,
        blocks=inner.layers,
        blocks_name="model.layers",
        embed_modules=("model.embed_tokens",),
        head_modules=("model.norm", "lm_head"),
        embed=lambda batch: inner.embed_tokens(batch["input_ids"]),
        block=block,
        norm=inner.norm,
    )


class LlamaAdapter(HFAdapter):
    name = "llama"
    hf_model_types = ("llama",)
    class_name = "LlamaForCausalLM"

    def tp_plan(self, model: nn.Module) -> TensorParallelPlan:
        return TensorParallelPlan(
            name=self.class_name,
            styles=llama_styles(),
            check=self.check_tensor_parallel,
            finalize=_hf_finalize(model.config.vocab_size),
            supports_sequence_parallel=False,
        )

    def layer_sequence(self, model: nn.Module) -> LayerSequence:
        return llama_sequence(model)

    def dims(self, model: nn.Module) -> ModelDims:
        return llama_like_dims(model.config)

    def model_shape(self, model: nn.Module, seq_len: int) -> ModelShape:
        return llama_like_shape(model.config, seq_len)


LLAMA = register_adapter(LlamaAdapter())
