"""Tiny configs of the Hugging Face causal-LM families the suite trains (issue 31's acceptance).

Each is 4 layers (a V of two pipeline stages has four pieces), hidden 32, 4 heads (2 key/value heads where the family has GQA), vocabulary 128,
with the family's peculiarities switched on where they exist: sliding windows shorter than the
test sequence, Gemma's soft-capping and scaled embedding, Granite's multipliers, Qwen3 / Gemma 3's
per-head q/k norms, Phi-3's fused q/k/v, OLMo 2's norms over all heads, GPT-NeoX's fused
per-head q/k/v and partial rotary, StarCoder2's biases. OPT carries no transformers plans at all.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

VOCAB = 128
GQA = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=64)


def hf_family_config(kind: str) -> Any:
    import transformers as t

    configs = {
        "llama": lambda: t.LlamaConfig(**GQA, tie_word_embeddings=False),
        "mistral": lambda: t.MistralConfig(**GQA, sliding_window=8),
        "qwen2": lambda: t.Qwen2Config(**GQA, tie_word_embeddings=True, use_sliding_window=True, sliding_window=8, max_window_layers=1),
        "qwen3": lambda: t.Qwen3Config(**GQA, head_dim=8, tie_word_embeddings=True),
        "gemma2": lambda: t.Gemma2Config(**GQA, head_dim=8, sliding_window=8, query_pre_attn_scalar=8),
        "gemma3": lambda: t.Gemma3TextConfig(**GQA, head_dim=8, sliding_window=8, query_pre_attn_scalar=8),
        "phi3": lambda: t.Phi3Config(**GQA, pad_token_id=0, tie_word_embeddings=False),
        "olmo2": lambda: t.Olmo2Config(**GQA, pad_token_id=0, tie_word_embeddings=False),
        "granite": lambda: t.GraniteConfig(**GQA, embedding_multiplier=2.0, logits_scaling=4.0, residual_multiplier=0.5, attention_multiplier=0.2),
        "gpt2": lambda: t.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=4, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
        "gpt_neox": lambda: t.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                                            max_position_embeddings=64, rotary_pct=0.5, hidden_dropout=0.0, attention_dropout=0.0, tie_word_embeddings=False),
        "starcoder2": lambda: t.Starcoder2Config(**GQA, sliding_window=8, residual_dropout=0.0, embedding_dropout=0.0, attention_dropout=0.0),
        "opt": lambda: t.OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=4, num_attention_heads=4,
                                   max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0, pad_token_id=1),
        # mixture-of-experts families (issue 34): transformers' router and blocks, the experts through lightning_3d.moe
        "mixtral": lambda: t.MixtralConfig(**GQA, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0),
        "qwen3_moe": lambda: t.Qwen3MoeConfig(**GQA, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
        # a dense first layer among MoE blocks (mlp_only_layers): the plan's dense-MLP entries apply to it alone
        "qwen3_moe_dense_first": lambda: t.Qwen3MoeConfig(
            **GQA, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[0],
        ),
        # transformers' router loss in the model's loss (from the batch's statistics; weighted up so that it shows)
        "qwen3_moe_router_loss": lambda: t.Qwen3MoeConfig(
            **GQA, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, output_router_logits=True,
            router_aux_loss_coef=0.5,
        ),
        "olmoe": lambda: t.OlmoeConfig(**GQA, num_experts=4, num_experts_per_tok=2),
        "deepseek_v3": lambda: t.DeepseekV3Config(
            **GQA, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_group=1, topk_group=1,
            q_lora_rank=8, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, first_k_dense_replace=1,
        ),
    }
    return configs[kind]()


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "olmo2", "granite", "gpt2", "gpt_neox", "starcoder2")
NO_PLAN = ("opt",)
MOE_FAMILIES = ("mixtral", "qwen3_moe", "olmoe", "deepseek_v3")  # at every degree (docs/moe.md)
ROUTER_LOSS = "qwen3_moe_router_loss"  # an MoE family with transformers' router loss in its loss
DENSE_FIRST = "qwen3_moe_dense_first"  # an MoE model whose first block is dense


def make_family_checkpoint(kind: str, directory: Path, seed: int = 0) -> Path:
    """A seeded tiny model in Hugging Face's own format; norm weights moved off their init so a norm
    loaded or split wrong shows in the loss."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_family_config(kind))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name:
                p.add_(torch.randn_like(p) * 0.1)
    path = directory / kind
    model.save_pretrained(str(path))
    (path / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    return path
