"""The reference GPT (:mod:`lightning_3d.models.gpt`), in its GPT-2 and Llama-style variants."""

from __future__ import annotations

import functools
from dataclasses import asdict
from typing import Any, Callable

import torch
from torch import Tensor, nn

from lightning_3d.layout_rules import ModelDims
from lightning_3d.models.adapters.base import ExportTensor, ModelAdapter
from lightning_3d.models.adapters.registry import register_adapter
from lightning_3d.models.gpt import GPT, IGNORE_INDEX, AttentionCore, GPTConfig
from lightning_3d.pipeline.sequences import HeadOutput, Inputs, LayerSequence
from lightning_3d.planner.model_shape import ModelShape
from lightning_3d.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from lightning_3d.tensor_parallel.plans import PlanContext, StyleSpec, TensorParallelPlan, gather_logits_hook


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
    if config.mlp == "swiglu":
        styles.update(
            {
                "blocks.*.mlp": "prepare_input",
                "blocks.*.mlp.gate_proj": "column_prepared",
                "blocks.*.mlp.up_proj": "column_prepared",
                "blocks.*.mlp.down_proj": "row",
            }
        )
    else:
        styles.update({"blocks.*.mlp.fc": "column", "blocks.*.mlp.proj": "row"})
    styles.update({"blocks.*.mlp.dropout": "sequence_rng", "ln_f": "sequence_norm", "lm_head": "vocab_head"})
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
        target_count=lambda batch: int((batch["targets"] != IGNORE_INDEX).sum()) if batch["targets"] is not None else 0,
        output=lambda loss, logits: loss if loss is not None else logits,
    )


# -- Hugging Face export -------------------------------------------------------------------------------------------
def _is_llama_style(cfg: GPTConfig) -> bool:
    return cfg.position == "rope" and cfg.mlp == "swiglu" and cfg.norm == "rmsnorm"


def _require_gpt2_architecture(cfg: GPTConfig) -> None:
    """GPT-2 has learned positions, a GELU MLP, LayerNorm and one key/value head per query head;
    a GPTConfig with other options has weights GPT-2 cannot hold (or would silently compute
    differently with), so refuse rather than write a model that loads but is wrong. ``bias=False``
    (zero biases) and untied heads (``tie_word_embeddings=False``) are representable and exported."""
    differences = [
        f"{name}={value!r} (GPT-2: {gpt2!r})"
        for name, value, gpt2 in (
            ("position", cfg.position, "learned"),
            ("mlp", cfg.mlp, "gelu"),
            ("norm", cfg.norm, "layernorm"),
            ("n_kv_head", cfg.kv_heads, cfg.n_head),
        )
        if value != gpt2
    ]
    if differences:
        raise ValueError(
            f"this GPT is not GPT-2 architecture ({', '.join(differences)}), so it cannot be exported as a "
            f"Hugging Face GPT2LMHeadModel; use `consolidate` (lightning-3d consolidate CKPT_DIR OUT) for a dense "
            f"checkpoint that GPTModule.load_from_checkpoint loads."
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

    def dims(self, model: nn.Module) -> ModelDims:
        c = model.config
        names = dict(n_layer="n_layer", hidden="n_embd", n_head="n_head", n_kv_head="n_kv_head", ffn="ffn_dim")
        return ModelDims(
            c.n_layer, c.n_embd, c.n_head, c.kv_heads, c.ffn_dim, labels={k: f"GPTConfig.{v}" for k, v in names.items()}
        )

    def model_shape(self, model: nn.Module, seq_len: int) -> ModelShape:
        return ModelShape.from_config(asdict(model.config), seq_len)

    def hf_export(self, model_config: Any) -> tuple[Any, list[ExportTensor]]:
        """``model_config``: the ``GPTConfig`` (or its dict, as ``GPTModule`` checkpoints record it).
        GPT-2 architecture -> ``GPT2Config`` and :func:`gpt2_tensors`."""
        cfg = model_config if isinstance(model_config, GPTConfig) else GPTConfig(**dict(model_config))
        if _is_llama_style(cfg):
            raise NotImplementedError(
                "exporting a Llama-style GPT (position='rope', mlp='swiglu', norm='rmsnorm') to a Hugging Face "
                "LlamaForCausalLM is not implemented yet; use `consolidate` (lightning-3d consolidate CKPT_DIR OUT) "
                "for a dense checkpoint that GPTModule.load_from_checkpoint loads."
            )
        _require_gpt2_architecture(cfg)
        from transformers import GPT2Config

        hf = GPT2Config(
            vocab_size=cfg.vocab_size, n_positions=cfg.block_size, n_embd=cfg.n_embd, n_layer=cfg.n_layer, n_head=cfg.n_head,
            n_inner=cfg.ffn_dim, activation_function="gelu_new", resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout,
            attn_pdrop=cfg.dropout, layer_norm_epsilon=1e-5, tie_word_embeddings=cfg.tie_embeddings,
            bos_token_id=None, eos_token_id=None,
        )
        return hf, gpt2_tensors(cfg)


GPT_ADAPTER = register_adapter(GPTAdapter())
