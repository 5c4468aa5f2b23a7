"""Megatron-style tensor (and sequence) parallelism: mappings, layers, loss, RNG, plans."""

from lightning_3d.tensor_parallel.cross_entropy import CausalLMLoss, vocab_parallel_cross_entropy
from lightning_3d.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from lightning_3d.tensor_parallel.mappings import (
    copy_to_tensor_parallel,
    gather_for_column_parallel,
    gather_from_sequence_parallel,
    gather_from_tensor_parallel,
    reduce_from_tensor_parallel,
    reduce_scatter_to_sequence_parallel,
    scatter_to_sequence_parallel,
    scatter_to_tensor_parallel,
)
from lightning_3d.tensor_parallel.plans import (
    Column,
    DivideAttributes,
    PlanContext,
    PrepareInput,
    RNGRegion,
    Row,
    SequenceNorm,
    SequenceSplit,
    Style,
    TensorParallelPlan,
    VocabEmbedding,
    apply_plan,
    gather_logits_hook,
)
from lightning_3d.tensor_parallel.random import RNGStatesTracker
from lightning_3d.tensor_parallel.spec import TPSpec, get_spec

__all__ = [
    "CausalLMLoss",
    "Column",
    "ColumnParallelLinear",
    "DivideAttributes",
    "PlanContext",
    "PrepareInput",
    "RNGRegion",
    "RNGStatesTracker",
    "Row",
    "RowParallelLinear",
    "SequenceNorm",
    "SequenceSplit",
    "Style",
    "TPSpec",
    "TensorParallelPlan",
    "VocabEmbedding",
    "VocabParallelEmbedding",
    "apply_plan",
    "copy_to_tensor_parallel",
    "gather_for_column_parallel",
    "gather_logits_hook",
    "gather_from_sequence_parallel",
    "gather_from_tensor_parallel",
    "get_spec",
    "reduce_from_tensor_parallel",
    "reduce_scatter_to_sequence_parallel",
    "scatter_to_sequence_parallel",
    "scatter_to_tensor_parallel",
    "vocab_parallel_cross_entropy",
]
