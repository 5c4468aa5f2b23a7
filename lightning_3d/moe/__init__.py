"""Mixture of experts: the top-k router, grouped experts and the MoE layer (issue 34).

Layer 3, beside the other degrees: model families build their MoE blocks from these pieces, and
expert parallelism will be applied to them from outside, as tensor parallelism is to linears.
"""

from lightning_3d.moe.experts import GroupedExperts, grouped_mm
from lightning_3d.moe.layer import MoE, SharedExperts, bind_sequence_group, take_aux_losses
from lightning_3d.moe.router import Routing, TopKRouter

__all__ = ["GroupedExperts", "MoE", "Routing", "SharedExperts", "TopKRouter", "bind_sequence_group", "grouped_mm", "take_aux_losses"]
