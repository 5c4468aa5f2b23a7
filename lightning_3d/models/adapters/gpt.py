"""The reference GPT (:mod:`lightning_3d.models.gpt`), in its GPT-2 and Llama-style variants."""

from __future__ import annotations

import functools
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import Tensor, nn

from lightning_3d.core.layout_rules import ModelDims
from lightning_3d.core.model_shape import ModelShape
from lightning_3d.models.adapters.base import ExportTensor, ModelAdapter
from lightning_3d.models.adapters.registry import register_adapter
from lightning_3d.models.gpt import (
    GPT,
    IGNORE_INDEX,
    AttentionCore,
    CausalSelfAttention,
    GPTConfig,
    causal_attention,
    sequence_positions,
)
from lightning_3d.moe import take_aux_losses
from lightning_3d.pipeline.sequences import HeadOutput, Inputs, LayerSequence
from lightning_3d.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from lightning_3d.tensor_parallel.plans import PlanContext, StyleSpec, TensorParallelPlan, gather_logits_hook

if TYPE_CHECKING:
    from lightning_3d.context_parallel.apply import ContextParallel


def _arg(args: tuple, kwargs: dict, index: int, name: str) -> Any:
    return args[index] if len(args) > index else kwargs.get(name)


def gpt_plan(model: nn.Module) -> TensorParallelPlan:
    """Megatron-style plan for the reference GPT, in its GPT-2 or Llama-style variants.

    q/k/v are column-parallel and o is row-parallel, so each rank attends with whole heads: with
    grouped-query attention a rank holds ``n_head/tp`` query heads and ``n_kv_head/tp`` key/value
    heads, and because heads are split in order, its query heads are exactly the ones its key/value
    heads serve. SwiGLU's gate and up are column-parallel (matching columns on a rank, so the
    elementwise product stays local) and down is row-parallel: one all-reduce per MLP, as for GELU.
    RMSNorm is marked for sequence parallel like LayerNorm (its weight sees a sequence shard).
    """
    config = model.config

    def finalize(m: nn.Module, ctx: PlanContext) -> None:
        m.loss_fn = functools.partial(vocab_parallel_cross_entropy, tp_group=ctx.tp_group, vocab_size=config.vocab_size)
        m.register_forward_hook(gather_logits_hook(config.vocab_size, ctx))

    styles: dict[str, StyleSpec] = {"wte": "vocab"}
    if config.position == "learned":
        styles["wpe"] = "sequence_split"
    styles.update(
        {
            "drop": "sequence_rng",
            "blocks.*.ln_1": "sequence_norm",
            "blocks.*.attn": "prepare_input",
            "blocks.*.attn.q_proj": "column_prepared",
            "blocks.*.attn.k_proj": "column_prepared",
            "blocks.*.attn.v_proj": "column_prepared",
            "blocks.*.attn.core": "rng",
            "blocks.*.attn.o_proj": "row",
            "blocks.*.attn.resid_dropout": "sequence_rng",
            "blocks.*.ln_2": "sequence_norm",
        }
    )
    # the dense MLPs; an MoE block's experts are split by expert parallelism's set-up instead
    # (lightning_3d/moe/expert_parallel.py: experts over ep x tp, the shared experts over tp)
    dense = [str(i) for i in range(config.n_layer) if not config.is_moe_block(i)]
    blocks = "*" if len(dense) == config.n_layer else None
    for index in [blocks] if blocks else dense:
        if config.mlp == "swiglu":
            styles.update(
                {
                    f"blocks.{index}.mlp": "prepare_input",
                    f"blocks.{index}.mlp.gate_proj": "column_prepared",
                    f"blocks.{index}.mlp.up_proj": "column_prepared",
                    f"blocks.{index}.mlp.down_proj": "row",
                }
            )
        else:
            styles.update({f"blocks.{index}.mlp.fc": "column", f"blocks.{index}.mlp.proj": "row"})
        styles[f"blocks.{index}.mlp.dropout"] = "sequence_rng"
    styles.update({"ln_f": "sequence_norm", "lm_head": "vocab_head"})
    return TensorParallelPlan(name="GPT", styles=styles, check=GPT_ADAPTER.check_tensor_parallel, finalize=finalize)


