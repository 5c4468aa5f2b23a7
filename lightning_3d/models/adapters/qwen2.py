"""Hugging Face ``Qwen2ForCausalLM``: Llama's architecture with biases on the q/k/v projections,
grouped-query attention, and an optional sliding window on some layers (``config.layer_types``).

Everything is Llama's: the tensor-parallel split (column-parallel q/k/v split their biases with
their rows) and the pipeline pieces, which give a sliding-window layer the sliding causal mask
HF's ``Qwen2Model.forward`` builds for it. What differs is the class and the model type.
"""

from __future__ import annotations

from torch import nn

from lightning_3d.models.adapters.llama import LlamaAdapter
from lightning_3d.models.adapters.registry import register_adapter
from lightning_3d.planner.model_shape import ModelShape


class Qwen2Adapter(LlamaAdapter):
    name = "qwen2"
    hf_model_types = ("qwen2",)
    class_name = "Qwen2ForCausalLM"

    def model_shape(self, model: nn.Module, seq_len: int) -> ModelShape:
        # ModelShape's ``bias`` means GPT-2's biases everywhere (MLP, norms); Qwen2's q/k/v biases
        # (hidden + 2 kv widths per layer, no FLOPs in GEMMs) are closer to none: Llama's shape.
        return super().model_shape(model, seq_len)


QWEN2 = register_adapter(Qwen2Adapter())
