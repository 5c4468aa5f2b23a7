"""Model adapters: one module per model family, one registry (see ``base.py`` for the interface).

Everything lightning_3d knows about a family -- its tensor-parallel plan, its layer sequence for
pipelining, its recompute target, its shape and FLOPs, its Hugging Face key mapping -- lives in
that family's module; generic code receives these from ``parallelize`` and imports no model.
"""

from lightning_3d.models.adapters.base import ExportTensor, ModelAdapter
from lightning_3d.models.adapters.registry import (
    adapter_for,
    adapter_for_hf_config,
    adapter_named,
    adapters,
    find_models,
    find_sequences,
    known_names,
    models_in,
    register_adapter,
    unregister_adapter,
)

__all__ = [
    "ExportTensor",
    "ModelAdapter",
    "adapter_for",
    "adapter_for_hf_config",
    "adapter_named",
    "adapters",
    "find_models",
    "find_sequences",
    "known_names",
    "models_in",
    "register_adapter",
    "unregister_adapter",
]