def gpt_sequence(model: nn.Module) -> LayerSequence:
    def inputs(args: tuple, kwargs: dict) -> Inputs:
        return {"input_ids": _arg(args, kwargs, 0, "input_ids"), "targets": _arg(args, kwargs, 1, "targets")}

    def head(x: Tensor, batch: Inputs) -> HeadOutput:
        out = model.head(x, batch["targets"])
        return HeadOutput(loss=out) if batch["targets"] is not None else HeadOutput(logits=out)

    return LayerSequence(
        blocks=model.blocks,
        blocks_name="blocks",
        # With rotary positions there is no wpe: positions enter inside each block's attention.
        embed_modules=("wte", "wpe", "drop") if model.config.position == "learned" else ("wte", "drop"),
        head_modules=("ln_f", "lm_head"),
        inputs=inputs,
        embed=lambda batch: model.embed(batch["input_ids"]),
        block=lambda layer, x, batch: layer(x),
        head=head,
        # the loss averages over the targets that are not masked: weigh micro-batches by those
        target_count=lambda batch: (batch["targets"] != IGNORE_INDEX).sum() if batch["targets"] is not None else 0,
        output=lambda loss, logits: loss if loss is not None else logits,
        aux_loss=take_aux_losses if model.config.n_experts else None,
        aux_in_loss=(lambda out: getattr(out, "aux_loss", None)) if model.config.n_experts else None,
    )


# -- Hugging Face export -------------------------------------------------------------------------------------------
def _differences(cfg: GPTConfig, family: dict[str, Any], label: str) -> list[str]:
    return [f"{name}={getattr(cfg, name)!r} ({label}: {want!r})" for name, want in family.items() if getattr(cfg, name) != want]


def exported_family(cfg: GPTConfig) -> str:
    """``"gpt2"`` or ``"llama"``: the Hugging Face model that computes exactly what this GPT computes.

    GPT-2 has learned positions, a GELU MLP, LayerNorm and one key/value head per query head; Llama
    rotary positions, SwiGLU and RMSNorm (any number of key/value heads). ``bias=False`` (GPT-2: zero
    biases; Llama: no biases) and untied heads are representable in both. A mix of the two is computed
    by neither: it is refused, naming what to change for each, rather than written as a model that
    loads but computes something else."""
    gpt2 = _differences(cfg, {"position": "learned", "mlp": "gelu", "norm": "layernorm", "kv_heads": cfg.n_head}, "GPT-2")
    llama = _differences(cfg, {"position": "rope", "mlp": "swiglu", "norm": "rmsnorm"}, "Llama")
    if not llama:
        return "llama"
    if not gpt2:
        return "gpt2"
    gpt2 = [d.replace("kv_heads=", "n_kv_head=") for d in gpt2]
    raise ValueError(
        f"this GPT is not GPT-2 architecture ({', '.join(gpt2)}) and not Llama architecture ({', '.join(llama)}), so "
        f"no Hugging Face model computes what it does (GPT2LMHeadModel or LlamaForCausalLM would load it and compute "
        f"something else); use `consolidate` (lightning-3d consolidate CKPT_DIR OUT) for a dense checkpoint that "
        f"GPTModule.load_from_checkpoint loads."
    )


def _same(tensors: list[Tensor]) -> Tensor:
    return tensors[0]


def _transposed(tensors: list[Tensor]) -> Tensor:
    """nn.Linear [out, in] -> GPT-2's Conv1D [in, out]."""
    return tensors[0].t().contiguous()


def _fused_qkv_weight(tensors: list[Tensor]) -> Tensor:
    return torch.cat(tensors).t().contiguous()


def _zeros(size: int) -> Callable[[list[Tensor]], Tensor]:
    return lambda _: torch.zeros(size)


