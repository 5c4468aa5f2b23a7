"""Hugging Face Gemma 2 / Gemma 3: what their plans do not say.

Their input embedding is a ``ScaledWordEmbedding`` (an ``nn.Embedding`` whose output is multiplied
by ``sqrt(hidden)`` in the weights' dtype): split over the vocabulary like any embedding, with the
same scale applied after the parallel lookup, so the tied head can be vocabulary-parallel too.
Everything else (soft-capped logits, sliding layers' masks, per-layer-type rotary tables) is in the
models' own forward, which the generic sequence runs.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from lightning_3d.models.adapters.hf_generic import GenericHFAdapter
from lightning_3d.models.adapters.registry import register_adapter
from lightning_3d.tensor_parallel.plans import PlanContext, Style, StyleSpec, VocabEmbedding


class ScaledVocabEmbedding(Style):
    """``"vocab"`` for an embedding that multiplies its output by ``embed_scale``."""

    def apply(self, module: nn.Module, ctx: PlanContext) -> nn.Module:
        scale = float(module.scalar_embed_scale)
        plain = nn.Embedding(module.num_embeddings, module.embedding_dim, module.padding_idx, device=module.weight.device, dtype=module.weight.dtype)
        plain.weight = module.weight
        parallel = VocabEmbedding(split_sequence=False).apply(plain, ctx)  # (cut at the first layer under SP)
        parallel.register_forward_hook(
            lambda mod, args, out: out * torch.tensor(scale, device=out.device).to(out.dtype)  # as HF: scale in the weights' dtype
        )
        return parallel


class GemmaAdapter(GenericHFAdapter):
    name = "gemma"
    fallback = False
    hf_model_types = ("gemma2", "gemma3_text")

    def matches(self, module: nn.Module) -> bool:
        return super().matches(module) and getattr(getattr(module, "config", None), "model_type", None) in self.hf_model_types

    def builds_hf_model_type(self, model_type: str) -> bool:
        return model_type in self.hf_model_types

    def embedding_style(self, model: nn.Module) -> Optional[StyleSpec]:
        embedding = model.get_input_embeddings()
        return ScaledVocabEmbedding() if hasattr(embedding, "scalar_embed_scale") else None


GEMMA = register_adapter(GemmaAdapter())
