"""Any Hugging Face causal LM, driven by the plans transformers ships with it.

The fallback adapter: it matches every ``...ForCausalLM`` no other adapter claims, and builds
every ``model_type`` transformers has a causal LM for. What it needs it reads from the model:

* tensor parallel: ``model.tp_plan`` (the config's ``base_model_tp_plan``, prefixed), translated by
  :mod:`~lightning_3d.models.adapters.hf_plans`;
* pipeline: ``model._pp_plan`` (``base_model_pp_plan``: embedding, layers, norm; and the head),
  run through the model's own forward by :mod:`~lightning_3d.models.adapters.hf_sequence`;
* recompute: the decoder layers (from the pipeline plan, else ``_no_split_modules``);
* sizes, shape and FLOPs: the config's standard fields;
* export: the model's own state-dict keys (:class:`HFAdapter`).

Layouts that need no plan (data parallel, ZeRO 1-3, offload, recompute) work for any family; the
others are refused naming what is missing and how to give it from the user's own code. A family
module subclasses this one only for what the plans do not say (Gemma's scaled embedding).
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from lightning_3d.core.layout_rules import ModelDims
from lightning_3d.core.model_shape import ModelShape
from lightning_3d.models.adapters.hf_common import HFAdapter, config_dims, config_shape
from lightning_3d.models.adapters.hf_moe import moe_blocks
from lightning_3d.models.adapters.hf_plans import hf_finalize, translate_tp_plan
from lightning_3d.models.adapters.hf_sequence import HFSequence, hf_pipeline_sequence, pipeline_plan
from lightning_3d.models.adapters.registry import register_adapter
from lightning_3d.pipeline.sequences import LayerSequence
from lightning_3d.tensor_parallel.plans import StyleSpec, TensorParallelPlan, matches_pattern
from lightning_3d.transforms.activation_checkpointing import attention_of


def is_hf_causal_lm(module: nn.Module) -> bool:
    """A transformers causal LM (``...ForCausalLM``, GPT-2's ``...LMHeadModel``), without importing
    transformers."""
    cls = type(module)
    return cls.__name__.endswith(("ForCausalLM", "LMHeadModel")) and any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.") for c in cls.__mro__
    )


def causal_lm_types() -> frozenset[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return frozenset(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _decoder_layers(model: nn.Module) -> Optional[tuple[str, str]]:
    """(base model attribute, layers attribute) of the list of decoder layers, from
    ``_no_split_modules`` (the class names transformers never splits across devices)."""
    keep = set(getattr(model, "_no_split_modules", None) or ())
    base = getattr(model, "base_model_prefix", "") or "model"
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) and all(type(m).__name__ in keep for m in module):
            head, _, rest = name.partition(".")
            if head == base and rest:
                return base, rest
    return None


def _attention_gathered(model: nn.Module, block: str, styles: dict[str, StyleSpec]) -> bool:
    """Whether the plan gives the attention of decoder layer ``block`` whole sequences under sequence
    parallelism (a shared entry, made for its column-parallel projections): attention the plan leaves
    whole (DeepSeek-V3's MLA has no entries) would attend within this rank's shard only."""
    try:
        attention = attention_of(model.get_submodule(block))
    except (AttributeError, ValueError):
        return False
    path = next((n for n, m in model.named_modules() if m is attention), "")
    return any(
        matches_pattern(path, pattern) and "share_entry" in (spec if isinstance(spec, list) else [spec])
        for pattern, spec in styles.items()
    )


class GenericHFAdapter(HFAdapter):
    name = "hf"
    fallback = True

    def matches(self, module: nn.Module) -> bool:
        return is_hf_causal_lm(module)

    def builds_hf_model_type(self, model_type: str) -> bool:
        return model_type in causal_lm_types()

    def embedding_style(self, model: nn.Module) -> Optional[StyleSpec]:
        """How the family splits its input embedding when it is not a plain ``nn.Embedding``."""
        return None

    def tp_plan(self, model: nn.Module) -> TensorParallelPlan:
        # sequence parallelism needs the pipeline plan's map: where the decoder layers start, which norms follow them
        pieces, _ = pipeline_plan(model, getattr(model, "_pp_plan", None))
        layers = f"{pieces.base}.{pieces.layers}" if pieces is not None else None
        styles, vocab_head = translate_tp_plan(model, getattr(model, "tp_plan", None), self.embedding_style(model), layers)
        sharded: list[str] = []  # what runs on sequence shards under SP: every decoder layer, the final norm(s)
        if pieces is not None:
            head = model.get_output_embeddings()
            sharded = [f"{layers}.{i}" for i in range(len(model.get_submodule(str(layers))))]
            sharded += [n for n in pieces.head_modules if model.get_submodule(n) is not head]
        return TensorParallelPlan(
            name=type(model).__name__,
            styles=styles,
            check=self.check_tensor_parallel,
            finalize=hf_finalize(model.config.vocab_size if vocab_head else None, sharded, [name for name, _ in moe_blocks(model)]),
            supports_sequence_parallel=pieces is not None and _attention_gathered(model, f"{layers}.0", styles),
        )

    def pipeline_refusal(self, model: nn.Module) -> Optional[str]:
        plan, why = pipeline_plan(model, getattr(model, "_pp_plan", None))
        if plan is not None:
            return None
        return (
            f"{type(model).__name__} cannot be pipelined: {why}. Give it a pipeline_sequence() method returning a "
            f"lightning_3d.pipeline.LayerSequence, register an adapter (lightning_3d.models.adapters.register_adapter), "
            f"or use pipeline_parallel=1."
        )

    def layer_sequence(self, model: nn.Module) -> LayerSequence:
        plan, _ = pipeline_plan(model, getattr(model, "_pp_plan", None))
        if plan is not None:
            return hf_pipeline_sequence(model, plan)
        # no pipeline plan: the decoder layers still serve recompute and the loss weighting
        found = _decoder_layers(model)
        if found is None:
            raise ValueError(
                f"{type(model).__name__}: lightning_3d found no list of decoder layers (no base_model_pp_plan, and no "
                f"ModuleList of its _no_split_modules); register an adapter, or leave activation checkpointing off."
            )
        return HFSequence(model, *found).sequence((), ())

    def dims(self, model: nn.Module) -> ModelDims:
        return config_dims(model.config)

    def model_shape(self, model: nn.Module, seq_len: int) -> ModelShape:
        return config_shape(model, seq_len)


HF_GENERIC = register_adapter(GenericHFAdapter())
