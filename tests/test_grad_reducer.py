"""The bucketed gradient reducer on its own (no Lightning), in one 2-rank world."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_3d.testing.harness import run_on_ranks
from lightning_3d.zero.grad_reducer import GradientReducer
from tests.helpers import result_of, run_checks


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(16, 8), *[nn.Linear(8, 8) for _ in range(6)])


def _batch(rank: int) -> torch.Tensor:
    return torch.arange(4) + 4 * rank


def overlap() -> dict[str, Any]:
    """Buckets go out while backward is still running: count launches when the last gradient arrives."""
    model = _model()
    reducer = GradientReducer(model.parameters(), dist.group.WORLD, bucket_bytes=300)
    seen: list[int] = []
    # The embedding is the first layer, so its gradient is the last one autograd produces.
    model[0].weight.register_hook(lambda g: seen.append(reducer.collectives_launched))
    model(_batch(dist.get_rank())).sum().backward()
    return {"launched_before_last_grad": seen[0], "buckets": reducer.num_buckets}


def averaging_and_unused() -> dict[str, Any]:
    """Rank-dependent unused parameters: averaged with zeros where used anywhere, None where used nowhere."""
    rank = dist.get_rank()
    a, b, never = (nn.Parameter(torch.full((3,), 1.0)) for _ in range(3))
    reducer = GradientReducer([a, b, never], dist.group.WORLD)
    loss = (rank + 1.0) * a.sum() + (b.sum() if rank == 0 else 0.0)
    loss.backward()
    reducer.after_backward()
    return {"a": a.grad.tolist(), "b": b.grad.tolist(), "never": never.grad}


def no_sync_accumulates_locally() -> dict[str, Any]:
    rank = dist.get_rank()
    w = nn.Parameter(torch.zeros(2))
    reducer = GradientReducer([w], dist.group.WORLD)
    with reducer.no_sync():
        ((rank + 1.0) * w.sum()).backward()
        reducer.after_backward()
    local = w.grad.tolist()
    launched_while_blocked = reducer.collectives_launched
    ((rank + 1.0) * w.sum()).backward()
    reducer.after_backward()
    return {"local": local, "blocked": launched_while_blocked, "synced": w.grad.tolist()}


def mixed_dtypes() -> dict[str, Any]:
    rank = dist.get_rank()
    p32 = nn.Parameter(torch.ones(4))
    p64 = nn.Parameter(torch.ones(4, dtype=torch.float64))
    reducer = GradientReducer([p32, p64], dist.group.WORLD)
    ((rank + 1.0) * (p32.sum() + p64.sum())).backward()
    return {"buckets": reducer.num_buckets, "p32": p32.grad.tolist(), "p64": p64.grad.tolist()}


def expert_slice_reduced_twice() -> dict[str, Any]:
    """An expert slice held by this rank alone (ep=2 in a 2-rank world): its local gradient already sums
    both ranks' rows, so the step's gradient is everything it accumulated divided by the 2 weight
    replicas. Manual optimization reduces every backward (no ``no_sync``): sync, local, sync again."""
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_3d.core.param_meta import update_meta

    rank = dist.get_rank()
    alone = DeviceMesh("cpu", torch.arange(2).view(2, 1), mesh_dim_names=("ep", "replicas"))["replicas"]
    expert, dense = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    update_meta(expert, replica_mesh=alone)
    reducer = GradientReducer([expert, dense], dist.group.WORLD)
    seen = []
    for contribution, sync in ((1.0, True), (2.0, False), (4.0, True)):
        with reducer.no_sync() if not sync else nullcontext():
            ((rank + 1.0) * contribution * (expert.sum() + dense.sum())).backward()
            reducer.after_backward()
        seen.append((expert.grad.tolist(), dense.grad.tolist()))
    return {"seen": seen}


def world() -> dict[str, Any]:
    return run_checks(
        {
            "overlap": overlap,
            "unused": averaging_and_unused,
            "no_sync": no_sync_accumulates_locally,
            "dtypes": mixed_dtypes,
            "expert": expert_slice_reduced_twice,
        }
    )


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_on_ranks(world, 2, timeout=120)


def test_buckets_are_launched_during_backward(ranks):
    for r in ranks:
        o = result_of(r, "overlap")
        assert o["buckets"] >= 4
        assert o["launched_before_last_grad"] >= o["buckets"] - 2


def test_gradients_are_averaged_and_unused_parameters_keep_none(ranks):
    for r in ranks:
        u = result_of(r, "unused")
        assert u["a"] == [1.5] * 3  # (1 + 2) / 2
        assert u["b"] == [0.5] * 3  # used on rank 0 only: (1 + 0) / 2
        assert u["never"] is None


def test_no_sync_then_sync(ranks):
    for rank, r in enumerate(ranks):
        n = result_of(r, "no_sync")
        assert n["blocked"] == 0
        assert n["local"] == [rank + 1.0] * 2
        assert n["synced"] == [3.0] * 2  # ((1 + 1) + (2 + 2)) / 2


def test_each_dtype_gets_its_own_bucket(ranks):
    for r in ranks:
        d = result_of(r, "dtypes")
        assert d["buckets"] == 2
        assert d["p32"] == d["p64"] == [1.5] * 4


def test_an_expert_slice_reduced_by_several_backwards_of_one_step_counts_each_contribution_once(ranks):
    for rank, r in enumerate(ranks):
        seen = result_of(r, "expert")["seen"]
        local = rank + 1.0
        # the expert: its own rows only (already summed over the expert group), divided by 2 replicas
        assert seen[0][0] == [local / 2] * 2
        assert seen[2][0] == [(1 + 2 + 4) * local / 2] * 2
        # the dense weight: the mean over both ranks of everything accumulated, 1.5 per unit
        assert seen[0][1] == [1.5] * 2
        assert seen[2][1] == [1.5 * 7] * 2
