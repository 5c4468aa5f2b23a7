"""Hugging Face ``GPT2LMHeadModel``: learned positions, fused q/k/v (``Conv1D`` ``c_attn``), GELU MLP."""

from __future__ import annotations

from torch import Tensor, nn

from lightning_3d.core.layout_rules import ModelDims
from lightning_3d.core.model_shape import ModelShape
from lightning_3d.models.adapters.hf_common import HFAdapter, _hf_mask, _hf_positions, hf_layer_sequence
from lightning_3d.models.adapters.hf_plans import vocab_parallel_loss
from lightning_3d.models.adapters.hf_sequence import first_output
from lightning_3d.models.adapters.registry import register_adapter
from lightning_3d.pipeline.sequences import Inputs, LayerSequence
from lightning_3d.tensor_parallel.plans import Column, DivideAttributes, TensorParallelPlan


def gpt2_sequence(model: nn.Module) -> LayerSequence:
    inner = model.transformer

    def embed(batch: Inputs) -> Tensor:
        embeds = inner.wte(batch["input_ids"])
        return inner.drop(embeds + inner.wpe(_hf_positions(batch, embeds)))

    def block(layer: nn.Module, x: Tensor, batch: Inputs) -> Tensor:
        return first_output(layer(x, None, _hf_mask(model, batch, x), position_ids=_hf_positions(batch, x)))

    return hf_layer_sequence(
        model,
        blocks=inner.h,
        blocks_name="transformer.h",
        embed_modules=("transformer.wte", "transformer.wpe", "transformer.drop"),
        head_modules=("transformer.ln_f", "lm_head"),
        embed=embed,
        block=block,
        norm=inner.ln_f,
    )


class GPT2Adapter(HFAdapter):
    name = "gpt2"
    hf_model_types = ("gpt2",)
    class_name = "GPT2LMHeadModel"

    def tp_plan(self, model: nn.Module) -> TensorParallelPlan:
        return TensorParallelPlan(
            name=self.class_name,
            styles={
                "transformer.wte": "vocab",
                # attention-probability dropout (eager or SDPA) is inside attn, on this rank's heads; the
                # residual dropout after c_proj's all-reduce is replicated
                "transformer.h.*.attn": [DivideAttributes(("split_size", "num_heads", "embed_dim")), "rng"],
                "transformer.h.*.attn.resid_dropout": "replicated_rng",
                "transformer.h.*.attn.c_attn": Column(num_blocks=3),
                "transformer.h.*.attn.c_proj": "row",
                "transformer.h.*.mlp.c_fc": "column",
                "transformer.h.*.mlp.c_proj": "row",
                "lm_head": "vocab_head",
            },
            check=self.check_tensor_parallel,
            finalize=vocab_parallel_loss(model.config.vocab_size),
            supports_sequence_parallel=False,
        )

    def layer_sequence(self, model: nn.Module) -> LayerSequence:
        return gpt2_sequence(model)

    def dims(self, model: nn.Module) -> ModelDims:
        c = model.config
        return ModelDims(
            c.n_layer, c.n_embd, c.n_head, c.n_head, _ffn(c),
            labels=dict(n_layer="n_layer", hidden="n_embd", n_head="n_head", n_kv_head="n_head", ffn="n_inner"),
        )

    def model_shape(self, model: nn.Module, seq_len: int) -> ModelShape:
        c = model.config
        return ModelShape(
            n_layer=c.n_layer, hidden=c.n_embd, n_head=c.n_head, n_kv_head=c.n_head, ffn=_ffn(c), vocab=c.vocab_size,
            seq_len=seq_len, gated_mlp=False, tied_embeddings=bool(c.tie_word_embeddings), learned_positions=True,
            bias=True, dropout=max(c.resid_pdrop, c.embd_pdrop, c.attn_pdrop) > 0, rms_norm=False,
        )


def _ffn(c: object) -> int:
    inner = getattr(c, "n_inner", None)
    return inner if inner is not None else 4 * c.n_embd  # type: ignore[attr-defined]


GPT2 = register_adapter(GPT2Adapter())
