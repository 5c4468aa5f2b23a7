"""Parameters meant to be one value on several ranks are checked to stay one value.

A layout keeps copies of some weights: what tensor-parallel ranks hold whole (norms, row-parallel
biases, per-head q/k norms), the last pipeline stage's copy of a tied embedding, and every
data-parallel replica below ZeRO-3. Nothing in the math forces the copies to agree: a plan that
splits a norm's input but not its gradient (a user's adapter that misses transformers'
``replicated_with_grad_allreduce``), a dropout drawn per rank where it should be replicated, or an
update applied on one rank only all let them drift apart silently, and the run then trains a model
that no single process would. :class:`ReplicaGuard` (a callback the strategy installs) compares
them every ``every`` optimizer steps and at every checkpoint, and stops the run naming the
parameters and the likely cause.

One check: per group (tp, the tied-embedding pair, dp x cp), a vector of each local copy's L1 and L2
norms (``torch._foreach_norm``: one fused kernel per kind on a GPU), one MAX all-reduce of
``[v, -v]`` (the group's max and min at once), a device-side comparison; then one MIN all-reduce
over the world of "the first rank that saw a difference", so every rank stops together (no rank
waits in a collective the others left), and one host read. ``every="auto"`` times the first check
against the steps before it and spaces checks so they cost under 1% of training (the ranks agree
on the spacing with one more all-reduce, once).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn

from lightning_3d.core import rank_zero
from lightning_3d.core.config import parse_replica_check_every
from lightning_3d.core.param_meta import replica_mesh_of
from lightning_3d.tensor_parallel.spec import get_spec

log = logging.getLogger(__name__)

Every = Union[int, str, None]
COST_SHARE = 0.01  # "auto": checks may cost this share of training time
FIRST_CHECK = 3  # "auto": the first check comes after this many optimizer steps (timed against steps 2-3)


class ReplicaDivergence(RuntimeError):
    """Copies of one parameter differ across the ranks that hold it."""


CAUSES = {
    "tensor parallel": (
        "these parameters are replicated across the tensor-parallel ranks (the plan does not split them), but "
        "each rank's copy got another update. A replicated parameter applied to this rank's part of the work (a "
        "per-head norm on this rank's heads, a bias after a split) gets a partial gradient that must be summed "
        "over tp: give it the style 'sum_gradients' in the tensor-parallel plan (transformers' "
        "'replicated_with_grad_allreduce'), or split it. A dropout on data every tp rank holds alike that draws "
        "per rank (inside an 'rng' region without 'replicated_rng') makes the copies differ the same way"
    ),
    "tied embedding": (
        "the first and last pipeline stages hold copies of one tied weight, which must receive the sum of both "
        "stages' gradients and the same update: optimizer settings chosen by parameter name (a weight-decay group "
        "that names only one of the two), or a layer sequence that uses the weight outside its embed or head "
        "modules, break that"
    ),
    "data parallel": (
        "data-parallel replicas must apply the same averaged gradient; something updated them differently (a "
        "parameter changed outside the optimizer on some ranks, an optimizer stepped on one rank's own gradients, "
        "a rank-dependent learning rate)"
    ),
    "expert data parallel": (
        "the ranks holding the same experts (expert parallelism's expert replicas) must apply the same gradient, "
        "summed over them; something updated one copy of an expert slice differently (a parameter changed outside "
        "the optimizer on some ranks, an expert slice left out of the gradient reduction)"
    ),
}


@dataclass
class _Group:
    kind: str
    group: Any
    names: list[str]
    tensors: list[Tensor]


def _local(p: Tensor) -> Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def auto_every(check_s: float, step_s: float, share: float = COST_SHARE) -> int:
    """The spacing, in steps, that keeps a check costing ``check_s`` under ``share`` of steps of ``step_s``."""
    if step_s <= 0:
        return 1
    return max(1, math.ceil(check_s / (share * step_s)))


def replica_groups(module: nn.Module, topology: Any, zero_stage: int, pipelines: list[Any]) -> list[_Group]:
    """The copies this rank holds, by group, in the same order on every rank."""
    named = [(n, p) for n, p in module.named_parameters()]  # (the same list on every member of each group)
    groups: list[_Group] = []
    if dist.get_world_size(topology.tp_group) > 1:
        held = [(n, p) for n, p in named if (s := get_spec(p)) is None or s.dim is None]
        if held:
            groups.append(_Group("tensor parallel", topology.tp_group, [n for n, _ in held], [p for _, p in held]))
    tied = [p for runtime in pipelines for p in runtime.tied]
    if tied:
        by_id = {id(p): n for n, p in named}
        groups.append(_Group("tied embedding", topology.embedding_group(), [by_id.get(id(p), "?") for p in tied], tied))
    whole = [(n, p) for n, p in named if replica_mesh_of(p) is None]
    if topology.dp_size > 1 and zero_stage < 3 and whole:  # (a stage without parameters: its replicas have none either)
        groups.append(_Group("data parallel", topology.dp_group, [n for n, _ in whole], [p for _, p in whole]))
    experts = [(n, p) for n, p in named if replica_mesh_of(p) is not None]  # each slice against its expert replicas
    mesh = replica_mesh_of(experts[0][1]) if experts else None
    if mesh is not None and mesh.size() > 1 and zero_stage < 3:
        groups.append(_Group("expert data parallel", mesh.get_group(), [n for n, _ in experts], [p for _, p in experts]))
    return groups


def _fingerprint(tensors: list[Tensor], device: torch.device) -> Tensor:
    """[L1 norms..., L2 norms...] of the local copies, fp32, on the compute device."""
    local = [_local(t).detach() for t in tensors]
    # in fp32 whatever the parameters' dtype: a bf16 norm would hide drift under bf16's resolution (0.4%);
    # fp64 parameters are normed in fp64 (torch refuses to narrow them), the fingerprint still fp32
    wide = torch.float64 if any(t.dtype == torch.float64 for t in local) else torch.float32
    norms = [torch.stack(torch._foreach_norm(local, order, dtype=wide)).float() for order in (1, 2)]
    return torch.cat(norms).to(device)


@dataclass
class Verdict:
    """What one check found on this rank (``first``: the lowest rank that saw a difference, or -1)."""

    first: int = -1
    found: list[tuple[str, list[str], float]] = field(default_factory=list)  # (kind, names, largest relative gap)


def check_replicas(groups: list[_Group], device: torch.device, rtol: float = 1e-5) -> Verdict:
    """Compare every group's copies (collectives over each group, then one over the world)."""
    mine: list[tuple[_Group, Tensor, Tensor]] = []
    for g in groups:
        v = _fingerprint(g.tensors, device)
        both = torch.cat([v, -v])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=g.group)
        high, low = both[: v.numel()], -both[v.numel() :]
        gap = (high - low) / high.abs().clamp(min=1e-12)
        mine.append((g, gap, gap > rtol))
    world = dist.get_world_size()
    bad = torch.stack([d.any() for _, _, d in mine]).any() if mine else torch.zeros((), dtype=torch.bool, device=device)
    first = torch.where(bad, torch.tensor(dist.get_rank(), device=device), torch.tensor(world, device=device)).reshape(1)
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    verdict = Verdict(first=int(first.item()))  # the one host read of a check
    if verdict.first == world:
        return Verdict()
    for g, gap, diverged in mine:
        n = len(g.names)
        per_param = diverged[:n] | diverged[n:]
        if bool(per_param.any()):
            names = [name for name, d in zip(g.names, per_param.tolist()) if d]
            verdict.found.append((g.kind, names, float(gap.max())))
    return verdict


