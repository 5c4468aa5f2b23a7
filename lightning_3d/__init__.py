"""lightning_3d: 3D parallelism (data x tensor x pipeline, ZeRO) as a PyTorch Lightning strategy.

Importing this package registers the strategy name ``"3d"`` with Lightning, so
``Trainer(strategy="3d")`` works. The names below load on first use (PEP 562) and the registration
happens when Lightning is imported (lightning_3d/plugins/registration.py): a process that only plans
or exports, or asks for ``--version``, never pays Lightning's import.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from lightning_3d.core import __version__
from lightning_3d.plugins.registration import register_when_lightning_loads

_HOMES = {
    "Coordinates": "lightning_3d.core.topology",
    "ParallelConfig": "lightning_3d.core.config",
    "ParallelDims": "lightning_3d.core.dims",
    "ThreeDParallelStrategy": "lightning_3d.plugins.strategy",
    "Topology": "lightning_3d.core.topology",
    "from_pretrained": "lightning_3d.checkpoint.pretrained",
    "load_from_checkpoint": "lightning_3d.checkpoint.consolidate",
    "load_pretrained_": "lightning_3d.checkpoint.pretrained",
}

__all__ = sorted([*_HOMES, "__version__"])


def __getattr__(name: str) -> Any:
    register_when_lightning_loads()  # (cheap once registered)
    home = _HOMES.get(name)
    if "." in name:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if home is not None:
        value = getattr(importlib.import_module(home), name)
    elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")  # lightning_3d.checkpoint without importing it first
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])


register_when_lightning_loads()
