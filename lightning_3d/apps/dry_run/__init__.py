"""Prove a layout before booking the cluster: the strategy's real set-up and one step, for the ranks
that differ, in one CPU process, on the meta device, with a fake process group of the full world.

    from lightning_3d.apps.dry_run import dry_run
    report = dry_run(cfg)              # a composed recipe config (lightning_3d.core.compose.compose_config)
    report.worst, report.fits          # the rank that needs the most memory, and whether it fits

Command line: ``lightning-3d dry-run recipe=llama3_405b`` (docs/dry_run.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch.distributed as dist
from omegaconf import DictConfig

from lightning_3d.apps.dry_run.rank import Batch, RankResult, fake_world, measure_rank
from lightning_3d.core.config import ParallelConfig
from lightning_3d.core.topology import Coordinates, ParallelDims

__all__ = ["DryRunReport", "Role", "dry_run", "roles"]


@dataclass(frozen=True)
class Role:
    """A representative rank: the ranks it stands for hold the same shapes and move the same bytes."""

    name: str
    rank: int
    coords: Coordinates


def roles(dims: ParallelDims) -> list[Role]:
    """The ranks that differ: the first, a middle and the last pipeline stage; tensor-parallel rank 0
    and the last (rank 0 writes replicated tensors; the last holds the vocabulary's padded end);
    context-parallel rank 0 and the last; data-parallel rank 0 (ZeRO pads every bucket to an even
    split, so every dp rank holds the same shard sizes)."""
    stages = sorted({0, dims.pp // 2, dims.pp - 1})
    tps = sorted({0, dims.tp - 1})
    cps = sorted({0, dims.cp - 1})
    out = []
    for pp in stages:
        where = "first" if pp == 0 else "last" if pp == dims.pp - 1 else "middle"
        for tp in tps:
            for cp in cps:
                coords = Coordinates(pp=pp, dp=0, tp=tp, cp=cp)
                name = f"pp{pp}" + (f"({where})" if dims.pp > 1 else "") + f" tp{tp}" + (f" cp{cp}" if dims.cp > 1 else "")
                out.append(Role(name, dims.rank_of(coords), coords))
    return out


@dataclass
class RoleReport:
    role: Role
    measured: RankResult
    predicted: dict[str, float]  # the planner's bytes for this stage (memory kinds) and traffic per group
    total: float  # measured bytes per device: model states + activations (+ recompute) + the planner's buffers + reserved

    def to_dict(self) -> dict[str, Any]:
        m = self.measured
        return {
            "role": self.role.name,
            "rank": self.role.rank,
            "coords": self.role.coords._asdict(),
            "pieces": m.pieces,
            "layers": m.layers,
            "measured": {
                **{k: int(v) for k, v in m.memory.items()},
                "activations": int(m.activations),
                "recompute": int(m.recompute),
                "in_flight": round(m.in_flight, 3),
                "traffic": {k: int(v) for k, v in sorted(m.traffic.items())},
                "calls": dict(sorted(m.calls.items())),
                "total": int(self.total),
            },
            "predicted": {
                k: ({g: int(b) for g, b in v.items()} if isinstance(v, dict) else round(v, 3) if k == "in_flight" else int(v))
                for k, v in self.predicted.items()
            },
            "seconds": round(m.seconds, 3),
        }


@dataclass
class DryRunReport:
    world_size: int
    dims: ParallelDims
    batch: Batch
    capacity: float  # bytes usable per device (the planner's allocator headroom)
    device_bytes: float
    roles: list[RoleReport] = field(default_factory=list)
    seconds: float = 0.0
    layout: str = ""

    @property
    def worst(self) -> RoleReport:
        return max(self.roles, key=lambda r: r.total)

    @property
    def fits(self) -> bool:
        return self.worst.total <= self.capacity

    def why_not(self) -> str:
        w = self.worst
        return (
            f"rank {w.role.rank} ({w.role.name}) needs {w.total / 1e9:.1f} GB > {self.capacity / 1e9:.1f} GB usable "
            f"({self.capacity / self.device_bytes:.0%} of {self.device_bytes / 1e9:g} GB): parameters "
            f"{w.measured.memory['params'] / 1e9:.1f}, gradients {w.measured.memory['grads'] / 1e9:.1f}, optimizer "
            f"{(w.measured.memory['master'] + w.measured.memory['optimizer_state']) / 1e9:.1f}, activations "
            f"{(w.measured.activations + w.measured.recompute) / 1e9:.1f} GB"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "layout": self.layout,
            "micro_batch": self.batch.micro_batch,
            "micro_batches": self.batch.micro_batches,
            "capacity_bytes": int(self.capacity),
            "fits": self.fits,
            "why_not": None if self.fits else self.why_not(),
            "worst_rank": self.worst.role.rank,
            "seconds": round(self.seconds, 2),
            "roles": [r.to_dict() for r in self.roles],
        }


def _group_list(dims: ParallelDims, rank: int) -> list[tuple[str, frozenset[int]]]:
    """(name, rank set) of ``rank``'s groups: "tp", "cp", "pp", "dp" (the dp x cp weight replicas),
    "dp_samples", "embedding", "ep" (the expert group: ``ep`` adjacent replicas), "edp" (the expert replicas)."""
    c = dims.coordinates(rank)
    ordered = [dims.rank_of(c._replace(dp=i, cp=j)) for i in range(int(dims.dp)) for j in range(dims.cp)]  # the replica mesh's order
    mine = ordered.index(rank)
    groups = (
        ("tp", dims.group_ranks("tp", rank)), ("cp", dims.group_ranks("cp", rank)), ("pp", dims.group_ranks("pp", rank)),
        ("dp", ordered), ("dp_samples", dims.group_ranks("dp", rank)),
        ("embedding", {dims.rank_of(c._replace(pp=0)), dims.rank_of(c._replace(pp=dims.pp - 1))}),
        ("ep", [r for i, r in enumerate(ordered) if i // dims.ep == mine // dims.ep]),
        ("edp", [r for i, r in enumerate(ordered) if i % dims.ep == mine % dims.ep]),
    )
    return [(name, frozenset(ranks)) for name, ranks in groups]


def _known_groups(dims: ParallelDims, rank: int) -> dict[frozenset[int], str]:
    """Rank set -> name; where two groups coincide (the expert replicas at ep=1 are the replicas, the
    expert group at ep=cp is the cp group), the first name of :func:`_group_list`."""
    known: dict[frozenset[int], str] = {}
    for name, ranks in _group_list(dims, rank):
        known.setdefault(ranks, name)
    return known


def _group_names(dims: ParallelDims, rank: int) -> Any:
    """Process group -> its name in :func:`_known_groups`."""
    known = _known_groups(dims, rank)

    def name(group: Any) -> str:
        ranks = frozenset(dist.get_process_group_ranks(group))
        return known.get(ranks, f"world" if len(ranks) == dims.world_size else f"group of {len(ranks)}")

    return name


def _as_measured(traffic: dict[str, float], dims: ParallelDims, rank: int) -> dict[str, float]:
    """The planner's bytes per group under the names the dry run gives their rank sets."""
    known = _known_groups(dims, rank)
    alias = {name: known[ranks] for name, ranks in _group_list(dims, rank)}
    out: dict[str, float] = {}
    for name, nbytes in traffic.items():
        key = alias.get(name, name)
        out[key] = out.get(key, 0.0) + nbytes
    return out


def batch_of(cfg: DictConfig, config: ParallelConfig, dims: ParallelDims) -> Batch:
    """Micro-batch size and count per step as the strategy runs the recipe: under a pipeline the
    runtime's micro-batches of the loader's batch; without one, Lightning's gradient accumulation."""
    from lightning_3d.pipeline.runtime import default_micro_batches

    per_replica = int(cfg.data.global_batch_size) // int(dims.dp)
    if dims.pp > 1:
        m = config.pipeline.micro_batches or default_micro_batches(per_replica, dims.pp, config.pipeline.schedule)
        mb = per_replica // m
    else:
        m, mb = int(cfg.trainer.get("accumulate_grad_batches", 1) or 1), per_replica
    seq = int(cfg.model.block_size)
    return Batch(micro_batch=mb, micro_batches=m, local_seq=seq // dims.cp, hidden=int(cfg.model.n_embd))


def dry_run(cfg: DictConfig, only: Optional[list[int]] = None) -> DryRunReport:
    """Set up and step the representative ranks (``only``: these global ranks instead) of the layout
    ``cfg`` runs; the planner's prediction for each alongside."""
    from lightning_3d.apps.dry_run.balanced_routing import balanced_routing
    from lightning_3d.apps.dry_run.counting import counting_collectives
    from lightning_3d.apps.recipe import build_config
    from lightning_3d.pipeline.partition import partition
    from lightning_3d.pipeline.plan import piece_of
    from lightning_3d.pipeline.schedules import V_SHAPED
    from lightning_3d.planner import Planner, problem_from_config
    from lightning_3d.planner.memory import stage_in_flight
    from lightning_3d.planner.recipe_layout import layout_of
    from lightning_3d.planner.search import ALLOCATOR_HEADROOM
    from lightning_3d.planner.traffic import step_traffic

    start = time.perf_counter()
    cluster = cfg.cluster
    world = int(cluster.num_nodes) * int(cluster.devices_per_node)
    # (compiled blocks would not run on meta tensors, and their saved tensors are not what is measured here)
    config = build_config(cfg.parallel).replace(compile=False)
    dims = config.check_world(world, int(cluster.devices_per_node))
    batch = batch_of(cfg, config, dims)
    problem = problem_from_config(cfg)
    layout = layout_of(cfg, world)
    planner = Planner(problem)
    pieces = dims.pp * config.pipeline.virtual_stages
    method = config.pipeline.partition if config.pipeline.partition != "parameters" else "uniform"  # (its stage: measured below)
    ranges = partition(int(cfg.model.n_layer), pieces, method)
    v_shape = config.pipeline.schedule in V_SHAPED
    chunks_of = {s: [piece_of(dims.pp, s, c, v_shape) for c in range(config.pipeline.virtual_stages)] for s in range(dims.pp)}
    layers = [sum(ranges[k][1] - ranges[k][0] for k in chunks_of[s]) for s in range(dims.pp)]  # what the runtime cuts
    m = batch.micro_batches
    capacity = problem.cluster.device.memory_gb * 1e9 * ALLOCATOR_HEADROOM
    report = DryRunReport(world, dims, batch, capacity, problem.cluster.device.memory_gb * 1e9, layout=layout.short())
    chosen = roles(dims) if only is None else [Role(f"rank {r}", r, dims.coordinates(r)) for r in only]
    clip = bool(cfg.trainer.get("gradient_clip_val"))
    with counting_collectives():
        for role in chosen:
            with fake_world(world, role.rank), balanced_routing():
                measured = measure_rank(cfg, config, dims, role.rank, batch, _group_names(dims, role.rank), clip)
            stage = role.coords.pp
            sizes = [ranges[k][1] - ranges[k][0] for k in chunks_of[stage]]
            flight = stage_in_flight(
                layout.schedule, dims.pp, m, config.pipeline.virtual_stages, stage, (sizes[0], sizes[1]) if v_shape else None
            )
            cut = list(layers)
            cut[stage] = measured.layers  # the partition the runtime made
            _, memory = planner.stage_memory(layout, cut, stage, flight)
            predicted = {k: memory[k] for k in ("params", "grads", "optimizer", "activations", "recompute", "buffers", "reserved")}
            predicted["in_flight"] = flight
            traffic = step_traffic(planner, layout, cut, stage, chunks_of[stage])
            predicted["traffic"] = _as_measured(traffic, dims, role.rank)  # type: ignore[assignment]
            states = sum(measured.memory.values())
            total = states + measured.activations + measured.recompute + memory["buffers"] + memory["reserved"]
            report.roles.append(RoleReport(role, measured, predicted, total))
    report.seconds = time.perf_counter() - start
    return report