def divergence_message(verdict: Verdict, step: int) -> str:
    if not verdict.found:
        return (
            f"lightning_3d: replicas of some parameters diverged on rank {verdict.first} at step {step} (see that rank's "
            f"message); this rank's copies agree with their peers. Stopping every rank together."
        )
    parts = []
    for kind, names, gap in verdict.found:
        shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        parts.append(f"{kind} copies of {shown} differ (largest relative gap {gap:.2e}): {CAUSES[kind]}.")
    return f"lightning_3d: replicated parameters diverged at step {step}: " + " ".join(parts)


class ReplicaGuard(Callback):
    """Checks replicated parameters every ``every`` optimizer steps and at each checkpoint (see the
    module docstring); raises :class:`ReplicaDivergence` on every rank when copies differ."""

    def __init__(self, every: Every = "auto", rtol: float = 1e-5) -> None:
        self.every = parse_replica_check_every(every)
        self.rtol = rtol
        self.checked_step = -1
        self.step_times: list[float] = []  # seconds between consecutive optimizer steps (for "auto")
        self.check_seconds: Optional[float] = None
        self._groups: Optional[list[_Group]] = None
        self._last_step, self._last_time = 0, None  # type: tuple[int, Optional[float]]

    def bind(self, module: nn.Module, topology: Any, zero_stage: int, pipelines: list[Any], device: torch.device) -> None:
        """(Re)collect the copies after the strategy's set-up."""
        self._groups = replica_groups(module, topology, zero_stage, pipelines)
        self._device = device

    def check(self, step: int, timed: bool = False) -> None:
        """``timed``: the check "auto" spaces the others by (run even if a checkpoint's check came first)."""
        if self._groups is None or (step == self.checked_step and not timed):
            return
        self.checked_step = step
        if timed and self._device.type == "cuda":
            torch.cuda.synchronize(self._device)  # time the check, not the tail of the step queued before it
        start = time.perf_counter()
        verdict = check_replicas(self._groups, self._device, self.rtol)
        if timed:
            self.check_seconds = time.perf_counter() - start
        if verdict.first >= 0:
            raise ReplicaDivergence(divergence_message(verdict, step))

    def _agree_on_spacing(self) -> None:
        assert self.check_seconds is not None
        steps = self.step_times[1:] or self.step_times  # the first interval may still include warm-up
        step_s = sum(steps) / len(steps) if steps else 0.0
        every = torch.tensor([auto_every(self.check_seconds, step_s)], device=self._device)
        dist.all_reduce(every, op=dist.ReduceOp.MAX)  # one spacing for all ranks, or they would wait on each other
        self.every = int(every.item())
        rank_zero.info(
            log, "lightning_3d: replica check every %d steps (one check %.1f ms, a step %.1f ms)", self.every,
            self.check_seconds * 1e3, step_s * 1e3, once=True,
        )

    # -- Lightning hooks ---------------------------------------------------------------------------------------
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if self.every is None or step == self._last_step:  # (accumulating: no optimizer step yet)
            return
        now = time.perf_counter()
        if self._last_time is not None:
            self.step_times.append(now - self._last_time)
        self._last_step, self._last_time = step, now
        if self.every == "auto":
            if step >= FIRST_CHECK:
                self.check(step, timed=True)
                self._agree_on_spacing()
        elif step % self.every == 0:
            self.check(step)

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        if self.every is not None and trainer.global_step > 0:
            self.check(trainer.global_step)
