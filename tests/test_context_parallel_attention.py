"""Context-parallel attention kernels against full single-process causal attention.

One world of 4 ranks checks ring and all-to-all attention at cp=4 (the world), cp=2 (two
subgroups {0,1}, {2,3}) and cp=1 (no communication), GQA (8 q heads, 2 kv heads) and MHA: the forward output and the
gradients of q, k, v, each sharded like the inputs, within 1e-5 relative in fp32. The layout
helpers are checked in this process.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_3d.context_parallel import all_to_all_attention, local_positions, ring_attention, shard_sequence, unshard_sequence
from lightning_3d.context_parallel.ring import CPU_FLASH, MATH
from lightning_3d.testing.harness import run_on_ranks
from tests.helpers import result_of, run_checks

B, T, D, HEADS = 2, 64, 16, 8
TOL = 1e-5

ATTENTION: dict[str, Callable[..., torch.Tensor]] = {
    "ring": ring_attention,
    "ring_math": lambda q, k, v, group: ring_attention(q, k, v, group, kernels=MATH),
    "ring_flash": lambda q, k, v, group: ring_attention(q, k, v, group, kernels=CPU_FLASH),
    "all_to_all": all_to_all_attention,
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().abs().max() / b.detach().abs().max())


def _inputs(kv_heads: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(kv_heads)
    q = torch.randn(B, HEADS, T, D, generator=g)
    k = torch.randn(B, kv_heads, T, D, generator=g)
    v = torch.randn(B, kv_heads, T, D, generator=g)
    dout = torch.randn(B, HEADS, T, D, generator=g)
    return q, k, v, dout


def compare(attention: str, kv_heads: int, group: Any) -> dict[str, float]:
    """Relative errors of this rank's output and q/k/v gradients against full attention."""
    q, k, v, dout = _inputs(kv_heads)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=kv_heads != HEADS)
    expected.backward(dout)

    cp, cp_rank = dist.get_world_size(group), dist.get_rank(group)
    local = [shard_sequence(t, 2, cp_rank, cp).requires_grad_() for t in (q, k, v)]
    out = ATTENTION[attention](*local, group=group)
    out.backward(shard_sequence(dout, 2, cp_rank, cp))
    names = ("q_grad", "k_grad", "v_grad")
    errors = {"out": _rel(out, shard_sequence(expected, 2, cp_rank, cp))}
    errors.update({n: _rel(t.grad, shard_sequence(f.grad, 2, cp_rank, cp)) for n, t, f in zip(names, local, full)})
    return errors


def autocast_errors(group: Any) -> dict[str, float]:
    """Ring attention under bf16 autocast (bf16-mixed) against fp32 full attention, next to what
    SDPA itself reaches under the same autocast: the merge must stay fp32, not drift to bf16."""
    q, k, v, dout = _inputs(2)
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    cp, cp_rank = dist.get_world_size(group), dist.get_rank(group)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        local = [shard_sequence(t, 2, cp_rank, cp) for t in (q, k, v)]
        ring = ring_attention(*local, group=None if cp == dist.get_world_size() else group)
        math_kernel = ring_attention(*local, group=group, kernels=MATH)  # CUDA's kernel today
    expected = shard_sequence(full, 2, cp_rank, cp)
    return {
        "dtype": str(ring.dtype),
        "ring": _rel(ring.float(), expected),
        "ring_math": _rel(math_kernel.float(), expected),
        "sdpa": _rel(sdpa.float(), full),
    }


