"""The adapter interface: everything lightning_3d knows about one model family, in one object.

Generic code (tensor-parallel plans, the pipeline runtime, recompute, checkpoints, the layout
rules, the planner) knows no model: it receives what it needs -- a :class:`TensorParallelPlan`,
a :class:`LayerSequence`, a recompute target, :class:`ModelDims` -- from an adapter, which
``parallelize`` finds through the registry (:mod:`lightning_3d.models.adapters.registry`).
A family is one module holding one :class:`ModelAdapter` subclass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from torch import Tensor, nn

from lightning_3d.core.layout_rules import ModelDims, raise_refusals, tensor_parallel_refusals
from lightning_3d.core.model_shape import ModelShape
from lightning_3d.pipeline.sequences import LayerSequence
from lightning_3d.tensor_parallel.plans import TensorParallelPlan
from lightning_3d.transforms.activation_checkpointing import attention_of

if TYPE_CHECKING:
    from lightning_3d.context_parallel.apply import ContextParallel
    from lightning_3d.core.config import LayoutOptions


def model_parallel_degrees(layout: "LayoutOptions") -> list[str]:
    """The degrees of ``layout`` above 1 that split a model or its sequences (``"tensor_parallel=2"``, ...)."""
    return [f"{name}={n}" for name, n in (
        ("tensor_parallel", layout.tensor_parallel), ("context_parallel", layout.context_parallel),
        ("pipeline_parallel", layout.pipeline_parallel), ("expert_parallel", layout.expert_parallel),
    ) if n > 1]


def _first(tensors: list[Tensor]) -> Tensor:
    return tensors[0]


@dataclass(frozen=True)
class ExportTensor:
    """One tensor of a Hugging Face state dict, made from tensors of our dense checkpoint.

    Args:
        key: the Hugging Face state-dict key.
        sources: dense tensor names in our checkpoint, relative to the model (no ``"model."``
            prefix); empty when ``combine`` makes the tensor alone (zero biases our model lacks).
        combine: the sources (in order) -> the Hugging Face tensor (e.g. cat + transpose for
            GPT-2's fused ``c_attn``); the identity on one source by default.
    """

    key: str
    sources: tuple[str, ...]
    combine: Callable[[list[Tensor]], Tensor] = _first


class ModelAdapter:
    """What lightning_3d needs to know about one model family. Subclass it in one module per family
    and register an instance (:func:`~lightning_3d.models.adapters.registry.register_adapter`).

    Attributes:
        name: the family's short name (``"gpt"``, ``"llama"``, ...), used in messages.
        hf_model_types: the Hugging Face ``config.model_type`` values this adapter builds and
            loads (``("llama",)``); ``()`` for models that are not Hugging Face's.
    """

    name: str = ""
    hf_model_types: tuple[str, ...] = ()
    fallback: bool = False  # consulted only when no other adapter matches (the generic HF adapter)

    def matches(self, module: nn.Module) -> bool:
        """Whether ``module`` is a model of this family (the whole model, not one of its layers)."""
        raise NotImplementedError

    def builds_hf_model_type(self, model_type: str) -> bool:
        """Whether this adapter builds and loads Hugging Face models of ``config.model_type``."""
        return model_type in self.hf_model_types

    def pipeline_refusal(self, model: nn.Module) -> Optional[str]:
        """Why ``model`` cannot be pipelined (a sentence naming what is missing), or None."""
        return None

    def tp_plan(self, model: nn.Module) -> TensorParallelPlan:
        """The Megatron-style tensor-parallel plan for ``model``."""
        raise NotImplementedError

    def layer_sequence(self, model: nn.Module) -> LayerSequence:
        """``model`` as ``inputs -> embed -> blocks -> head``, what pipeline stages divide."""
        raise NotImplementedError

    def recompute_target(self, block: nn.Module) -> nn.Module:
        """What ``activation_checkpointing="selective"`` recomputes in ``block``: the attention
        (its activations grow with the square of the sequence; its FLOPs are few)."""
        return attention_of(block)

    def context_parallel(self, model: nn.Module, cp: Optional["ContextParallel"]) -> None:
        """Make ``model`` compute on this rank's chunks of each sequence: its positions become
        ``cp.positions`` (the true positions of the local tokens) and its causal attention
        ``cp.attention`` (over the whole sequence, through the cp group); ``cp=None`` restores the
        whole-sequence defaults. Families without this wiring refuse context parallelism, before
        anything is sharded."""
        if cp is None:
            return
        raise NotImplementedError(
            f"context_parallel={cp.size}: the {self.name!r} model family has no context-parallel wiring in this "
            f"version (the reference GPT has, in GPT-2 and Llama architecture: lightning_3d.models.GPT); use "
            f"context_parallel=1, with tensor_parallel and sequence_parallel=True to divide a long sequence's "
            f"activations, or activation_checkpointing."
        )

    def dims(self, model: nn.Module) -> ModelDims:
        """The sizes a layout must divide, labelled with the names the user knows them by."""
        raise NotImplementedError

    def model_shape(self, model: nn.Module, seq_len: int) -> ModelShape:
        """The planner's description of ``model`` (sizes, parameters, FLOPs) at ``seq_len``."""
        raise NotImplementedError

    def flops_per_token(self, model: nn.Module, seq_len: int) -> float:
        """Training FLOPs (forward + backward, no recompute) per token at ``seq_len``: the planner's
        count (:meth:`ModelShape.step_flops`), so planner and model agree by construction."""
        return self.model_shape(model, seq_len).step_flops(1, 0.0) / seq_len

    def hf_export(self, model_config: Any) -> tuple[Any, list[ExportTensor]]:
        """``(transformers config, tensors)`` for writing a Hugging Face model directory from a dense
        checkpoint of this family; ``model_config`` is what the checkpoint records of the model."""
        raise NotImplementedError(f"the {self.name!r} adapter has no Hugging Face export.")

    # -- mixtures of experts in the family's own code (the reference GPT's are lightning_3d.moe layers) ------
    def moe_blocks(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """The family's own MoE blocks in ``model`` (path, module): what :meth:`apply_expert_parallel`
        splits. Families whose MoE layers are ``lightning_3d.moe`` layers, or that have none: ``[]``."""
        return []

    def expert_refusal(self, model: nn.Module, layout: "LayoutOptions") -> Optional[str]:
        """Why ``model``'s own MoE blocks cannot run at ``layout`` (a sentence naming the way out), or
        None. By default a family's own experts train under data parallelism and ZeRO only."""
        degrees = model_parallel_degrees(layout)
        if not degrees or not self.moe_blocks(model):
            return None
        return (
            f"its mixture-of-experts layers are its own code, which the {self.name!r} adapter does not split, so not at "
            f"{', '.join(degrees)}; set those degrees to 1"
        )

    def apply_expert_parallel(self, model: nn.Module, **split: Any) -> int:
        """Split ``model``'s own MoE blocks (the keywords of
        :func:`lightning_3d.moe.expert_parallel.apply_expert_parallel`); returns how many it has."""
        return 0

    def average_router_loss(self, model: nn.Module, replicas: Any, context_parallel: int) -> None:
        """Training under data parallelism (``replicas``: the group of ``model``'s weight replicas):
        make the router loss the family computes from batch statistics, if any, the whole batch's."""

    # -- shared by the plans ----------------------------------------------------------------------------
    def check_tensor_parallel(self, model: nn.Module, tp: int) -> None:
        """A plan's check: ``model`` can be split ``tp`` ways (the rules the strategy and the planner
        share); raises naming every size that does not divide, before anything is sharded."""
        raise_refusals(tensor_parallel_refusals(tp, self.dims(model)))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
