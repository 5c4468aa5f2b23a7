"""Everything lightning_3d records about a parameter, in one typed record behind accessors.

A parameter of a parallelized model may carry: its tensor-parallel spec (how it relates to the
dense tensor), the gradient hook that sums a sequence-parallel replica's gradient over tp (and the
one that scales an expert slice's gradient under ZeRO-0: hooks a pipeline defers alike), the tp
group whose partial gradients ZeRO-3 sums instead (FSDP2 dropped the hook), whether it is a
pipeline stage's copy of a weight another stage owns (a tied embedding: counted once), and the
ranks that hold copies of it when not every weight replica does (experts under expert parallelism). The record is
immutable and replaced on every change, so two parameters that ever share one (a copied ``__dict__``)
can never change each other. Written during set-up (``parallelize`` and the transforms it applies,
ZeRO-0's reducer when it is built) and by that reducer's removal at teardown; read everywhere else
through :func:`meta_of`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from torch import Tensor

_ATTR = "lightning_3d_meta"


@dataclass(frozen=True)
class ParameterMeta:
    tp_spec: Any = None  # a lightning_3d.tensor_parallel.spec.TPSpec; None: not tensor-parallel
    sequence_parallel_hook: Any = None  # the SumOverGroup gradient hook on it (``taken`` while a ZeRO 0-2 reducer sums its bucket)
    arrival_scale_hook: Any = None  # ZeRO-0's ScaleOnArrival hook on an expert slice or SP replica (zero/grad_reducer.py)
    partial_gradient_group: Any = None  # ZeRO-3: the tp group its partial gradient is summed over at the step
    pipeline_duplicate: bool = False  # a later stage's copy of a tied weight the first stage owns
    # a 1-D DeviceMesh of the ranks holding copies of it when they are fewer than the dp x cp replicas
    # (an expert slice: its expert replicas); None: every weight replica holds it
    replica_mesh: Any = None


EMPTY = ParameterMeta()


def meta_of(param: Tensor) -> ParameterMeta:
    return getattr(param, _ATTR, EMPTY)


def update_meta(param: Tensor, **changes: Any) -> None:
    setattr(param, _ATTR, replace(meta_of(param), **changes))


def set_meta(param: Tensor, meta: ParameterMeta) -> None:
    setattr(param, _ATTR, meta)


def is_pipeline_duplicate(param: Tensor) -> bool:
    return meta_of(param).pipeline_duplicate


def replica_mesh_of(param: Tensor) -> Any:
    """The mesh of the ranks holding copies of ``param`` when fewer than every weight replica, else None."""
    return meta_of(param).replica_mesh