def gpt2_tensors(cfg: GPTConfig) -> list[ExportTensor]:
    """Our GPT's tensors as GPT2LMHeadModel's: same architecture (pre-norm blocks, tanh-GELU MLP,
    learned positions); q/k/v fused into ``c_attn``, linear maps transposed to ``Conv1D``; biases our
    model lacks (``bias=False``) written as zeros; the head only when untied."""
    e, f = cfg.n_embd, cfg.ffn_dim

    def tensor(key: str, source: str, combine: Callable[[list[Tensor]], Tensor] = _same) -> ExportTensor:
        return ExportTensor(key, (source,), combine)

    def bias_tensor(key: str, source: str, size: int) -> ExportTensor:
        return ExportTensor(key, (source,)) if cfg.bias else ExportTensor(key, (), _zeros(size))

    out = [tensor("transformer.wte.weight", "wte.weight"), tensor("transformer.wpe.weight", "wpe.weight")]
    for i in range(cfg.n_layer):
        src, dst = f"blocks.{i}.", f"transformer.h.{i}."
        for norm in ("ln_1", "ln_2"):
            out += [tensor(f"{dst}{norm}.weight", f"{src}{norm}.weight"), bias_tensor(f"{dst}{norm}.bias", f"{src}{norm}.bias", e)]
        qkv = tuple(f"{src}attn.{p}_proj" for p in "qkv")
        out.append(ExportTensor(f"{dst}attn.c_attn.weight", tuple(f"{n}.weight" for n in qkv), _fused_qkv_weight))
        if cfg.bias:
            out.append(ExportTensor(f"{dst}attn.c_attn.bias", tuple(f"{n}.bias" for n in qkv), torch.cat))
        else:
            out.append(ExportTensor(f"{dst}attn.c_attn.bias", (), _zeros(3 * e)))
        out += [
            tensor(f"{dst}attn.c_proj.weight", f"{src}attn.o_proj.weight", _transposed),
            bias_tensor(f"{dst}attn.c_proj.bias", f"{src}attn.o_proj.bias", e),
            tensor(f"{dst}mlp.c_fc.weight", f"{src}mlp.fc.weight", _transposed),
            bias_tensor(f"{dst}mlp.c_fc.bias", f"{src}mlp.fc.bias", f),
            tensor(f"{dst}mlp.c_proj.weight", f"{src}mlp.proj.weight", _transposed),
            bias_tensor(f"{dst}mlp.c_proj.bias", f"{src}mlp.proj.bias", e),
        ]
    out += [tensor("transformer.ln_f.weight", "ln_f.weight"), bias_tensor("transformer.ln_f.bias", "ln_f.bias", e)]
    if not cfg.tie_embeddings:
        out.append(tensor("lm_head.weight", "lm_head.weight"))
    return out


def gpt2_config(cfg: GPTConfig) -> Any:
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.block_size, n_embd=cfg.n_embd, n_layer=cfg.n_layer, n_head=cfg.n_head,
        n_inner=cfg.ffn_dim, activation_function="gelu_new", resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout,
        attn_pdrop=cfg.dropout, layer_norm_epsilon=1e-5, tie_word_embeddings=cfg.tie_embeddings,
        bos_token_id=None, eos_token_id=None,
    )


