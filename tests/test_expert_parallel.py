"""Expert parallelism of one MoE layer (issue 34): on 2 and 4 ranks, each holding E / ep experts and
its own tokens, the outputs and gradients are the layer's on all the tokens in one process, under
strict communication mode (the counts exchanged on the device, uneven all-to-alls, nothing sent by
some ranks to others)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from lightning_3d.moe import MoE
from lightning_3d.testing.harness import run_on_ranks

DIM, HIDDEN, EXPERTS, TOP_K, TOKENS = 16, 16, 4, 2, 6


def _layer(skew: bool, **kwargs: Any) -> MoE:
    torch.manual_seed(0)
    moe = MoE(DIM, HIDDEN, EXPERTS, TOP_K, **kwargs)
    torch.nn.init.normal_(moe.router.gate.weight, std=0.5)
    if skew:  # every token prefers experts 0 and 1 (rank 0's at ep=2): the other ranks receive nothing
        with torch.no_grad():
            moe.router.gate.weight.zero_()
            moe.router.gate.weight[0, 0], moe.router.gate.weight[1, 0] = 40.0, 30.0
    return moe


def _inputs(world: int, skew: bool) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    x = torch.randn(world * TOKENS, DIM)
    if skew:
        x[:, 0] = x[:, 0].abs() + 1.0  # feature 0 positive: experts 0 and 1 win everywhere
    return x, torch.randn(world * TOKENS, DIM)


def _arrays(out: torch.Tensor, x: torch.Tensor, moe: MoE) -> dict[str, Any]:
    """Results as numpy arrays (a tensor would cross the process boundary as a shared-memory handle)."""
    return {"out": out.detach().numpy(), "x_grad": x.grad.numpy(), "grads": {n: p.grad.numpy() for n, p in moe.named_parameters()}}


def reference(world: int, skew: bool, shared: int) -> dict[str, Any]:
    moe = _layer(skew, n_shared_experts=shared)
    x, w = _inputs(world, skew)
    x.requires_grad_()
    out = moe(x)
    (out * w).sum().backward()
    routed = sorted(set(moe.router(x).experts.flatten().tolist()))
    return {**_arrays(out, x, moe), "routed": routed}


def expert_parallel_rank(skew: bool, shared: int) -> dict[str, Any]:
    import torch.distributed as dist

    from lightning_3d.moe.expert_parallel import apply_expert_parallel

    world, rank = dist.get_world_size(), dist.get_rank()
    moe = _layer(skew, n_shared_experts=shared)
    apply_expert_parallel(moe, dist.group.WORLD)
    x, w = _inputs(world, skew)
    mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
    x = x[mine].clone().requires_grad_()
    out = moe(x)
    (out * w[mine]).sum().backward()
    return _arrays(out, x, moe)


@pytest.mark.parametrize(("world", "skew", "shared"), [(2, False, 1), (2, True, 0), (4, False, 0)], ids=["ep2", "ep2-one-sided", "ep4"])
def test_expert_parallel_layer_matches_one_process(world, skew, shared):
    ref = run_on_ranks(reference, 1, world, skew, shared, timeout=120)[0]
    ranks = run_on_ranks(expert_parallel_rank, world, skew, shared, timeout=300)
    local = EXPERTS // world
    for rank, got in enumerate(ranks):
        mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
        np.testing.assert_allclose(got["out"], ref["out"][mine], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["x_grad"], ref["x_grad"][mine], rtol=1e-5, atol=1e-6)
        for name in ("experts.gate_proj", "experts.up_proj", "experts.down_proj"):  # the group's rows: the whole sum
            np.testing.assert_allclose(got["grads"][name], ref["grads"][name][rank * local : (rank + 1) * local], rtol=1e-5, atol=1e-6)
    for name, full in ref["grads"].items():  # replicated weights: each rank's share of the sum
        if not name.startswith("experts."):
            np.testing.assert_allclose(sum(r["grads"][name] for r in ranks), full, rtol=1e-5, atol=1e-6, err_msg=name)
    assert ref["routed"] == ([0, 1] if skew else list(range(EXPERTS)))  # one-sided: rank 1's experts get no row
