"""Expert parallelism for one MoE layer: each rank of an expert group holds E / ep experts, and
routed rows travel to their expert's rank and back with two uneven ``all_to_all_single``.

Applied from outside (:func:`shard_experts`), as tensor parallelism is to linears: the layer keeps
its router and shared experts whole; its ``GroupedExperts`` keeps only this rank's slice of the
stacked weights, and its dispatch becomes :func:`dispatch_to_experts`.

NCCL's rules: the per-expert row counts are exchanged on the compute device (one
``all_to_all_single`` of ``E`` integers); the split sizes of the row exchange must be Python ints
for ``all_to_all_single``, so one blocking host read of ``2 x ep`` counts per layer and forward is
made (dropless routing sizes the exchange by the data, which only the counts know; Megatron and
torchtitan read them the same way). The read is blocking (``.tolist()`` waits for the device), so no
``non_blocking`` copy is ever read early. No tags, no point-to-point.

Gradients: an expert's weight gradient here sums the rows of every rank of the group (they all
route to it), where a dense weight's gradient on one replica sums only that replica's rows and the
replicas' gradients are then averaged. So every reducer (ZeRO 0-3) sums a parameter's gradient over
the ranks that hold it -- all ``R = dp x cp`` replicas for a dense weight, the ``R / ep`` expert
replicas for an expert slice -- and divides by ``R``: the mean over replicas for both.

Each expert slice records how it relates to the stacked tensor (a :class:`TPSpec` over the expert
group, dim 0) and its expert replicas (``replica_mesh``), so checkpoints store the dense stack and
load it back at any ``ep``, and the gradient reducers, norms and replica broadcasts find its copies.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_3d.core.param_meta import update_meta
from lightning_3d.moe.experts import ExpertStack, GroupedExperts
from lightning_3d.tensor_parallel.spec import TPSpec, mark_sequence_parallel


class _AllToAll(torch.autograd.Function):
    """Uneven ``all_to_all_single`` of rows; its backward is the exchange the other way."""

    @staticmethod
    def forward(ctx, x: Tensor, send: list[int], receive: list[int], group: Any) -> Tensor:  # noqa: ANN001
        ctx.send, ctx.receive, ctx.group = send, receive, group
        out = x.new_empty((sum(receive), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=receive, input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Optional[Tensor], None, None, None]:  # noqa: ANN001
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), output_split_sizes=ctx.send, input_split_sizes=ctx.receive, group=ctx.group)
        return out, None, None, None


def exchange_counts(counts: Tensor, group: Any) -> Tensor:
    """``counts``: rows this rank sends to each global expert (``E``, on the device, grouped by owner
    rank). Returns the rows each rank of the group sends to each of this rank's experts
    (``ep x E_local``, row r from rank r), on the device."""
    ep = dist.get_world_size(group)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=group)
    return received.view(ep, -1)


def split_sizes(rows: Tensor, send: Tensor, receive: Tensor) -> tuple[list[int], list[int]]:
    """How many of ``rows`` go to each rank of the expert group (``send``) and how many arrive from
    each (``receive``), as the Python ints ``all_to_all_single`` takes: the one blocking host read.
    (The dry run stands in balanced sizes: on the meta device there are no counts to read.)"""
    sizes = torch.stack([send, receive]).tolist()
    if sum(sizes[0]) != rows.shape[0]:
        raise RuntimeError(f"expert dispatch: the counts send {sum(sizes[0])} rows, but {rows.shape[0]} were routed.")
    return sizes[0], sizes[1]


def dispatch_to_experts(rows: Tensor, counts: Tensor, experts: ExpertStack, group: Any) -> Tensor:
    """``rows``: this rank's routed rows sorted by global expert (``counts`` of them per expert, a
    device tensor). Runs every row through its expert wherever that expert lives and returns the
    results in ``rows``' order."""
    ep = dist.get_world_size(group)
    local = experts.n_experts
    received = exchange_counts(counts, group)  # (ep, E_local)
    send, receive = split_sizes(rows, counts.view(ep, local).sum(dim=1), received.sum(dim=1))
    arrived = _AllToAll.apply(rows, send, receive, group)  # grouped by (source rank, local expert)
    # regroup by local expert: arrival order is source-major; the experts want expert-major
    per_block = received.reshape(-1)  # block b = (source b // E_local, expert b % E_local)
    block_of_row = torch.repeat_interleave(  # (output_size: known from the read above, so no second one)
        torch.arange(per_block.numel(), device=rows.device), per_block, output_size=sum(receive)
    )
    expert_of_row = block_of_row % local
    order = torch.argsort(expert_of_row * ep + block_of_row // local, stable=True)
    offsets = torch.cumsum(received.sum(dim=0), 0).to(torch.int32)
    computed = experts(arrived[order], offsets)
    back = torch.empty_like(computed)
    back[order] = computed  # (an index_put: its backward gathers, as the forward's arrived[order] scatters back)
    return _AllToAll.apply(back, receive, send, group)


def keep_slice(param: nn.Parameter, dim: int, group: Any, ranks: str, size: str, replica_mesh: Any = None) -> None:
    """Keep this rank's contiguous slice of ``param`` along ``dim`` (its rank in ``group``), in place:
    the Parameter object stays (a pipeline runtime built earlier holds it). Its spec records how the
    slice relates to the whole tensor; ``replica_mesh``: the ranks holding the same slice."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    full_shape = tuple(param.shape)
    if full_shape[dim] % world:
        raise ValueError(f"{world} ranks ({ranks}) must divide {size}={full_shape[dim]}.")
    param.data = param.detach().chunk(world, dim=dim)[rank].clone()
    update_meta(param, tp_spec=TPSpec(dim=dim, world=world, rank=rank, full_shape=full_shape, group=group), replica_mesh=replica_mesh)


def shard_experts(experts: GroupedExperts, group: Any, replica_mesh: Any = None) -> None:
    """Keep this rank's ``E / size(group)`` experts of ``experts`` (in place; contiguous blocks by
    rank). ``replica_mesh``: the ranks that hold the same slice (recorded on the parameters)."""
    for name in ("gate_proj", "up_proj", "down_proj"):
        keep_slice(getattr(experts, name), 0, group, "expert_parallel x tensor_parallel", "n_experts", replica_mesh)
    experts.n_experts //= dist.get_world_size(group)


def split_shared_experts(shared: nn.Module, tp: Any) -> None:
    """The shared experts' SwiGLU split as a column (gate, up) then row (down) parallel MLP, in place:
    each tp rank computes a share of their output, summed with the routed experts' shares."""
    for name, dim in (("gate_proj", 0), ("up_proj", 0), ("down_proj", 1)):
        keep_slice(getattr(shared, name).weight, dim, tp, "tensor_parallel", "the shared experts' width")


