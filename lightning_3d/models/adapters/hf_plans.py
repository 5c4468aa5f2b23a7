"""transformers' own tensor-parallel plans, translated onto our Megatron-style layers.

Most decoder configs in transformers 5 carry ``base_model_tp_plan``: module patterns relative to
the base model, each with one of transformers' style names. They say what DTensor does to each
module; here each becomes one of our styles (:mod:`lightning_3d.tensor_parallel.plans`):

==================================  ===================================================================
transformers                        lightning_3d
==================================  ===================================================================
``colwise``                         column-parallel; siblings reading one tensor share one entry
``rowwise``                         row-parallel (input already split, output all-reduced)
``colwise_gather_output``           column-parallel, output all-gathered (a norm over all heads follows)
``rowwise_split_input``             row-parallel of a replicated input (split here)
``packed_colwise``                  column-parallel in two blocks (fused gate/up)
``replicated_with_grad_allreduce``  replicated, gradients summed over tp (per-head norms on local heads)
``embedding_rowwise``               vocabulary-parallel embedding
==================================  ===================================================================

Beyond the plan, the input embedding (an ``nn.Embedding``) becomes vocabulary-parallel and the
output embedding (an ``nn.Linear``) a vocabulary-parallel head whose loss stays split
(``CausalLMLoss``), as Megatron does; an embedding of another class (Gemma's scaled one) keeps
its own code and stays replicated unless its family module says how to split it. The entries for
a mixture of experts' experts are left out: the experts are split whole over the tp ranks
instead (:mod:`~lightning_3d.models.adapters.hf_moe`). Any other style is refused by name before
anything is sharded.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from torch import nn

from lightning_3d.models.adapters.hf_moe import is_expert_entry, moe_blocks
from lightning_3d.tensor_parallel.cross_entropy import CausalLMLoss
from lightning_3d.tensor_parallel.plans import (
    Column,
    PlanContext,
    Row,
    Style,
    StyleSpec,
    VocabEmbedding,
    gather_logits_hook,
    matches_pattern,
    mark_sequence_sharded_replicas,
)
from lightning_3d.tensor_parallel.random import run_forward_in_rng_region, run_forward_outside_rng_region

HF_STYLES: dict[str, StyleSpec] = {
    "colwise": "column",
    "rowwise": "row",
    "colwise_gather_output": Column(gather_output=True),
    "rowwise_split_input": Row(input_is_parallel=False),
    "packed_colwise": Column(num_blocks=2),
    "replicated_with_grad_allreduce": "sum_gradients",
    "embedding_rowwise": "vocab",
}
# column-parallel styles: their parent module gets one shared entry into the tp region (and, under
# sequence parallelism, its input gathered whole: HF attention reads the sequence length from it)
COLUMNS = ("colwise", "colwise_gather_output", "packed_colwise")
# those that split heads: the parent also draws dropout from a per-rank stream (this rank's heads)
SPLITS_HEADS = ("colwise", "packed_colwise")


class HeadsRNG(Style):
    """Randomness of a module that computes on this rank's heads (attention, MLP): what it draws
    itself -- attention-probability dropout inside the attention function -- comes from a per-rank
    stream, while its dropout *modules* draw from the replicated one: in these families they act
    after the row-parallel reduction, on the residual stream every tp rank holds alike (Starcoder2's
    ``residual_dropout``). Under sequence parallelism that stream is a different shard on each rank,
    so everything inside stays per-rank."""

    def apply(self, module: nn.Module, ctx: PlanContext) -> None:
        if ctx.tracker is None:
            raise ValueError("tensor-parallel randomness needs an RNGStatesTracker in the plan context.")
        run_forward_in_rng_region(module, ctx.tracker)
        if not ctx.sequence_parallel:
            for sub in module.modules():
                if isinstance(sub, nn.Dropout):
                    run_forward_outside_rng_region(sub, ctx.tracker)


HEADS_RNG = HeadsRNG()


class PlanRefused(ValueError):
    """transformers' plan says something our layers cannot do (named in the message)."""


def _parent(pattern: str) -> str:
    return pattern.rpartition(".")[0]


