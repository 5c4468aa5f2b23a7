"""Data-parallel communication of one step, per ZeRO stage: which collectives run, how many, what
each costs (:mod:`collectives`), and how much of it compute hides.

* **ZeRO 0**: the gradients are all-reduced, **ZeRO 1/2**: reduce-scattered, and the updated
  16-bit parameters all-gathered after the optimizer step; both in buckets of the stack's size
  (one collective per bucket, each paying its latency). The gradient collectives hide behind the
  last micro-batch's backward where the stack overlaps them; the parameter gather hides behind
  the next forward only where the stack overlaps that too (Megatron-Core's
  ``overlap_param_gather``).
* **ZeRO 3**: every micro-batch gathers each layer's parameters twice (forward, and again for
  backward -- FSDP2 reshards after forward; DeepSpeed re-gathers in the recompute forward and keeps
  them for the backward right after) and reduce-scatters its gradients once. The unit is the
  stack's: a whole layer (FSDP2: one ``all_gather_into_tensor`` per wrapped block) or one tensor
  (DeepSpeed before 0.5.8: one ``all_gather`` per parameter, tensors under its persistence
  threshold kept whole and not gathered). With prefetch, the gather of layer i + 1 runs while
  layer i computes, so a layer exposes only ``max(0, gather - compute)`` (backward: gather +
  reduce-scatter share the links); the first gather of each pass is never hidden. That is what
  limits ZeRO-3 at micro-batch 1: a layer's compute shrinks with the batch, its gather does not.
  Without prefetch (DeepSpeed 2021 synchronizes the device before every gather) every gather is
  exposed, and only the reduce-scatter (on its own stream) overlaps backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_3d.planner.collective_cost import NO_COST, CollectiveCost, Group, NcclVersion, collective_cost


@dataclass
class DataParallelTime:
    """Seconds of one step's data-parallel collectives, and what they consist of."""

    exposed: float = 0.0
    hidden: float = 0.0
    latency: float = 0.0  # summed over the collectives, before overlap
    transfer: float = 0.0
    collectives: int = 0
    copy: float = 0.0  # exposed device-memory copies around the collectives (FSDP2's copy-out)
    hidden_backward: float = 0.0  # of ``hidden``: behind the last backward (ZeRO 0-2's gradient collectives)
    hidden_forward: float = 0.0  # of ``hidden``: behind the next forward (ZeRO 1-2's parameter gather)
    detail: dict[str, Any] = field(default_factory=dict)

    def add(self, name: str, cost: CollectiveCost, count: float) -> CollectiveCost:
        """Count ``count`` calls of one collective; returns their total cost."""
        total = cost.times(count)
        self.latency += total.latency
        self.transfer += total.transfer
        self.collectives += int(round(count))
        if count:
            self.detail[name] = {
                "count": int(round(count)),
                "algorithm": f"{cost.algorithm}/{cost.protocol}",
                "seconds_each": cost.seconds,
                "latency_s": total.latency,
                "transfer_s": total.transfer,
            }
        return total

    def merged(self, other: "DataParallelTime", prefix: str) -> "DataParallelTime":
        """This step's collectives and ``other``'s (its calls named with ``prefix``), summed."""
        return DataParallelTime(
            exposed=self.exposed + other.exposed, hidden=self.hidden + other.hidden, latency=self.latency + other.latency,
            transfer=self.transfer + other.transfer, collectives=self.collectives + other.collectives,
            copy=self.copy + other.copy, hidden_backward=self.hidden_backward + other.hidden_backward,
            hidden_forward=self.hidden_forward + other.hidden_forward,
            detail={**self.detail, **{prefix + name: v for name, v in other.detail.items()}},
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "collectives": self.collectives,
            "latency_s": round(self.latency, 4),
            "transfer_s": round(self.transfer, 4),
            "hidden_s": round(self.hidden, 4),
            "copy_s": round(self.copy, 4),
            "exposed_s": round(self.exposed, 4),
            "calls": {
                name: {k: (round(v, 6) if isinstance(v, float) else v) for k, v in entry.items()}
                for name, entry in self.detail.items()
            },
        }


def _bucketed(kind: str, nbytes: float, bucket: float, group: Group, nccl: NcclVersion) -> tuple[CollectiveCost, float]:
    """One collective per bucket of ``bucket`` bytes (0: one for everything)."""
    if nbytes <= 0 or group.ranks <= 1:
        return NO_COST, 0.0
    count = 1.0 if bucket <= 0 else max(1.0, nbytes / bucket)
    return collective_cost(kind, nbytes / count, group, nccl), count