def llama_config(cfg: GPTConfig) -> Any:
    """``LlamaConfig`` computing what our Llama-style GPT computes.

    Rotary embeddings agree without permuting q/k rows: ours (:func:`~lightning_3d.models.gpt.apply_rotary`)
    use the "rotate half" layout (feature ``i`` pairs with ``i + head_dim/2``, frequencies
    ``theta^(-2i/head_dim)`` repeated over both halves), which is Hugging Face Llama's; only checkpoints in
    Meta's interleaved-pairs layout need the permutation. RMSNorm's eps is 1e-5
    (:func:`~lightning_3d.models.gpt.make_norm`); ``bias=True`` means biases on q/k/v/o
    (``attention_bias``) and on gate/up/down (``mlp_bias``). Our dropout (attention, residual, MLP,
    embeddings) has only Llama's attention dropout to map to: the exported model computes the same in
    eval mode."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, intermediate_size=cfg.ffn_dim, num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head, num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.block_size, hidden_act="silu", rms_norm_eps=1e-5, rope_theta=float(cfg.rope_theta),
        attention_bias=cfg.bias, mlp_bias=cfg.bias, attention_dropout=cfg.dropout, tie_word_embeddings=cfg.tie_embeddings,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )


def llama_tensors(cfg: GPTConfig) -> list[ExportTensor]:
    """Our Llama-style GPT's tensors as LlamaForCausalLM's: the same ``nn.Linear`` matrices under other
    names (nothing transposed, fused or permuted); the head only when untied."""
    out = [ExportTensor("model.embed_tokens.weight", ("wte.weight",))]
    kinds = ("weight", "bias") if cfg.bias else ("weight",)
    for i in range(cfg.n_layer):
        src, dst = f"blocks.{i}.", f"model.layers.{i}."
        out.append(ExportTensor(f"{dst}input_layernorm.weight", (f"{src}ln_1.weight",)))
        out += [ExportTensor(f"{dst}self_attn.{p}_proj.{k}", (f"{src}attn.{p}_proj.{k}",)) for p in "qkvo" for k in kinds]
        out.append(ExportTensor(f"{dst}post_attention_layernorm.weight", (f"{src}ln_2.weight",)))
        out += [ExportTensor(f"{dst}mlp.{p}_proj.{k}", (f"{src}mlp.{p}_proj.{k}",)) for p in ("gate", "up", "down") for k in kinds]
    out.append(ExportTensor("model.norm.weight", ("ln_f.weight",)))
    if not cfg.tie_embeddings:
        out.append(ExportTensor("lm_head.weight", ("lm_head.weight",)))
    return out


class GPTAdapter(ModelAdapter):
    name = "gpt"
    hf_model_types = ()

    def matches(self, module: nn.Module) -> bool:
        return isinstance(module, GPT)

    def tp_plan(self, model: nn.Module) -> TensorParallelPlan:
        return gpt_plan(model)

    def layer_sequence(self, model: nn.Module) -> LayerSequence:
        return gpt_sequence(model)

    def recompute_target(self, block: nn.Module) -> nn.Module:
        """The attention core (softmax and attention over values): the part selective recompute
        (Korthikanti et al.) re-runs; it is also the plan's per-rank dropout region."""
        for module in block.modules():
            if isinstance(module, AttentionCore):
                return module
        return super().recompute_target(block)

    def context_parallel(self, model: nn.Module, cp: Optional["ContextParallel"]) -> None:
        """Learned and rotary positions both read ``positions`` (the model's and each attention's);
        ``AttentionCore.attend`` becomes cp's attention (``cp=None``: the defaults again). The kernels
        have no attention dropout, so a model with dropout is refused; the full sequence must fit
        ``block_size`` (learned positions)."""
        config = model.config
        if cp is None:
            self._set_seams(model, sequence_positions, causal_attention)
            return
        if config.dropout:
            raise ValueError(
                f"context_parallel={cp.size}: GPTConfig.dropout={config.dropout} applies dropout to attention, which "
                f"the context-parallel kernels do not have; set dropout=0.0 (as Llama-style pre-training does) or "
                f"use context_parallel=1."
            )

        def positions(t: int, device: torch.device) -> Tensor:
            if t * cp.size > config.block_size:
                raise ValueError(f"sequence length {t * cp.size} exceeds block_size={config.block_size}.")
            return cp.positions(t, device)

        self._set_seams(model, positions, cp.attention)

    @staticmethod
    def _set_seams(model: nn.Module, positions: Callable[[int, torch.device], Tensor], attend: Callable[..., Tensor]) -> None:
        model.positions = positions
        for module in model.modules():
            if isinstance(module, CausalSelfAttention):
                module.positions = positions
            elif isinstance(module, AttentionCore):
                module.attend = attend

    def dims(self, model: nn.Module) -> ModelDims:
        c = model.config
        names = dict(n_layer="n_layer", hidden="n_embd", n_head="n_head", n_kv_head="n_kv_head", ffn="ffn_dim")
        # every block an MoE layer: no dense MLP for tensor parallelism to split (0 divides by any tp)
        ffn = 0 if c.n_experts and c.moe_blocks == c.n_layer else c.ffn_dim
        return ModelDims(
            c.n_layer, c.n_embd, c.n_head, c.kv_heads, ffn, labels={k: f"GPTConfig.{v}" for k, v in names.items()},
            n_experts=c.n_experts, shared_expert_width=c.n_shared_experts * c.expert_dim if c.n_experts else 0,
        )

    def model_shape(self, model: nn.Module, seq_len: int) -> ModelShape:
        return ModelShape.from_config(asdict(model.config), seq_len)

    def hf_export(self, model_config: Any) -> tuple[Any, list[ExportTensor]]:
        """``model_config``: the ``GPTConfig`` (or its dict, as ``GPTModule`` checkpoints record it).
        GPT-2 architecture -> ``GPT2Config`` and :func:`gpt2_tensors`; Llama architecture ->
        ``LlamaConfig`` and :func:`llama_tensors`; a mix of the two is refused
        (:func:`exported_family`)."""
        cfg = model_config if isinstance(model_config, GPTConfig) else GPTConfig(**dict(model_config))
        if cfg.n_experts:
            raise ValueError(
                f"GPTConfig(n_experts={cfg.n_experts}): a mixture-of-experts GPT has no Hugging Face export yet "
                f"(the MoE families' key mappings come with issue 34); save it with Lightning's checkpoint instead."
            )
        if exported_family(cfg) == "llama":
            return llama_config(cfg), llama_tensors(cfg)
        return gpt2_config(cfg), gpt2_tensors(cfg)


GPT_ADAPTER = register_adapter(GPTAdapter())