def _error_message(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except ValueError as err:
        return str(err)
    return "no error"


def gather_errors(group: Any) -> dict[str, float]:
    """``ContextParallel.gather`` (logits back to the full sequence) and its backward against the
    unsharded tensor: a loss of the gathered full sequence, different on every rank, must give each
    rank the sum over ranks of the gradients of the tokens it holds."""
    from lightning_3d.context_parallel.apply import ContextParallel

    cp_size, rank = dist.get_world_size(group), dist.get_rank(group)
    cp = ContextParallel(group, cp_size, rank)
    full = torch.randn(B, T, 5, generator=torch.Generator().manual_seed(1))
    weights = [torch.randn(B, T, 5, generator=torch.Generator().manual_seed(10 + r)) for r in range(cp_size)]
    local = shard_sequence(full, 1, rank, cp_size).requires_grad_(True)
    gathered = cp.gather(local)
    (gathered * weights[rank]).sum().backward()
    expected_grad = shard_sequence(sum(weights), 1, rank, cp_size)
    return {"out": _rel(gathered.detach(), full), "grad": _rel(local.grad, expected_grad)}


def world() -> dict[str, Any]:
    torch.manual_seed(0)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    singles = [dist.new_group([r]) for r in range(4)]
    groups = {4: dist.group.WORLD, 2: pairs[dist.get_rank() // 2], 1: singles[dist.get_rank()]}
    checks: dict[str, Callable[[], Any]] = {}
    for cp, group in groups.items():
        for attention in ATTENTION:
            for kv_heads in (2, HEADS):
                checks[f"{attention}_cp{cp}_kv{kv_heads}"] = lambda a=attention, h=kv_heads, g=group: compare(a, h, g)
    bad = torch.randn(B, 6, T // 4, D)
    checks["a2a_heads_error"] = lambda: _error_message(lambda: all_to_all_attention(bad, bad, bad, dist.group.WORLD))
    checks["ring_autocast"] = lambda: autocast_errors(dist.group.WORLD)
    odd = torch.randn(B, HEADS, 3, D)
    checks["ring_odd_error"] = lambda: _error_message(lambda: ring_attention(odd, odd, odd, dist.group.WORLD))
    checks["gather"] = lambda: gather_errors(dist.group.WORLD)
    return run_checks(checks)


CASES = [f"{a}_cp{cp}_kv{h}" for cp in (4, 2, 1) for a in ATTENTION for h in (2, HEADS)]


@pytest.fixture(scope="module")
def cp_world() -> list[dict[str, Any]]:
    return run_on_ranks(world, 4, timeout=120)


@pytest.mark.parametrize("case", CASES)
def test_matches_full_attention(cp_world, case):
    for rank, results in enumerate(cp_world):
        errors = result_of(results, case)
        assert set(errors) == {"out", "q_grad", "k_grad", "v_grad"}
        assert all(err <= TOL for err in errors.values()), f"rank {rank}: {errors}"


def test_ring_keeps_fp32_statistics_under_autocast(cp_world):
    for results in cp_world:
        errors = result_of(results, "ring_autocast")
        assert errors["dtype"] == "torch.bfloat16"
        assert max(errors["ring"], errors["ring_math"]) <= 2.0 * errors["sdpa"], errors


def test_clear_errors(cp_world):
    for results in cp_world:
        assert "heads=6 is not divisible by cp=4" in result_of(results, "a2a_heads_error")
        assert "local sequence length 3 is odd" in result_of(results, "ring_odd_error")


def test_gathered_sequence_and_its_gradient(cp_world):
    for rank, results in enumerate(cp_world):
        errors = result_of(results, "gather")
        assert errors["out"] == 0.0 and errors["grad"] <= 1e-6, f"rank {rank}: {errors}"


# -- layout, in this process -------------------------------------------------------------------------------------
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_shard_unshard_round_trip(cp):
    x = torch.arange(2 * 3 * 16, dtype=torch.float32).view(2, 16, 3)
    parts = [shard_sequence(x, 1, r, cp) for r in range(cp)]
    assert all(p.shape == (2, 16 // cp, 3) for p in parts)
    assert torch.equal(unshard_sequence(parts, 1, cp), x)


def test_layout_is_load_balanced():
    # cp=2, T=8: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    x = torch.arange(8)
    assert shard_sequence(x, 0, 0, 2).tolist() == [0, 1, 6, 7]
    assert shard_sequence(x, 0, 1, 2).tolist() == [2, 3, 4, 5]


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_local_positions_match_the_shard(cp):
    seq = torch.arange(32)
    for r in range(cp):
        pos = local_positions(32, r, cp, device="cpu")
        assert pos.dtype == torch.long
        assert torch.equal(pos, shard_sequence(seq, 0, r, cp))


def test_indivisible_length_names_values_and_fix():
    with pytest.raises(ValueError, match=r"sequence length 30 is not divisible by 2 \* cp = 8 \(cp=4\).*\(e\.g\. 32\)"):
        shard_sequence(torch.zeros(30), 0, 0, 4)
    with pytest.raises(ValueError, match="sequence length 30"):
        local_positions(30, 0, 4, device="cpu")
    with pytest.raises(ValueError, match="cp_rank=4 is outside"):
        local_positions(32, 4, 4, device="cpu")