def replicated_params_comm(
    stage: int,
    params: float,
    c: float,
    grad_bytes: float,
    bucket_bytes: float,
    group: Group,
    nccl: NcclVersion,
    backward_window: float,
    forward_window: float,
) -> DataParallelTime:
    """ZeRO 0-2: gradients reduced once per step, parameters gathered after the update (1/2).
    ``backward_window`` / ``forward_window``: compute the gradient / parameter collectives may
    hide behind (0 where the stack does not overlap them)."""
    out = DataParallelTime()
    kind = "all_reduce" if stage == 0 else "reduce_scatter"
    cost, count = _bucketed(kind, params * grad_bytes, bucket_bytes, group, nccl)
    grads = out.add(f"grad_{kind}", cost, count).seconds
    gather = 0.0
    if stage in (1, 2):
        cost, count = _bucketed("all_gather", params * c, bucket_bytes, group, nccl)
        gather = out.add("param_all_gather", cost, count).seconds
    out.hidden_backward, out.hidden_forward = min(grads, backward_window), min(gather, forward_window)
    hidden = out.hidden_backward + out.hidden_forward
    out.hidden, out.exposed = hidden, grads + gather - hidden
    return out


def _prefetch_exposed(gathers: list[float], computes: list[float]) -> float:
    """One layer's gathers when each is issued while the previous unit computes (prefetch one
    ahead, the previous layer's last unit covering this layer's first): ``max(0, g_j - c_j-1)``."""
    return sum(max(0.0, g - computes[j - 1]) for j, g in enumerate(gathers))


def sharded_params_comm(
    layer_tensors: list[float],
    layers: int,
    other_params: float,
    micro_batches: int,
    c: float,
    grad_bytes: float,
    per_parameter: bool,
    persist_below: float,
    group: Group,
    nccl: NcclVersion,
    layer_forward: float,
    layer_backward: float,
    layer_linear_forward: float = 0.0,
    layer_recompute: float = 0.0,
    copy_bytes_per_second: float = 0.0,
) -> DataParallelTime:
    """ZeRO 3 over ``layers`` layers whose parameter tensors have ``layer_tensors`` elements (on
    this tensor-parallel rank), plus ``other_params`` (embedding, head) gathered as one unit.
    ``layer_forward`` / ``layer_backward``: one layer's compute for one micro-batch (backward
    includes ``layer_recompute``); ``layer_linear_forward``: the forward's weight GEMMs alone;
    ``copy_bytes_per_second``: the device memory rate of FSDP2's copy of each gathered layer out of
    the all-gather buffer into its parameters, which runs on the compute stream (exposed).

    Per layer (FSDP2, ``per_parameter=False``): the next layer's gather hides behind this layer's
    forward; in backward the next gather and this layer's reduce-scatter share the links behind
    its backward. Per parameter (DeepSpeed 2021): a tensor's gather is prefetched while the
    module before it computes (that module's GEMM: its share of ``layer_linear_forward``; the
    device-wide synchronize at the next module ends the window), in the forward and again in the
    recompute forward; the backward reuses them. Its reduce-scatters run on a side stream from
    when their 500M-element bucket fills to the next module's device-wide synchronize, i.e. behind
    the rest of that layer's backward: on average half of it."""
    out = DataParallelTime()
    if per_parameter:
        gathered = [n for n in layer_tensors if n >= persist_below]
        reduced = list(layer_tensors)
    else:
        gathered = reduced = [sum(layer_tensors)]
    gather_costs = [collective_cost("all_gather", n * c, group, nccl) for n in gathered]
    reduce_costs = [collective_cost("reduce_scatter", n * grad_bytes, group, nccl) for n in reduced]
    passes = 2 * micro_batches * layers  # forward, and backward (or its recompute)
    for i, cost in enumerate(gather_costs):
        out.add(f"param_all_gather[{i}]" if per_parameter else "layer_all_gather", cost, passes)
    for i, cost in enumerate(reduce_costs):
        out.add(f"grad_reduce_scatter[{i}]" if per_parameter else "layer_reduce_scatter", cost, micro_batches * layers)
    edge_gather = collective_cost("all_gather", other_params * c, group, nccl)
    edge_reduce = collective_cost("reduce_scatter", other_params * grad_bytes, group, nccl)
    edge_gathers = 2 if per_parameter else 1  # FSDP2 does not reshard the root (embedding, head) after forward
    out.add("embedding_head_all_gather", edge_gather, edge_gathers * micro_batches)
    out.add("embedding_head_reduce_scatter", edge_reduce, micro_batches)
    total = out.latency + out.transfer
    g = [cost.seconds for cost in gather_costs]
    rs = sum(cost.seconds for cost in reduce_costs)
    edges = micro_batches * (edge_gathers * edge_gather.seconds + edge_reduce.seconds)  # first of each pass: not hidden
    if per_parameter:
        shares = [n / sum(gathered) for n in gathered]
        forward = _prefetch_exposed(g, [layer_linear_forward * share for share in shares])
        reduces = layers * max(0.0, rs - (layer_backward - layer_recompute) / 2)
        exposed = micro_batches * (2 * layers * forward + reduces)
    else:
        forward = _prefetch_exposed(g, [layer_forward])
        backward = max(0.0, g[0] + rs - layer_backward)
        exposed = micro_batches * ((layers - 1) * (forward + backward) + g[0] + g[0] + rs)  # each pass's first layer waits
        copy_out = 2.0 * gathered[0] * c / copy_bytes_per_second if copy_bytes_per_second > 0 else 0.0  # read + write
        out.copy = passes * copy_out
    comm_exposed = min(total, exposed + edges)
    out.hidden = total - comm_exposed
    out.exposed = comm_exposed + out.copy
    return out
