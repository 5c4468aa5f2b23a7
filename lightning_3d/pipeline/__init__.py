"""Pipeline parallelism: schedules (data), their simulator, the partition of layers into stages,
the runtime that executes a schedule inside a model's forward, and the contract a model meets to be
pipelined (:class:`LayerSequence`: give a model a ``pipeline_sequence()`` method returning one).

The names below load on first use: the schedules, their plans and the simulator need no torch, and
the planner (``lightning-3d plan``) imports them without paying for it."""

from __future__ import annotations

from typing import Any

__all__ = ["HeadOutput", "Inputs", "LayerSequence"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from lightning_3d.pipeline import sequences

        return getattr(sequences, name)
    raise AttributeError(f"module 'lightning_3d.pipeline' has no attribute {name!r}")
