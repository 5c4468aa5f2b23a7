"""What the planner needs to know about a decoder-only transformer: sizes, parameters, FLOPs.

Built from the same keys as :class:`~lightning_3d.models.gpt.GPTConfig` (``conf/model/*.yaml``),
so a recipe's model and the planner's model are one description.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional


@dataclass(frozen=True)
class ModelShape:
    n_layer: int
    hidden: int
    n_head: int
    n_kv_head: int
    ffn: int
    vocab: int
    seq_len: int
    gated_mlp: bool = False  # SwiGLU: three ffn matrices instead of two
    tied_embeddings: bool = True
    learned_positions: bool = True
    bias: bool = True
    dropout: bool = False  # dropout > 0: masks are kept for backward
    rms_norm: bool = False  # RMSNorm (torch's keeps its input and the normalized input)
    attention_head_dim: Optional[int] = None  # a head width other than hidden / n_head (Gemma, Qwen3)

    @classmethod
    def from_config(cls, config: Mapping[str, Any], seq_len: int | None = None) -> "ModelShape":
        """From ``GPTConfig`` fields; ``seq_len`` defaults to the model's ``block_size``."""
        hidden, n_head = int(config["n_embd"]), int(config["n_head"])
        if hidden % n_head:
            raise ValueError(f"model: n_embd={hidden} is not divisible by n_head={n_head}.")
        n_kv = int(config.get("n_kv_head") or n_head)
        if n_head % n_kv:
            raise ValueError(f"model: n_kv_head={n_kv} must divide n_head={n_head}.")
        return cls(
            n_layer=int(config["n_layer"]),
            hidden=hidden,
            n_head=n_head,
            n_kv_head=n_kv,
            ffn=int(config.get("ffn_hidden") or 4 * hidden),
            vocab=int(config["vocab_size"]),
            seq_len=int(seq_len or config["block_size"]),
            gated_mlp=config.get("mlp", "gelu") == "swiglu",
            tied_embeddings=bool(config.get("tie_embeddings", True)),
            learned_positions=config.get("position", "learned") == "learned",
            bias=bool(config.get("bias", True)),
            dropout=float(config.get("dropout", 0.0) or 0.0) > 0,
            rms_norm=config.get("norm", "layernorm") == "rmsnorm",
        )

    @property
    def labels(self) -> dict[str, str]:
        """The config keys (``conf/model/*.yaml``) behind each size, for messages that name them."""
        return {
            "n_layer": "model.n_layer",
            "hidden": "model.n_embd",
            "n_head": "model.n_head",
            "n_kv_head": "model.n_kv_head",
            "ffn": "model.ffn_hidden",
            "seq_len": "model.block_size or --seq-len",
        }

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.hidden // self.n_head

    @property
    def kv_width(self) -> int:
        return self.n_kv_head * self.head_dim

    @property
    def q_width(self) -> int:
        """The query (and attention output) width: the hidden size unless heads are wider or narrower."""
        return self.n_head * self.head_dim

    @property
    def layer_matmul_params(self) -> int:
        """Weights that take part in GEMMs: q, o (h x q width), k, v (h x kv), the MLP matrices."""
        h = self.hidden
        return 2 * h * self.q_width + 2 * h * self.kv_width + (3 if self.gated_mlp else 2) * h * self.ffn

    @property
    def layer_sharded_params(self) -> int:
        """A layer's parameters that tensor parallelism splits (matrices and their biases)."""
        biases = (self.q_width + 2 * self.kv_width + self.ffn) if self.bias else 0
        return self.layer_matmul_params + biases

    @property
    def layer_replicated_params(self) -> int:
        """Norm weights (and output biases) every tensor-parallel rank keeps whole."""
        norms = 2 * self.hidden * (2 if self.bias else 1)
        return norms + (2 * self.hidden if self.bias else 0)

    def layer_tensor_sizes(self, tp: int = 1) -> list[float]:
        """Elements of each parameter tensor of one layer on one tensor-parallel rank (norm weights
        and biases, fused q/k/v, o, the MLP matrices): what a stack that gathers parameter by
        parameter (DeepSpeed's ZeRO-3 of 2021) issues one collective for."""
        h, b = self.hidden, self.bias
        norm = [float(h)] * (2 if b else 1)
        qkv_out = self.q_width + 2 * self.kv_width
        mlp_in = (2 if self.gated_mlp else 1) * self.ffn
        out = norm + [h * qkv_out / tp] + ([qkv_out / tp] if b else []) + [self.q_width * h / tp] + ([float(h)] if b else [])
        out += norm + [h * mlp_in / tp] + ([mlp_in / tp] if b else []) + [self.ffn * h / tp] + ([float(h)] if b else [])
        return out

    @property
    def layer_params(self) -> int:
        return self.layer_sharded_params + self.layer_replicated_params

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden + (self.seq_len * self.hidden if self.learned_positions else 0)

    @property
    def head_params(self) -> int:
        """Final norm, plus the LM head matrix when it is not the tied embedding."""
        return self.hidden * (2 if self.bias else 1) + (0 if self.tied_embeddings else self.vocab * self.hidden)

    @property
    def num_parameters(self) -> int:
        return self.embedding_params + self.n_layer * self.layer_params + self.head_params

    # FLOPs per token, forward (2 per multiply-add), counted as Narayanan et al. 2021 count them:
    # the attention score and value products over the full sequence (no causal halving).
    # At 128K tokens (Llama 3 405B) the s^2 term is 1.35x the weight GEMMs: it is in, counted over
    # the full sequence like the published figures the planner is checked against. A causal kernel
    # does half of it; the time model charges the full count at the GEMM rate, i.e. the causal half
    # at half the GEMM efficiency (docs/planner.md, "Context parallelism").
    def layer_forward_flops_per_token(self) -> float:
        return 2.0 * self.layer_matmul_params + self.attention_forward_flops_per_token()

    def attention_forward_flops_per_token(self) -> float:
        """Scores (q k^T) and values (p v), 2 s h FLOPs each (h: the query width), per token of an
        ``s``-token sequence."""
        return 4.0 * self.seq_len * self.q_width

    def head_forward_flops_per_token(self) -> float:
        return 2.0 * self.hidden * self.vocab

    def step_flops(self, global_batch: int, recompute_passes: float = 0.0) -> float:
        """FLOPs of one optimizer step: forward + backward (2x) for the layers and the head, plus
        ``recompute_passes`` extra layer forwards (1 for full recompute). With the GPT-3 shape and
        one recompute pass this is Narayanan et al.'s 96 B s l h^2 (1 + s/6h + V/16lh)."""
        tokens = global_batch * self.seq_len
        layers = self.n_layer * self.layer_forward_flops_per_token() * (3.0 + recompute_passes)
        return tokens * (layers + 3.0 * self.head_forward_flops_per_token())
