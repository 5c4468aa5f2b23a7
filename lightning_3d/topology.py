"""Parallel degrees (dp, tp, pp), the rank layout they imply, and the process groups.

Rank order is ``(pp, dp, tp)`` with tp innermost: the ``tp`` ranks of one model replica
slice are adjacent global ranks, so with ``tp <= GPUs per node`` they share a node and its
fast links; pipeline stages are the outermost dimension, so their (rare, point-to-point)
traffic is what crosses nodes. ``rank = (pp_rank * dp + dp_rank) * tp + tp_rank``.

:class:`ParallelDims` is pure arithmetic (no processes needed, so layouts of 1024 ranks are
testable); :class:`Topology` binds it to a live ``torch.distributed`` world through a
``DeviceMesh`` whose dims are named ``("pp", "dp", "tp")``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Literal, NamedTuple, Optional, Union

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS: tuple[str, str, str] = ("pp", "dp", "tp")

Degree = Union[int, Literal["auto"]]


class Coordinates(NamedTuple):
    """Where one global rank sits in the 3D layout."""

    pp: int
    dp: int
    tp: int


def _check_degree(name: str, value: object, allow_auto: bool) -> None:
    if allow_auto and value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        hint = ' or "auto"' if allow_auto else ""
        raise ValueError(f"{name}={value!r} is invalid: it must be a positive integer{hint}.")


@dataclass(frozen=True)
class ParallelDims:
    """The three parallel degrees. ``dp="auto"`` takes whatever ``tp * pp`` leaves of the world."""

    dp: Degree = "auto"
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        _check_degree("data_parallel", self.dp, allow_auto=True)
        _check_degree("tensor_parallel", self.tp, allow_auto=False)
        _check_degree("pipeline_parallel", self.pp, allow_auto=False)

    def resolve(self, world_size: int) -> "ParallelDims":
        """Return concrete degrees for ``world_size`` ranks, or raise ``ValueError`` naming the mismatch."""
        if world_size < 1:
            raise ValueError(f"world_size={world_size} is invalid: it must be at least 1.")
        model_parallel = self.tp * self.pp
        if self.dp == "auto":
            if world_size % model_parallel != 0:
                raise ValueError(
                    f"tensor_parallel={self.tp} x pipeline_parallel={self.pp} = {model_parallel} does not divide "
                    f"the world size {world_size}; choose degrees whose product divides the number of processes "
                    f"(devices x num_nodes)."
                )
            return ParallelDims(dp=world_size // model_parallel, tp=self.tp, pp=self.pp)
        if self.dp * model_parallel != world_size:
            raise ValueError(
                f"data_parallel={self.dp} x tensor_parallel={self.tp} x pipeline_parallel={self.pp} = "
                f"{self.dp * model_parallel}, but the world size is {world_size} (devices x num_nodes). "
                f'Make the product equal the world size, or set data_parallel="auto".'
            )
        return self

    @property
    def world_size(self) -> int:
        self._require_resolved()
        return int(self.dp) * self.tp * self.pp

    @property
    def shape(self) -> tuple[int, int, int]:
        """Mesh shape in ``MESH_DIMS`` order."""
        self._require_resolved()
        return (self.pp, int(self.dp), self.tp)

    def coordinates(self, rank: int) -> Coordinates:
        """The (pp, dp, tp) coordinates of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside a world of {self.world_size} ranks.")
        dp = int(self.dp)
        return Coordinates(pp=rank // (dp * self.tp), dp=(rank // self.tp) % dp, tp=rank % self.tp)

    def rank_of(self, coords: Coordinates) -> int:
        """Inverse of :meth:`coordinates`."""
        return (coords.pp * int(self.dp) + coords.dp) * self.tp + coords.tp

    def group_ranks(self, dim: str, rank: int) -> list[int]:
        """Global ranks of the ``dim`` group ("pp", "dp" or "tp") that contains ``rank``, in group order."""
        if dim not in MESH_DIMS:
            raise ValueError(f"dim={dim!r} is not one of {MESH_DIMS}.")
        base = self.coordinates(rank)
        size = dict(zip(MESH_DIMS, self.shape))[dim]
        return [self.rank_of(base._replace(**{dim: i})) for i in range(size)]

    def check_nodes(self, processes_per_node: int) -> None:
        """Tensor-parallel groups must stay inside one node (they all-reduce every layer)."""
        self._require_resolved()
        if processes_per_node % self.tp != 0:
            raise ValueError(
                f"tensor_parallel={self.tp} does not divide the {processes_per_node} processes per node, so a "
                f"tensor-parallel group would span nodes. Use a tensor_parallel that divides devices per node."
            )

    def _require_resolved(self) -> None:
        if self.dp == "auto":
            raise ValueError('ParallelDims(dp="auto") must be resolved against a world size first: call .resolve().')

    def __str__(self) -> str:
        return f"dp={self.dp} x tp={self.tp} x pp={self.pp}"


class Topology:
    """A live layout: the ``DeviceMesh``, this rank's coordinates and its process groups.

    Built once by the strategy after the default process group exists, then passed explicitly
    to whatever needs a group; nothing here is a module-level global.
    """

    def __init__(self, dims: ParallelDims, mesh: DeviceMesh) -> None:
        self.dims = dims
        self.mesh = mesh
        self.rank = dist.get_rank()
        self.coords = dims.coordinates(self.rank)

    @classmethod
    def build(cls, dims: ParallelDims, device_type: str = "cpu") -> "Topology":
        """Create the mesh over the already initialized default process group (collective on all ranks)."""
        dims = dims.resolve(dist.get_world_size())
        mesh = init_device_mesh(device_type, dims.shape, mesh_dim_names=MESH_DIMS)
        return cls(dims, mesh)

    def group(self, dim: str) -> dist.ProcessGroup:
        return self.mesh.get_group(dim)

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.group("dp")

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.group("tp")

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.group("pp")

    @property
    def dp_size(self) -> int:
        return int(self.dims.dp)

    @property
    def dp_rank(self) -> int:
        return self.coords.dp

    @property
    def tp_rank(self) -> int:
        return self.coords.tp

    @property
    def pp_rank(self) -> int:
        return self.coords.pp

    @property
    def is_first_stage(self) -> bool:
        return self.coords.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords.pp == self.dims.pp - 1

    def embedding_group(self) -> dist.ProcessGroup:
        """The first and last pipeline stage of this rank's (dp, tp) position: they hold copies of
        tied embedding/LM-head weights. Created on first use, collectively on every rank."""
        if getattr(self, "_embedding_group", None) is None:
            dims, mine = self.dims, None
            for dp in range(int(dims.dp)):
                for tp in range(dims.tp):
                    ranks = sorted({dims.rank_of(Coordinates(0, dp, tp)), dims.rank_of(Coordinates(dims.pp - 1, dp, tp))})
                    group = dist.new_group(ranks)
                    if self.rank in ranks:
                        mine = group
            self._embedding_group = mine
        return self._embedding_group  # type: ignore[return-value]

    def dp_source_rank(self) -> int:
        """Global rank of dp-rank 0 in this rank's dp group (the source for replica broadcasts)."""
        return self.dims.rank_of(self.coords._replace(dp=0))

    def tp_source_rank(self) -> int:
        """Global rank of tp-rank 0 in this rank's tp group (the source of tensor-parallel replicas)."""
        return self.dims.rank_of(self.coords._replace(tp=0))

    def first_stage_rank(self) -> int:
        """Global rank of the first pipeline stage at this rank's (dp, tp) position."""
        return self.dims.rank_of(self.coords._replace(pp=0))

    def __repr__(self) -> str:
        c = self.coords
        return f"Topology({self.dims}, rank={self.rank}: pp={c.pp} dp={c.dp} tp={c.tp})"


_current: ContextVar[Optional[Topology]] = ContextVar("lightning_3d_topology", default=None)


@contextmanager
def use_topology(topology: Topology) -> Iterator[Topology]:
    """Make ``topology`` the default for layers built inside (the strategy wraps ``configure_model``)."""
    token = _current.set(topology)
    try:
        yield topology
    finally:
        _current.reset(token)


def current_topology() -> Optional[Topology]:
    """The topology set by :func:`use_topology`, if any. Always overridable by an explicit argument."""
    return _current.get()
