"""Regression tests for silent-wrongness findings of the review of the pipeline receive-buffer reuse
and the sequence-parallel shard-keeping column layers (both fixed: a parameter gradient that is the
received buffer holds it back from reuse; a gathered input modified in place since the gather falls
back to keeping the full input)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_3d.pipeline.runtime import PipelineConfig, pipeline_model
from lightning_3d.testing.harness import run_on_ranks
from tests.test_pipeline import WideToy


# -- pipeline: a parameter gradient aliasing a reused receive buffer --------------------------------------
class AddParam(torch.nn.Module):
    """``x + p`` with ``p`` of the activation's shape (micro-batch size 1): the parameter's gradient is
    the incoming activation gradient itself (torch's stage_backward_weight assigns it as ``p.grad``)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.p = torch.nn.Parameter(0.1 * torch.randn(*shape, generator=torch.Generator().manual_seed(7)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.p


class AddViewedParam(AddParam):
    """``x + p.view(...)`` with a flat ``p``: autograd hands the parameter a *view* of the incoming
    gradient, which AccumulateGrad keeps as ``p.grad`` (second review: the receive buffer then came
    back as a spare under it and the next message overwrote the gradient)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.p.view(1, 3, 8)


def _alias_model(viewed: bool = False) -> WideToy:
    model = WideToy(layers=4, hidden=8)
    # piece 2: rank 1's second chunk under zb_v at pp=2, rank 1's first block under 1f1b (gets its gradient over the wire)
    model.blocks[2] = AddViewedParam((24,)) if viewed else AddParam((1, 3, 8))
    return model


def _alias_steps(model: torch.nn.Module) -> list[dict[str, np.ndarray]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(2):
        x, y = torch.randn(4, 3, 8, generator=g), torch.randn(4, 3, 8, generator=g)
        model(x, y).backward()
        out.append({n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None})
        model.zero_grad(set_to_none=True)
    return out


def _alias_world(cases: list[tuple[str, bool]]) -> list[list[dict[str, np.ndarray]]]:
    from lightning_3d.core.topology import ParallelDims, Topology

    topology = Topology.build(ParallelDims(dp=1, tp=1, pp=2))
    out = []
    for schedule, viewed in cases:
        model = _alias_model(viewed)
        v = 2 if schedule == "zb_v" else 1
        pipeline_model(model, model.pipeline_sequence(), topology, PipelineConfig(schedule=schedule, virtual_stages=v, micro_batches=4))
        out.append(_alias_steps(model))
    return out


def test_param_grad_that_is_the_received_gradient_survives_buffer_reuse():
    """Same shape (the gradient is the buffer's values) and viewed (the gradient is a view of the buffer),
    under a split backward (zb_v) and a whole one (1f1b)."""
    cases = [("zb_v", False), ("zb_v", True), ("1f1b", True), ("zb_h1", True)]
    ranks = run_on_ranks(_alias_world, 2, cases, timeout=180)
    for i, (schedule, viewed) in enumerate(cases):
        reference = _alias_steps(_alias_model(viewed))
        for step, ref in enumerate(reference):
            for r in ranks:
                for n, g in r[i][step].items():
                    np.testing.assert_allclose(g, ref[n], rtol=1e-4, atol=1e-7, err_msg=f"{schedule} viewed={viewed} step {step} {n}")


# -- sequence parallel: an in-place op on the prepared (gathered) input before the column layer ----------------
def _sp_inplace_world() -> dict[str, float]:
    from lightning_3d.tensor_parallel import ColumnParallelLinear
    from lightning_3d.tensor_parallel.mappings import gather_for_column_parallel, gather_from_sequence_parallel

    group = dist.group.WORLD
    torch.manual_seed(0)
    new = ColumnParallelLinear(8, 6, sequence_parallel=True, input_is_prepared=True, tp_group=group)
    x_full = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(1))
    shard = x_full.chunk(dist.get_world_size(), dim=-2)[dist.get_rank()]
    grads: list[Any] = []
    for prepared in (True, False):
        x = shard.clone().requires_grad_()
        full = (gather_for_column_parallel if prepared else gather_from_sequence_parallel)(x * 1.0, group)
        full.mul_(3.0)  # in place, before the layer reads it (an in-place dropout or scale would do the same)
        y = new(full) if prepared else F.linear(full, new.weight, new.bias)
        y.pow(2).sum().backward()
        grads.append(new.weight.grad.clone())
        new.weight.grad = None
    return {"w_grad": float((grads[0] - grads[1]).abs().max())}


def test_sequence_parallel_prepared_input_modified_in_place_gives_the_right_weight_gradient():
    for rank in run_on_ranks(_sp_inplace_world, 2, timeout=120):
        assert rank["w_grad"] <= 1e-5, rank
