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
    # Mixture of experts (GPTConfig's keys): every ``moe_every``-th block's MLP becomes ``n_experts``
    # SwiGLU experts of width ``expert_ffn`` (``top_k`` per token) plus ``n_shared_experts`` every token
    # uses, and a router. Per-layer figures below are averages over the blocks, MoE or dense.
    n_experts: int = 0
    top_k: int = 0
    n_shared_experts: int = 0
    moe_every: int = 1
    expert_ffn: int = 0
    moe_blocks: Optional[int] = None  # how many blocks are MoE where they are not every moe_every-th (DeepSeek's dense first k)

    @classmethod
    def from_config(cls, config: Mapping[str, Any], seq_len: int | None = None) -> "ModelShape":
        """From ``GPTConfig`` fields; ``seq_len`` defaults to the model's ``block_size``."""
        hidden, n_head = int(config["n_embd"]), int(config["n_head"])
        if hidden % n_head:
            raise ValueError(f"model: n_embd={hidden} is not divisible by n_head={n_head}.")
        n_kv = int(config.get("n_kv_head") or n_head)
        if n_head % n_kv:
            raise ValueError(f"model: n_kv_head={n_kv} must divide n_head={n_head}.")
        experts = int(config.get("n_experts") or 0)
        moe: dict[str, int] = {}
        if experts:
            moe = {
                "n_experts": experts,
                "top_k": int(config.get("top_k") or 2),
                "n_shared_experts": int(config.get("n_shared_experts") or 0),
                "moe_every": int(config.get("moe_every") or 1),
                "expert_ffn": int(config.get("expert_hidden") or config.get("ffn_hidden") or 4 * hidden),
            }
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
            **moe,
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

    # -- mixture of experts ------------------------------------------------------------------
    @property
    def moe_layers(self) -> int:
        """Blocks with experts in place of their MLP (blocks ``moe_every - 1``, ``2 moe_every - 1``, ...)."""
        if not self.n_experts:
            return 0
        return self.moe_blocks if self.moe_blocks is not None else self.n_layer // self.moe_every

    @property
    def moe_share(self) -> float:
        """The fraction of blocks that are MoE blocks (0 for a dense model)."""
        return self.moe_layers / self.n_layer

    @property
    def shared_expert_width(self) -> int:
        """Width of an MoE block's shared experts (one SwiGLU of ``n_shared_experts x expert_ffn``)."""
        return self.n_shared_experts * self.expert_ffn

    @property
    def moe_layer_expert_params(self) -> int:
        """The routed experts' weights of one MoE block: what expert parallelism splits (with tp: over ep x tp)."""
        return self.n_experts * 3 * self.hidden * self.expert_ffn

    @property
    def layer_expert_params(self) -> float:
        """Routed-expert weights per block, averaged over the blocks."""
        return self.moe_share * self.moe_layer_expert_params

    @property
    def _dense_mlp_params(self) -> int:
        return (3 if self.gated_mlp else 2) * self.hidden * self.ffn

    @property
    def layer_matmul_params(self) -> float:
        """Weights that take part in GEMMs and that tensor parallelism splits: q, o (h x q width), k, v
        (h x kv), the MLP matrices (an MoE block: its shared experts' instead; its routed experts are
        :attr:`layer_expert_params`, its router is replicated)."""
        h, share = self.hidden, self.moe_share
        attention = 2 * h * self.q_width + 2 * h * self.kv_width
        return attention + (1 - share) * self._dense_mlp_params + share * 3 * h * self.shared_expert_width

    @property
    def layer_active_matmul_params(self) -> float:
        """GEMM weights one token passes through per block: :attr:`layer_matmul_params`, plus in an MoE
        block its router and ``top_k`` routed experts (what the FLOPs count)."""
        routed = self.hidden * self.n_experts + self.top_k * 3 * self.hidden * self.expert_ffn
        return self.layer_matmul_params + self.moe_share * routed

    @property
    def layer_ffn_width(self) -> float:
        """MLP-intermediate elements per token and block (an MoE block: its ``top_k`` routed rows'
        plus its shared experts'), averaged over the blocks."""
        share = self.moe_share
        return (1 - share) * self.ffn + share * (self.top_k * self.expert_ffn + self.shared_expert_width)

    @property
    def layer_sharded_params(self) -> float:
        """A layer's parameters that tensor parallelism splits (matrices and their biases; MoE blocks
        have no MLP biases). Routed experts are apart (:attr:`layer_expert_params`)."""
        biases = (self.q_width + 2 * self.kv_width + (1 - self.moe_share) * self.ffn) if self.bias else 0
        return self.layer_matmul_params + biases

    @property
    def layer_replicated_params(self) -> float:
        """Norm weights, output biases and MoE routers: what every tensor-parallel rank keeps whole."""
        norms = 2 * self.hidden * (2 if self.bias else 1)
        biases = (2 - self.moe_share) * self.hidden if self.bias else 0
        return norms + biases + self.moe_share * self.hidden * self.n_experts

    def layer_tensor_sizes(self, tp: int = 1) -> list[float]:
        """Elements of each parameter tensor of one layer on one tensor-parallel rank (norm weights
        and biases, fused q/k/v, o, the MLP matrices): what a stack that gathers parameter by
        parameter (DeepSpeed's ZeRO-3 of 2021) issues one collective for. MoE blocks: their MLP
        entries weighed by the dense share, the router and shared experts added (routed experts
        are gathered as their own unit)."""
        h, b, dense = self.hidden, self.bias, 1 - self.moe_share
        norm = [float(h)] * (2 if b else 1)
        qkv_out = self.q_width + 2 * self.kv_width
        mlp_in = (2 if self.gated_mlp else 1) * self.ffn
        out = norm + [h * qkv_out / tp] + ([qkv_out / tp] if b else []) + [self.q_width * h / tp] + ([float(h)] if b else [])
        out += norm + [dense * h * mlp_in / tp] + ([dense * mlp_in / tp] if b else []) + [dense * self.ffn * h / tp]
        out += [dense * h] if b else []
        if self.n_experts:
            out += [self.moe_share * h * self.n_experts]
            if self.shared_expert_width:
                out += [self.moe_share * 3 * h * self.shared_expert_width / tp]
        return out

    @property
    def layer_params(self) -> float:
        return self.layer_sharded_params + self.layer_replicated_params + self.layer_expert_params

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden + (self.seq_len * self.hidden if self.learned_positions else 0)

    @property
    def head_params(self) -> int:
        """Final norm, plus the LM head matrix when it is not the tied embedding."""
        return self.hidden * (2 if self.bias else 1) + (0 if self.tied_embeddings else self.vocab * self.hidden)

    @property
    def num_parameters(self) -> int:
        return round(self.embedding_params + self.n_layer * self.layer_params + self.head_params)

    @property
    def active_parameters(self) -> int:
        """Parameters one token's forward uses: all of them in a dense model; an MoE block's
        ``top_k`` of its ``n_experts`` routed experts."""
        unused = self.moe_layers * (self.n_experts - self.top_k) * 3 * self.hidden * self.expert_ffn
        return self.num_parameters - unused

    # FLOPs per token, forward (2 per multiply-add), counted as Narayanan et al. 2021 count them:
    # the attention score and value products over the full sequence (no causal halving).
    # At 128K tokens (Llama 3 405B) the s^2 term is 1.35x the weight GEMMs: it is in, counted over
    # the full sequence like the published figures the planner is checked against. A causal kernel
    # does half of it; the time model charges the full count at the GEMM rate, i.e. the causal half
    # at half the GEMM efficiency (docs/planner.md, "Context parallelism").
    def layer_forward_flops_per_token(self) -> float:
        return 2.0 * self.layer_active_matmul_params + self.attention_forward_flops_per_token()

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