def apply_expert_parallel(
    module: nn.Module, group: Any = None, replica_mesh: Any = None, tp_group: Any = None, owners: Any = None,
    sequence_parallel: bool = False,
) -> int:
    """Split every MoE layer in ``module`` from outside; returns how many there are.

    * ``group`` (expert parallelism): each rank of it keeps ``E / ep`` experts and sends routed rows
      to their owners (ranks of ``group`` hold their own tokens, as data-parallel ranks do);
      ``replica_mesh``: the ranks holding the same experts.
    * ``tp_group`` (tensor parallelism): the tp ranks hold the same tokens and split the experts
      further, ``E / (ep x tp)`` each, and the shared experts' width; every path's output is a
      partial sum, reduced over tp, and the router's gradient is summed over tp.
    * ``owners``: the group the experts are split over, ep-major (``ep x tp`` ranks; default:
      ``group``, else ``tp_group``).
    * ``sequence_parallel``: the layers' inputs are sequence shards over ``tp_group``: they gather
      every token first and reduce-scatter their output.
    """
    owners = owners if owners is not None else (group if group is not None else tp_group)
    count = 0
    for layer in module.modules():
        experts = getattr(layer, "experts", None)
        if not (isinstance(experts, GroupedExperts) and hasattr(layer, "expert_group")):
            continue
        count += 1
        if owners is None or experts.n_experts != layer.n_experts:
            continue  # nothing to split, or split by an earlier set-up
        shard_experts(experts, owners, replica_mesh)
        layer.expert_group = group
        if tp_group is not None and dist.get_world_size(tp_group) > 1:
            layer.tp_group = tp_group
            layer.sequence_parallel = sequence_parallel
            mark_sequence_parallel(layer.router.gate.weight, tp_group)  # (its gradient is partial on each tp rank)
            if layer.shared_experts is not None:
                split_shared_experts(layer.shared_experts, tp_group)
    return count
