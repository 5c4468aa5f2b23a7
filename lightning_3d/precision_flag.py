"""Refuse ``Trainer(precision=...)`` values the strategy cannot run, before Lightning builds them.

Lightning turns the precision string into a plugin before the strategy sees it; for
``"transformer-engine"`` that means an ``ImportError`` asking the user to install a package the
strategy would then refuse anyway. Wrapping that one connector step lets the strategy answer
first, with the values it does support.
"""

from __future__ import annotations

import functools
from typing import Any

SUPPORTED = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")


def unsupported_precision(name: Any) -> ValueError:
    return ValueError(
        f"precision={name!r} is not supported by ThreeDParallelStrategy; use "
        f"{', '.join(repr(p) for p in SUPPORTED[:-1])} or {SUPPORTED[-1]!r}."
    )


def install() -> None:
    """Check the precision flag for the 3d strategy ahead of Lightning's plugin construction (idempotent)."""
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    original = _AcceleratorConnector._check_and_init_precision
    if getattr(original, "_lightning_3d", False):
        return

    @functools.wraps(original)
    def check_then_init(self: Any) -> Any:
        from lightning_3d.strategy import ThreeDParallelStrategy

        flag = getattr(self, "_precision_flag", None)
        if isinstance(self.strategy, ThreeDParallelStrategy) and getattr(self, "_precision_plugin_flag", None) is None:
            if isinstance(flag, str) and flag not in SUPPORTED:
                raise unsupported_precision(flag)
        return original(self)

    check_then_init._lightning_3d = True  # type: ignore[attr-defined]
    _AcceleratorConnector._check_and_init_precision = check_then_init  # type: ignore[method-assign]