def translate_tp_plan(
    model: nn.Module, plan: Optional[dict[str, str]], embedding_style: Optional[StyleSpec] = None, layers: Optional[str] = None
) -> tuple[dict[str, StyleSpec], bool]:
    """Our styles for ``model`` from transformers' plan (``model.tp_plan``: patterns from the causal
    LM, the base model's prefixed); returns ``(styles, vocab_parallel_head)``. ``embedding_style``
    overrides the input embedding's (a family whose embedding is not a plain ``nn.Embedding``);
    ``layers``: the decoder layers' path, which sequence parallelism needs (cut at the first
    layer's input; per-rank dropout on shards). Raises :class:`PlanRefused` naming what is missing."""
    family = type(model).__name__
    names = {module: name for name, module in model.named_modules()}
    embedding = getattr(model, "get_input_embeddings", lambda: None)()
    head = getattr(model, "get_output_embeddings", lambda: None)()
    embed_name, head_name = names.get(embedding), names.get(head)
    # An MoE block's experts are split by expert parallelism's tensor-parallel share instead (hf_moe). And one
    # plan serves every configuration of an MoE family: Qwen3-MoE's names the dense MLPs of its mlp_only_layers,
    # at the paths of MoE blocks, which a model whose every block has experts lacks: such entries are dropped.
    blocks = [name for name, _ in moe_blocks(model)]
    layer_styles = {
        k: v for k, v in (plan or {}).items()
        if k not in (embed_name, head_name) and not is_expert_entry(k, v)
        and (any(matches_pattern(n, k) for n in names.values()) or not any(matches_pattern(b, _parent(k)) for b in blocks))
    }
    if not layer_styles:
        raise PlanRefused(
            f"{family} has no tensor-parallel plan (transformers' config for model_type="
            f"{getattr(getattr(model, 'config', None), 'model_type', '?')!r} carries no base_model_tp_plan), so "
            f"lightning_3d does not know how to split its layers. Give it one from your own code: set "
            f"model.config.base_model_tp_plan = {{'layers.*.self_attn.q_proj': 'colwise', ...}} before the Trainer "
            f"sets it up, pass ThreeDParallelStrategy(tensor_parallel_plan={{module pattern: style}}), or register an "
            f"adapter (lightning_3d.models.adapters.register_adapter; docs/huggingface.md). Or use tensor_parallel=1: "
            f"data parallel and ZeRO 1-3 need no plan."
        )
    styles: dict[str, Any] = {}
    for pattern, style in layer_styles.items():
        if style not in HF_STYLES:
            raise PlanRefused(
                f"{family}: transformers' tensor-parallel plan gives {pattern} the style {style!r}, which lightning_3d "
                f"does not map (it maps {', '.join(HF_STYLES)}); "
                f"use tensor_parallel=1, or pass your own tensor_parallel_plan."
            )
        styles[pattern] = HF_STYLES[style]
        if style in COLUMNS:  # one entry per input tensor (under SP: whole sequences inside the parent)
            parent = styles.setdefault(_parent(pattern), ["share_entry"])
            if style in SPLITS_HEADS and HEADS_RNG not in parent:
                parent.append(HEADS_RNG)
    for pattern in [p for p in styles if any(matches_pattern(b, p) for b in blocks)]:
        # a dense MLP's shared entry whose pattern an MoE block matches too (Qwen3-MoE's mlp_only_layers): the
        # block gathers its own input (hf_moe), so the entry is kept for the dense modules only, by name
        spec = styles.pop(pattern)
        for name in names.values():
            if matches_pattern(name, pattern) and name not in blocks:
                styles[name] = spec
    if embed_name:
        if embedding_style is not None:
            styles[embed_name] = embedding_style
        elif type(embedding) is nn.Embedding:
            styles[embed_name] = VocabEmbedding(split_sequence=False)  # the forward builds masks from its length
    if layers is not None:  # (each does something only under sequence parallelism)
        styles[f"{layers}.0"] = ["sequence_split_input", "sequence_rng"]
        styles[f"{layers}.*"] = "sequence_rng"
    tied = embedding is not None and head is not None and getattr(head, "weight", None) is getattr(embedding, "weight", 0)
    vocab_head = bool(head_name) and type(head) is nn.Linear and (not tied or embed_name in styles)
    if vocab_head:
        styles[head_name] = "vocab_head"
    return styles, vocab_head


def vocab_parallel_loss(vocab_size: int) -> Callable[[nn.Module, PlanContext], None]:
    """A plan's ``finalize`` for a vocabulary-parallel head: the model's ``loss_function`` (what HF's
    forward calls) becomes vocab-parallel, and logits returned without labels are gathered."""

    def finalize(m: nn.Module, ctx: PlanContext) -> None:
        m.loss_function = CausalLMLoss(ctx.tp_group, vocab_size)
        m.register_forward_hook(gather_logits_hook(vocab_size, ctx))

    return finalize


def hf_finalize(
    vocab_size: Optional[int], sharded: list[str], gathering: Sequence[str] = ()
) -> Callable[[nn.Module, PlanContext], None]:
    """After the plan: the vocab-parallel loss (``vocab_size``: the head is split), and under sequence
    parallelism the replicated parameters applied to sequence shards (the decoder layers' norms,
    the final norm: ``sharded`` module paths) marked for gradient sums over tp, except inside
    ``gathering``: modules that gather the sequence themselves (MoE blocks, whose expert split
    marks what it must: :mod:`~lightning_3d.models.adapters.hf_moe`)."""
    loss = vocab_parallel_loss(vocab_size) if vocab_size is not None else None

    def finalize(m: nn.Module, ctx: PlanContext) -> None:
        if loss is not None:
            loss(m, ctx)
        if ctx.sequence_parallel:
            skip = [m.get_submodule(path) for path in gathering]
            for path in sharded:
                mark_sequence_sharded_replicas(m.get_submodule(path), ctx.tp_group, skip)

    return finalize
