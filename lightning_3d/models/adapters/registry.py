"""The registry of model adapters: the one indirection between generic code and model families.

Built-in families are registered on first use (``BUILTIN``: one module each, which registers its
adapter when imported). Adding a family is one new module with a :class:`ModelAdapter` subclass,
plus its name in ``BUILTIN`` (or a ``register_adapter`` call by the user's own code).
"""

from __future__ import annotations

import importlib
from typing import Any, Optional

from torch import nn

from lightning_3d.core.layout_rules import ModelDims
from lightning_3d.models.adapters.base import ModelAdapter
from lightning_3d.pipeline.sequences import LayerSequence

BUILTIN = ("gpt", "gpt2", "gemma", "hf_generic")  # modules of this package, each registering its adapter

_adapters: list[ModelAdapter] = []
_builtins_loaded = False


def register_adapter(adapter: ModelAdapter) -> ModelAdapter:
    """Make ``adapter`` known (replacing one of the same name); returns it."""
    if not adapter.name:
        raise ValueError(f"{type(adapter).__name__}: an adapter needs a name.")
    for i, known in enumerate(_adapters):
        if known.name == adapter.name:
            _adapters[i] = adapter
            return adapter
    _adapters.append(adapter)
    return adapter


def unregister_adapter(name: str) -> None:
    """Forget the adapter called ``name`` (a user's adapter, e.g. at the end of a test)."""
    _adapters[:] = [a for a in _adapters if a.name != name]


def adapters() -> list[ModelAdapter]:
    """Every registered adapter (the built-in ones are imported, and so registered, on first use),
    fallbacks last: an adapter the user registers wins over the generic one for its models."""
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        for name in BUILTIN:
            importlib.import_module(f"{__package__}.{name}")
    return [a for a in _adapters if not a.fallback] + [a for a in _adapters if a.fallback]


def known_names() -> str:
    """The registered families, for messages: ``"gpt, llama, gpt2, qwen2"``."""
    return ", ".join(a.name for a in adapters())


def adapter_named(name: str) -> ModelAdapter:
    """The registered adapter called ``name`` (``"gpt"``, ...)."""
    for adapter in adapters():
        if adapter.name == name:
            return adapter
    raise ValueError(f"no model adapter named {name!r}; known: {known_names()}.")


def adapter_for(module: nn.Module) -> Optional[ModelAdapter]:
    """The adapter of ``module``'s family, or None if no registered family matches it."""
    for adapter in adapters():
        if adapter.matches(module):
            return adapter
    return None


def adapter_for_hf_config(config: Any) -> ModelAdapter:
    """The adapter that builds and loads Hugging Face models of ``config.model_type`` (a
    ``PretrainedConfig`` or its dict)."""
    model_type = config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)
    for adapter in adapters():
        if adapter.builds_hf_model_type(str(model_type)):
            return adapter
    raise ValueError(
        f"no model adapter for the Hugging Face model_type={model_type!r}: it is not a causal language model "
        f"transformers knows (adapters: {known_names()}). Register an adapter from your own code "
        f"(lightning_3d.models.adapters.register_adapter(MyAdapter()), a ModelAdapter subclass: docs/huggingface.md)."
    )


def _outermost(name: str, found: list[str]) -> bool:
    return not any(prefix == "" or name.startswith(prefix + ".") for prefix in found)


def find_models(root: nn.Module) -> list[tuple[str, nn.Module, ModelAdapter]]:
    """(name, module, adapter) for the outermost modules inside ``root`` (``root`` included) that a
    registered family matches."""
    found: list[tuple[str, nn.Module, ModelAdapter]] = []
    for name, module in root.named_modules():
        if not _outermost(name, [f[0] for f in found]):
            continue
        adapter = adapter_for(module)
        if adapter is not None:
            found.append((name, module, adapter))
    return found


def find_sequences(root: nn.Module) -> list[tuple[str, nn.Module, LayerSequence, Optional[ModelAdapter]]]:
    """(name, module, sequence, adapter) for the outermost pipelinable models inside ``root``: those
    that declare ``pipeline_sequence()`` (the user protocol; it takes precedence) and those a
    registered family matches. ``adapter`` is None for a declared model no family knows."""
    found: list[tuple[str, nn.Module, LayerSequence, Optional[ModelAdapter]]] = []
    for name, module in root.named_modules():
        if not _outermost(name, [f[0] for f in found]):
            continue
        adapter = adapter_for(module)
        declared = getattr(module, "pipeline_sequence", None)
        if callable(declared):
            found.append((name, module, declared(), adapter))
        elif adapter is not None:
            found.append((name, module, adapter.layer_sequence(module), adapter))
    return found


def models_in(root: nn.Module) -> list[tuple[str, ModelDims]]:
    """(name, shape) of the outermost known models inside ``root``, for the layout rules."""
    return [(name, adapter.dims(module)) for name, module, adapter in find_models(root)]
