"""Parallel degrees (dp, cp, tp, pp), the rank layout they imply, and the process groups.

Rank order is ``(pp, dp, cp, tp)`` with tp innermost: the ``tp`` ranks of one model replica
slice are adjacent global ranks, so with ``tp <= GPUs per node`` they share a node and its
fast links; context-parallel peers (which exchange K/V every layer) come next, so ``cp x tp``
ranks fill a node before dp does; pipeline stages are the outermost dimension, so their (rare,
point-to-point) traffic is what crosses nodes.
``rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank``.

Context-parallel ranks hold the same weights and different tokens of the same sequences, so
every group that reduces gradients or shards ZeRO state spans dp x cp: that is
:attr:`Topology.dp_group` (the "weight replicas"); only the sampler splits samples over dp alone.

Expert parallelism (``ep``) takes no ranks of its own: it splits the ``R = dp x cp`` weight replicas
into groups of ``ep`` adjacent ones (replica index ``r = edp_rank * ep + ep_rank``), each group holding
every expert once; the ``R / ep`` ranks that hold the same experts are the *expert replicas*.

:class:`ParallelDims` is pure arithmetic (no processes needed, so layouts of 1024 ranks are
testable); :class:`Topology` binds it to a live ``torch.distributed`` world through a
``DeviceMesh`` whose dims are named ``("pp", "dp", "cp", "tp")``, with ``dp`` and ``cp``
flattened into one more dim, ``"dp_cp"``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

# the degrees' arithmetic lives without torch (the planner's path); re-exported here for the callers
from lightning_3d.core.dims import EXPERT_DIMS, MESH_DIMS, REPLICA_DIM, Coordinates, Degree, ParallelDims

__all__ = [
    "EXPERT_DIMS", "MESH_DIMS", "REPLICA_DIM", "Coordinates", "Degree", "ParallelDims", "Topology", "current_topology",
    "destroy_world", "suspect_groups", "use_topology",
]


# Every Topology built in this process, by (degrees, device type), for the default group under
# "world". Each process group holds threads (gloo: three per group) or a communicator's device
# buffers (NCCL) until it is destroyed, and a fit cannot destroy its groups at teardown: DTensors
# made on its mesh (ZeRO-3's parameters) stay usable after fit, which needs them. So a second
# strategy in the same process (a sweep, a new Trainer, the composition matrix's cells) reuses the
# groups of a layout built before, and a process holds one set per distinct layout. Before this, 25
# eight-rank fits had left 244 gloo groups and 735 threads in every rank (issue 33's full matrix).
_BUILT: dict = {}
# Set when a fit failed in this process: it may have left messages in flight on its groups (an
# ``isend`` one rank posted before the exception, a collective one rank entered), which a later fit
# on the same groups would match in place of its own. The next build then makes new groups.
_SUSPECT = [False]


def suspect_groups() -> None:
    """A fit failed here: the next :meth:`Topology.build` makes every layout's groups anew, on every rank."""
    _SUSPECT[0] = True


