"""The parallel degrees (dp, tp, pp, cp, ep) and the rank layout they imply: pure arithmetic.

No processes and no torch: the planner, the layout rules and ``lightning-3d plan`` use it to check
and rank layouts of thousands of ranks without importing torch (``core.topology`` binds these
degrees to a live ``torch.distributed`` world). The rank order and what each degree means are
described in :mod:`lightning_3d.core.topology`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple, Union

MESH_DIMS: tuple[str, str, str, str] = ("pp", "dp", "cp", "tp")
REPLICA_DIM = "dp_cp"  # dp and cp flattened: every rank holding the same weights
EXPERT_DIMS: tuple[str, str] = ("edp", "ep")  # the replicas unflattened: expert replicas x expert group

Degree = Union[int, Literal["auto"]]


class Coordinates(NamedTuple):
    """Where one global rank sits in the layout (cp last, so 3D code may omit it)."""

    pp: int
    dp: int
    tp: int
    cp: int = 0


def _check_degree(name: str, value: object, allow_auto: bool) -> None:
    if allow_auto and value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        hint = ' or "auto"' if allow_auto else ""
        raise ValueError(f"{name}={value!r} is invalid: it must be a positive integer{hint}.")


@dataclass(frozen=True)
class ParallelDims:
    """The parallel degrees. ``dp="auto"`` takes whatever ``tp * pp * cp`` leaves of the world."""

    dp: Degree = "auto"
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1  # expert parallel: taken from the dp x cp replicas, so not a factor of the world

    def __post_init__(self) -> None:
        _check_degree("data_parallel", self.dp, allow_auto=True)
        _check_degree("tensor_parallel", self.tp, allow_auto=False)
        _check_degree("pipeline_parallel", self.pp, allow_auto=False)
        _check_degree("context_parallel", self.cp, allow_auto=False)
        _check_degree("expert_parallel", self.ep, allow_auto=False)

    def _model_parallel_text(self) -> str:
        cp = f" x context_parallel={self.cp}" if self.cp > 1 else ""
        return f"tensor_parallel={self.tp} x pipeline_parallel={self.pp}{cp}"

    def resolve(self, world_size: int) -> "ParallelDims":
        """Return concrete degrees for ``world_size`` ranks, or raise ``ValueError`` naming the mismatch."""
        if world_size < 1:
            raise ValueError(f"world_size={world_size} is invalid: it must be at least 1.")
        model_parallel = self.tp * self.pp * self.cp
        if self.dp == "auto":
            if world_size % model_parallel != 0:
                raise ValueError(
                    f"{self._model_parallel_text()} = {model_parallel} does not divide "
                    f"the world size {world_size}; choose degrees whose product divides the number of processes "
                    f"(devices x num_nodes)."
                )
            resolved = ParallelDims(dp=world_size // model_parallel, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep)
        elif self.dp * model_parallel != world_size:
            raise ValueError(
                f"data_parallel={self.dp} x {self._model_parallel_text()} = "
                f"{self.dp * model_parallel}, but the world size is {world_size} (devices x num_nodes). "
                f'Make the product equal the world size, or set data_parallel="auto".'
            )
        else:
            resolved = self
        replicas = int(resolved.dp) * resolved.cp
        if replicas % resolved.ep:
            cp = f" x context_parallel={resolved.cp}" if resolved.cp > 1 else ""
            raise ValueError(
                f"expert_parallel={resolved.ep} splits the experts over ranks taken from data_parallel={resolved.dp}{cp} "
                f"= {replicas} weight replicas, which it does not divide; choose an expert_parallel that divides {replicas}."
            )
        return resolved

    @property
    def world_size(self) -> int:
        self._require_resolved()
        return int(self.dp) * self.cp * self.tp * self.pp

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """Mesh shape in ``MESH_DIMS`` order."""
        self._require_resolved()
        return (self.pp, int(self.dp), self.cp, self.tp)

    def coordinates(self, rank: int) -> Coordinates:
        """The (pp, dp, tp, cp) coordinates of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside a world of {self.world_size} ranks.")
        dp, cp, tp = int(self.dp), self.cp, self.tp
        return Coordinates(pp=rank // (dp * cp * tp), dp=(rank // (cp * tp)) % dp, tp=rank % tp, cp=(rank // tp) % cp)

    def rank_of(self, coords: Coordinates) -> int:
        """Inverse of :meth:`coordinates`."""
        return ((coords.pp * int(self.dp) + coords.dp) * self.cp + coords.cp) * self.tp + coords.tp

    def group_ranks(self, dim: str, rank: int) -> list[int]:
        """Global ranks of the ``dim`` group ("pp", "dp", "cp" or "tp") that contains ``rank``, in group order."""
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
        cp = f" x cp={self.cp}" if self.cp > 1 else ""
        ep = f" (ep={self.ep})" if self.ep > 1 else ""
        return f"dp={self.dp}{cp} x tp={self.tp} x pp={self.pp}{ep}"
