"""A plain decoder-only transformer (GPT-2 style by default, Llama style by options), free of any
parallelism.

Parallelism is applied from outside (tensor-parallel plans, pipeline splits, ZeRO), so this
file reads like a textbook GPT. Two choices keep that possible:

* Attention infers its local head counts from the projection widths (``-1`` in ``view``), so a
  tensor-parallel plan that shards the q/k/v projections needs no change here -- with grouped-query
  attention too: a rank holding ``n_head/tp`` query and ``n_kv_head/tp`` key/value heads keeps the
  same grouping, which SDPA's ``enable_gqa`` applies.
* The loss is an attribute (``loss_fn``) so a plan can swap in a vocab-parallel cross-entropy
  without the model knowing. Two more such seams serve context parallelism, where a rank holds
  only some of each sequence's tokens: ``positions`` (which positions the tokens in hand have;
  learned and rotary positions both ask it) and ``AttentionCore.attend`` (the causal attention,
  which then spans the tokens other ranks hold).
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional, Union

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_3d.moe import GroupedExperts, MoE, take_aux_losses


MLPS = ("gelu", "swiglu")
IGNORE_INDEX = -100  # targets equal to this are masked out of the loss (padding, prompts)
NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rope")


@dataclass
class GPTConfig:
    """Model dimensions and architecture options. ``ffn_hidden=None`` means ``4 * n_embd``.

    The defaults describe GPT-2. Llama-style models set ``n_kv_head`` (grouped-query attention),
    ``mlp="swiglu"`` (gate/up/down projections), ``norm="rmsnorm"``, ``position="rope"`` (rotary
    embeddings on q and k, no learned position table), usually with ``bias=False`` and
    ``tie_embeddings=False``.

    Mixture of experts (issue 34): ``n_experts > 0`` replaces the MLP of every ``moe_every``-th block
    (the last of each group: ``moe_every=2`` makes blocks 1, 3, ... MoE) with ``n_experts`` SwiGLU
    experts of width ``expert_hidden`` (default ``ffn_dim``), ``top_k`` of them per token, plus
    ``n_shared_experts`` experts every token uses (lightning_3d/moe). ``router_score``: "softmax" or
    "sigmoid"; ``capacity_factor``: None routes every token (dropless); ``moe_balance_loss`` and
    ``moe_z_loss``: the auxiliary losses' coefficients, added to the training loss.
    """

    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    ffn_hidden: Optional[int] = None
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = True
    n_kv_head: Optional[int] = None
    mlp: str = "gelu"
    norm: str = "layernorm"
    position: str = "learned"
    rope_theta: float = 10000.0
    n_experts: int = 0
    top_k: int = 2
    n_shared_experts: int = 0
    moe_every: int = 1
    expert_hidden: Optional[int] = None
    router_score: str = "softmax"
    capacity_factor: Optional[float] = None
    moe_balance_loss: float = 0.01
    moe_z_loss: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name}={value!r} is invalid: it must be a positive integer.")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig: n_embd={self.n_embd} is not divisible by n_head={self.n_head}.")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout={self.dropout!r} must be in [0, 1).")
        if self.n_kv_head is not None:
            if not isinstance(self.n_kv_head, int) or self.n_kv_head < 1:
                raise ValueError(f"GPTConfig.n_kv_head={self.n_kv_head!r} is invalid: it must be a positive integer or None (= n_head).")
            if self.n_head % self.n_kv_head:
                raise ValueError(
                    f"GPTConfig: n_head={self.n_head} is not divisible by n_kv_head={self.n_kv_head}; "
                    f"grouped-query attention shares each key/value head among n_head/n_kv_head query heads."
                )
        for name, allowed in (("mlp", MLPS), ("norm", NORMS), ("position", POSITIONS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"GPTConfig.{name}={getattr(self, name)!r} is unknown: choose one of {allowed}.")
        if self.position == "rope":
            if self.head_dim % 2:
                raise ValueError(
                    f"GPTConfig: position='rope' rotates pairs of features, so head_dim=n_embd/n_head="
                    f"{self.head_dim} must be even."
                )
            if not isinstance(self.rope_theta, (int, float)) or self.rope_theta <= 0:
                raise ValueError(f"GPTConfig.rope_theta={self.rope_theta!r} must be a positive number.")
        self._check_experts()

    def _check_experts(self) -> None:
        for name in ("n_experts", "n_shared_experts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"GPTConfig.{name}={value!r} is invalid: it must be a whole number >= 0 (0: none).")
        if not self.n_experts:
            return
        if isinstance(self.moe_every, bool) or not isinstance(self.moe_every, int) or not 1 <= self.moe_every <= self.n_layer:
            raise ValueError(f"GPTConfig.moe_every={self.moe_every!r} must be a whole number from 1 (every block) to n_layer={self.n_layer}.")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"GPTConfig.top_k={self.top_k!r} must be a whole number from 1 to n_experts={self.n_experts}.")
        if self.expert_hidden is not None and (not isinstance(self.expert_hidden, int) or self.expert_hidden < 1):
            raise ValueError(f"GPTConfig.expert_hidden={self.expert_hidden!r} must be a positive integer or None (= ffn_dim).")

    def is_moe_block(self, index: int) -> bool:
        """Block ``index`` (0-based) has experts in place of its MLP."""
        return self.n_experts > 0 and (index + 1) % self.moe_every == 0

    @property
    def moe_blocks(self) -> int:
        """How many blocks have experts."""
        return sum(self.is_moe_block(i) for i in range(self.n_layer))

    @property
    def expert_dim(self) -> int:
        return self.expert_hidden or self.ffn_dim

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        """Key/value heads: ``n_kv_head``, or ``n_head`` (plain multi-head attention)."""
        return self.n_kv_head or self.n_head

    @property
    def ffn_dim(self) -> int:
        return self.ffn_hidden or 4 * self.n_embd

    def num_parameters(self) -> int:
        """Parameter count, counting a tied embedding once."""
        e, v, f, layers = self.n_embd, self.vocab_size, self.ffn_dim, self.n_layer
        kv = self.kv_heads * self.head_dim
        norm = e * (2 if self.bias and self.norm == "layernorm" else 1)
        attention = 2 * e * e + 2 * e * kv + (2 * e + 2 * kv if self.bias else 0)
        if self.mlp == "swiglu":
            mlp = 3 * e * f + (2 * f + e if self.bias else 0)
        else:
            mlp = 2 * e * f + (f + e if self.bias else 0)
        positions = self.block_size * e if self.position == "learned" else 0
        head = 0 if self.tie_embeddings else v * e
        moe_blocks = self.moe_blocks
        moe = self.n_experts * e + 3 * e * self.expert_dim * (self.n_experts + self.n_shared_experts)  # router, experts, shared
        return v * e + positions + layers * (2 * norm + attention) + (layers - moe_blocks) * mlp + moe_blocks * moe + norm + head


def sequence_positions(t: int, device: torch.device) -> Tensor:
    """The positions of ``t`` tokens in hand, ``0..t-1``: the whole sequence (context parallelism
    swaps in the true positions of a rank's chunks)."""
    return torch.arange(t, device=device)


def causal_attention(q: Tensor, k: Tensor, v: Tensor, dropout_p: float) -> Tensor:
    """Causal softmax attention (SDPA), grouped-query when k/v have fewer heads than q."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p, enable_gqa=k.shape[1] != q.shape[1])


class AttentionCore(nn.Module):
    """softmax(q k^T / sqrt(d)) v with a causal mask: the part selective recompute re-runs, and
    the region whose dropout a tensor-parallel plan draws from per-rank randomness.

    ``k``/``v`` may have fewer heads than ``q`` (grouped-query attention): each key/value head
    serves ``q_heads / kv_heads`` consecutive query heads, the same on every tensor-parallel rank.
    """

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.dropout = dropout
        self.attend: Callable[[Tensor, Tensor, Tensor, float], Tensor] = causal_attention

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return self.attend(q, k, v, self.dropout if self.training else 0.0)


def rotary_cos_sin(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos/sin tables ``(T, head_dim)`` for the given positions ``(T,)``, in fp32.

    Computed per call rather than held in buffers: buffers would be cast to bf16 with the
    parameters (losing precision at long range) and sharded or moved by ZeRO-3; the table is tiny.
    """
    device = positions.device
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    freqs = torch.outer(positions.to(torch.float32), inv_freq)
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` ``(B, heads, T, head_dim)`` by position, in the "rotate half" layout (GPT-NeoX,
    Hugging Face Llama): feature ``i`` pairs with ``i + head_dim/2``."""
    x32 = x.float()
    first, second = x32.chunk(2, dim=-1)
    rotated = torch.cat((-second, first), dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        e, kv = config.n_embd, config.kv_heads * config.head_dim
        self.head_dim = config.head_dim
        self.rope_theta = config.rope_theta if config.position == "rope" else None
        self.q_proj = nn.Linear(e, e, bias=config.bias)
        self.k_proj = nn.Linear(e, kv, bias=config.bias)
        self.v_proj = nn.Linear(e, kv, bias=config.bias)
        self.core = AttentionCore(config.dropout)
        self.o_proj = nn.Linear(e, e, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.positions: Callable[[int, torch.device], Tensor] = sequence_positions

    def forward(self, x: Tensor) -> Tensor:
        b, t = x.shape[0], x.shape[1]
        # (B, T, heads, head_dim) -> (B, heads, T, head_dim); heads is whatever this rank holds.
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        if self.rope_theta is not None:
            # t is every token this rank attends for: sequence parallel gathers them before the q/k projections.
            cos, sin = rotary_cos_sin(self.positions(t, x.device), self.head_dim, self.rope_theta)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = self.core(q, k, v).transpose(1, 2).reshape(b, t, -1)
        return self.resid_dropout(self.o_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, config.ffn_dim, bias=config.bias)
        self.proj = nn.Linear(config.ffn_dim, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x), approximate="tanh")))


class SwiGLU(nn.Module):
    """Llama's MLP: ``down(silu(gate(x)) * up(x))``. Gate and up are separate projections (not one
    fused matrix) so a column-parallel split keeps matching gate and up columns on each rank."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.n_embd, config.ffn_dim, bias=config.bias)
        self.up_proj = nn.Linear(config.n_embd, config.ffn_dim, bias=config.bias)
        self.down_proj = nn.Linear(config.ffn_dim, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))


def make_norm(config: GPTConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.n_embd, eps=1e-5)
    return nn.LayerNorm(config.n_embd, bias=config.bias)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig, index: int = 0) -> None:
        super().__init__()
        self.ln_1 = make_norm(config)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = make_norm(config)
        self.mlp: nn.Module
        if config.is_moe_block(index):
            self.mlp = MoE(
                config.n_embd, config.expert_dim, config.n_experts, config.top_k, n_shared_experts=config.n_shared_experts,
                score=config.router_score, capacity_factor=config.capacity_factor,
                balance_coefficient=config.moe_balance_loss, z_loss_coefficient=config.moe_z_loss,
            )
        else:
            self.mlp = SwiGLU(config) if config.mlp == "swiglu" else MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token (+ learned position) embeddings, ``n_layer`` blocks, final norm, LM head (tied by default)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        if config.position == "learned":
            self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.ln_f = make_norm(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.loss_fn: Callable[..., Tensor] = F.cross_entropy
        self.positions: Callable[[int, torch.device], Tensor] = sequence_positions
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layer), zero biases.

        Modules are recognized by what they are (linear maps have ``in_features``/``out_features``,
        embeddings ``num_embeddings``), not by class, so the same init applies when a parallelism
        plan has swapped a layer for one holding a shard (meta-device init under ZeRO-3).
        """
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if hasattr(module, "in_features") and hasattr(module, "out_features"):
                std = residual_std if name.endswith(("o_proj", "mlp.proj", "mlp.down_proj", "shared_experts.down_proj")) else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif hasattr(module, "num_embeddings"):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                nn.init.ones_(module.weight)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, GroupedExperts):
                module.reset_parameters(std=0.02, down_std=residual_std)

    def embed(self, input_ids: Tensor) -> Tensor:
        """Token (+ learned position) embeddings: ``(B, T)`` ids -> ``(B, T, n_embd)``. With rope,
        positions enter in attention instead."""
        t = input_ids.shape[1]
        if t > self.config.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size={self.config.block_size}.")
        x = self.wte(input_ids)
        if self.config.position == "learned":
            x = x + self.wpe(self.positions(t, input_ids.device))
        return self.drop(x)

    def head(self, x: Tensor, targets: Optional[Tensor] = None) -> Tensor:
        """Final norm and LM head: logits, or the mean cross-entropy over the targets that are not
        ``IGNORE_INDEX`` when ``targets`` is given."""
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return self.loss_fn(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)

    def forward(self, input_ids: Tensor, targets: Optional[Tensor] = None) -> Tensor:
        """Logits ``(B, T, vocab)``, or the mean cross-entropy when ``targets`` is given (entries equal
        to ``IGNORE_INDEX`` are masked)."""
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        out = self.head(x, targets)
        aux = take_aux_losses(self) if targets is not None and self.config.n_experts else None  # (this training forward's)
        if aux is None:
            return out
        loss = out + aux
        loss.aux_loss = aux  # the part of the loss that averages over sequences (data-parallel weighting reads it)
        return loss


def _as_config(config: Union[GPTConfig, dict, None]) -> GPTConfig:
    if config is None:
        return GPTConfig()
    if isinstance(config, GPTConfig):
        return config
    return GPTConfig(**dict(config))


class GPTModule(L.LightningModule):
    """The LightningModule the recipes train: next-token prediction with AdamW and cosine decay.

    The model is built in :meth:`configure_model` (idempotent), where the strategy can shard or
    split it; the step code is the same for every parallel layout.

    Args:
        config: model dimensions (a :class:`GPTConfig` or a dict of its fields).
        lr: peak learning rate reached after ``warmup_steps``.
        min_lr_ratio: the cosine schedule decays to ``lr * min_lr_ratio``.
        weight_decay: AdamW decay for matrices and embeddings (not for biases and norms).
        betas: AdamW betas.
        warmup_steps: linear warmup length in optimizer steps.
        decay_steps: length of the cosine decay; ``None`` uses the Trainer's total steps.
    """

    def __init__(
        self,
        config: Optional[GPTConfig] = None,
        lr: float = 3e-3,
        min_lr_ratio: float = 0.1,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 20,
        decay_steps: Optional[int] = None,
    ) -> None:
        super().__init__()
        check_optimizer_settings(lr, min_lr_ratio, weight_decay, betas, warmup_steps, decay_steps)
        self.config = _as_config(config)
        # Plain types only, so checkpoints load with weights_only=True.
        self.save_hyperparameters(
            {
                "config": asdict(self.config),
                "lr": lr,
                "min_lr_ratio": min_lr_ratio,
                "weight_decay": weight_decay,
                "betas": tuple(betas),
                "warmup_steps": warmup_steps,
                "decay_steps": decay_steps,
            }
        )
        self.model: Optional[GPT] = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = GPT(self.config)

    def forward(self, input_ids: Tensor, targets: Optional[Tensor] = None) -> Tensor:
        assert self.model is not None, "configure_model() has not run"
        return self.model(input_ids, targets)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        input_ids, targets = batch
        loss = self(input_ids, targets)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        input_ids, targets = batch
        loss = self(input_ids, targets)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        input_ids, targets = batch
        loss = self(input_ids, targets)
        self.log("test_loss", loss, sync_dist=True)
        return loss

    def predict_step(self, batch: Union[Tensor, tuple[Tensor, ...]], batch_idx: int) -> Tensor:
        """Greedy next-token prediction for every position."""
        input_ids = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(input_ids).argmax(dim=-1)

    def configure_optimizers(self) -> Any:
        return adamw_with_warmup_cosine(self, self.hparams)

    def configure_callbacks(self) -> list[L.Callback]:
        from lightning_3d.monitoring.callbacks import TokenThroughput

        return [TokenThroughput()]


def adamw_with_warmup_cosine(module: L.LightningModule, hp: Any) -> dict[str, Any]:
    """The recipes' optimizer: AdamW (decay on matrices and embeddings, not on biases and norms) with
    linear warmup and cosine decay per step, from the hyper-parameters ``lr``, ``betas``,
    ``weight_decay``, ``warmup_steps``, ``decay_steps`` (``None``: the Trainer's total) and ``min_lr_ratio``."""
    decay, no_decay = [], []
    for p in {id(p): p for p in module.parameters() if p.requires_grad}.values():
        (decay if p.dim() >= 2 else no_decay).append(p)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=hp.lr,
        betas=tuple(hp.betas),
    )
    total = hp.decay_steps or max(1, int(module.trainer.estimated_stepping_batches))
    schedule = functools.partial(warmup_cosine, warmup=hp.warmup_steps, total=total, min_ratio=hp.min_lr_ratio)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def check_optimizer_settings(
    lr: float, min_lr_ratio: float, weight_decay: float, betas: Any, warmup_steps: int, decay_steps: Optional[int]
) -> None:
    """Refuse, naming the value, settings AdamW or the schedule would take in silence or reject in their
    own words at step 1 (a NaN or negative learning rate, a ratio outside [0, 1], ...)."""
    def bad(name: str, value: Any, want: str) -> ValueError:
        return ValueError(f"{name}={value!r} is invalid: {want}.")

    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr < 0:
        raise bad("lr (optim.lr)", lr, "the learning rate must be a finite number >= 0, e.g. 3e-4")
    if not isinstance(min_lr_ratio, (int, float)) or not 0 <= min_lr_ratio <= 1:
        raise bad("min_lr_ratio (optim.min_lr_ratio)", min_lr_ratio, "the final learning rate over the peak must be in [0, 1]")
    if not isinstance(weight_decay, (int, float)) or not math.isfinite(weight_decay) or weight_decay < 0:
        raise bad("weight_decay (optim.weight_decay)", weight_decay, "it must be a finite number >= 0")
    if len(tuple(betas)) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas):
        raise bad("betas (optim.betas)", tuple(betas), "AdamW takes two numbers in [0, 1), e.g. [0.9, 0.95]")
    for name, value in (("warmup_steps", warmup_steps), ("decay_steps", decay_steps)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise bad(f"{name} (optim.{name})", value, "it must be a whole number of optimizer steps >= 0")


def warmup_cosine(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """LR multiplier: linear warmup to 1, then cosine decay to ``min_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