def _any_rank_failed(device: torch.device) -> bool:
    """Whether any rank called :func:`suspect_groups` since its last build: one flag, all-reduced, so
    every rank decides alike (a rank that made new groups alone would shift torch's group numbering)."""
    failed = torch.tensor([float(_SUSPECT[0])], device=device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    return bool(failed.item())


def destroy_world() -> None:
    """Destroy the default process group, dropping the layouts built on it first, so no reference to
    its groups outlives it (gloo groups torn down at interpreter exit can abort the process)."""
    _BUILT.clear()
    dist.destroy_process_group()


class Topology:
    """A live layout: the ``DeviceMesh``, this rank's coordinates and its process groups.

    Built by the strategy after the default process group exists, then passed explicitly to
    whatever needs a group; no code finds a group through a global (:data:`_BUILT` only spares a
    later fit of the same layout from making its groups again).
    """

    def __init__(self, dims: ParallelDims, mesh: DeviceMesh) -> None:
        self.dims = dims
        self.mesh = mesh
        self.replica_mesh = mesh["dp", "cp"]._flatten(REPLICA_DIM)  # kept: slicing a flattened dim is deprecated
        self.rank = dist.get_rank()
        self.coords = dims.coordinates(self.rank)
        # the replicas as (expert replicas, expert group): built only under expert parallelism
        self.expert_layout: Optional[DeviceMesh] = None
        self._expert_replicas: Optional[DeviceMesh] = None
        # groups made on first use, collectively; "made" is recorded apart from the group because a rank
        # outside every group of a family gets None, and a None read as "not made yet" would make that
        # rank alone create groups again on a reused topology, shifting torch's group numbering on it
        self._lazy: dict[str, Optional[dist.ProcessGroup]] = {}  # (embedding_group, expert_tensor_group)
        if dims.ep > 1:
            if not hasattr(self.replica_mesh, "_unflatten"):
                raise RuntimeError(f"expert_parallel={dims.ep} needs torch >= 2.9 (DeviceMesh._unflatten); this is torch {torch.__version__}.")
            self.expert_layout = self.replica_mesh._unflatten(0, (self.dp_size // dims.ep, dims.ep), EXPERT_DIMS)
            self._expert_replicas = self.expert_layout["edp"]  # one object: buckets group parameters by it

    @classmethod
    def build(cls, dims: ParallelDims, device: "torch.device | str" = "cpu") -> "Topology":
        """The mesh over the already initialized default process group (collective on all ranks the
        first time): built once per layout and default group in a process, then reused (see
        :data:`_BUILT`)."""
        dims = dims.resolve(dist.get_world_size())
        device = torch.device(device)  # the compute device (its type names the mesh's; a flag travels on it)
        world = dist.distributed_c10d._get_default_group()
        # start over for a new default group (the old one's subgroups went with it), or when a rank's
        # last fit failed (voted only once something is cached: every rank then holds the same layouts)
        if _BUILT.get("world") is not world or (len(_BUILT) > 1 and _any_rank_failed(device)):
            _BUILT.clear()
            _BUILT["world"] = world
        _SUSPECT[0] = False
        key = (dims, device.type)
        if key not in _BUILT:
            _BUILT[key] = cls(dims, init_device_mesh(device.type, dims.shape, mesh_dim_names=MESH_DIMS))
        return _BUILT[key]

    def group(self, dim: str) -> dist.ProcessGroup:
        return self.replica_mesh.get_group() if dim == REPLICA_DIM else self.mesh.get_group(dim)

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """Every rank holding the same weights (dp x cp): gradients are reduced and ZeRO state is
        sharded over it; at cp=1 it is the data-parallel group."""
        return self.group(REPLICA_DIM)

    @property
    def dp_mesh(self) -> DeviceMesh:
        """The 1-D mesh of :attr:`dp_group` (FSDP2 shards over it)."""
        return self.replica_mesh

    @property
    def cp_group(self) -> dist.ProcessGroup:
        """The context-parallel peers: same weights, other tokens of the same sequences."""
        return self.group("cp")

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.group("tp")

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.group("pp")

    @property
    def dp_size(self) -> int:
        """Size of :attr:`dp_group` (dp x cp)."""
        return int(self.dims.dp) * self.dims.cp

    @property
    def dp_rank(self) -> int:
        """Rank in :attr:`dp_group` (dp-major, as the flattened mesh orders it)."""
        return self.coords.dp * self.dims.cp + self.coords.cp

    @property
    def ep_size(self) -> int:
        return self.dims.ep

    @property
    def ep_rank(self) -> int:
        """Rank in :attr:`expert_group` (0 without expert parallelism)."""
        return self.dp_rank % self.dims.ep

    @property
    def expert_group(self) -> Optional[dist.ProcessGroup]:
        """The ``ep`` adjacent weight replicas that hold every expert once between them (routed rows
        travel inside it); None without expert parallelism."""
        return self.expert_layout.get_group("ep") if self.expert_layout is not None else None

    @property
    def expert_replica_mesh(self) -> Optional[DeviceMesh]:
        """The 1-D mesh of the ``dp x cp / ep`` ranks holding the same experts: experts' gradients
        are reduced and their ZeRO state sharded over it; None without expert parallelism."""
        return self._expert_replicas

    def expert_tensor_group(self) -> Optional[dist.ProcessGroup]:
        """The ``ep x tp`` ranks that split the experts between them under expert and tensor
        parallelism (ep-major: rank ``ep_rank * tp + tp_rank``); the tp group at ep=1, None at tp=1.
        Created on first use, collectively on every rank."""
        if self.dims.tp == 1:
            return None
        if self.dims.ep == 1:
            return self.tp_group
        if "expert_tensor" not in self._lazy:
            inner = self.mesh["dp", "cp", "tp"]._flatten("dp_cp_tp")._unflatten(
                0, (self.dp_size // self.dims.ep, self.dims.ep, self.dims.tp), ("edp", "ep", "etp")
            )
            self._lazy["expert_tensor"] = inner["ep", "etp"]._flatten("ep_etp").get_group()
        return self._lazy["expert_tensor"]

    @property
    def cp_size(self) -> int:
        return self.dims.cp

    @property
    def cp_rank(self) -> int:
        return self.coords.cp

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
        if "embedding" not in self._lazy:
            dims, mine = self.dims, None
            for dp in range(int(dims.dp)):
                for cp in range(dims.cp):
                    for tp in range(dims.tp):
                        ends = (Coordinates(0, dp, tp, cp), Coordinates(dims.pp - 1, dp, tp, cp))
                        ranks = sorted({dims.rank_of(c) for c in ends})
                        group = dist.new_group(ranks)
                        if self.rank in ranks:
                            mine = group
            self._lazy["embedding"] = mine
        return self._lazy["embedding"]  # type: ignore[return-value]

    def dp_source_rank(self) -> int:
        """Global rank of rank 0 of this rank's :attr:`dp_group` (the source for replica broadcasts)."""
        return self.dims.rank_of(self.coords._replace(dp=0, cp=0))

    def tp_source_rank(self) -> int:
        """Global rank of tp-rank 0 in this rank's tp group (the source of tensor-parallel replicas)."""
        return self.dims.rank_of(self.coords._replace(tp=0))

    def cp_source_rank(self) -> int:
        """Global rank of cp-rank 0 in this rank's cp group."""
        return self.dims.rank_of(self.coords._replace(cp=0))

    @property
    def sample_group(self) -> dist.ProcessGroup:
        """The ranks that hold different samples (dp alone: cp peers hold chunks of the same
        samples): where per-sample values are gathered or summed (``all_gather``, metrics)."""
        return self.group("dp")

    def first_stage_rank(self) -> int:
        """Global rank of the first pipeline stage at this rank's (dp, tp) position."""
        return self.dims.rank_of(self.coords._replace(pp=0))

    def __repr__(self) -> str:
        c = self.coords
        cp = f" cp={c.cp}" if self.dims.cp > 1 else ""
        return f"Topology({self.dims}, rank={self.rank}: pp={c.pp} dp={c.dp}{cp} tp={c.tp})"


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
