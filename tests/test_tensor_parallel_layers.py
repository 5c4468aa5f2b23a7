"""Each tensor-parallel layer and the loss against its dense twin: outputs and gradients, tp=2 and 4."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_3d.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from lightning_3d.tensor_parallel.spec import gather_full, get_spec
from lightning_3d.testing import run_on_ranks
from tests.helpers import result_of, run_checks

B, T, IN, OUT = 2, 8, 12, 16
TOL = 1e-5


def _chunk(t: torch.Tensor, dim: int) -> torch.Tensor:
    return t.chunk(dist.get_world_size(), dim=dim)[dist.get_rank()]


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def _inputs(shape: tuple[int, ...], seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def column(sequence_parallel: bool, gather_output: bool) -> dict[str, float]:
    torch.manual_seed(0)
    dense = nn.Linear(IN, OUT)
    torch.manual_seed(0)
    layer = ColumnParallelLinear(IN, OUT, gather_output=gather_output, sequence_parallel=sequence_parallel, tp_group=dist.group.WORLD)
    x_full = _inputs((B, T, IN)).requires_grad_()
    g_full = _inputs((B, T, OUT), seed=2)
    y_full = dense(x_full)
    (y_full * g_full).sum().backward()

    x = (_chunk(x_full.detach(), -2) if sequence_parallel else x_full.detach()).clone().requires_grad_()
    y = layer(x)
    g = g_full if gather_output else _chunk(g_full, -1)
    (y * g).sum().backward()
    expected_y = y_full if gather_output else _chunk(y_full, -1)
    expected_xg = _chunk(x_full.grad, -2) if sequence_parallel else x_full.grad
    return {
        "y": _err(y, expected_y),
        "x_grad": _err(x.grad, expected_xg),
        "w_grad": _err(layer.weight.grad, _chunk(dense.weight.grad, 0)),
        "b_grad": _err(layer.bias.grad, _chunk(dense.bias.grad, 0)),
        "init": _err(layer.weight, _chunk(dense.weight, 0)),
    }


def row(sequence_parallel: bool, input_is_parallel: bool) -> dict[str, float]:
    torch.manual_seed(0)
    dense = nn.Linear(OUT, IN)
    torch.manual_seed(0)
    layer = RowParallelLinear(OUT, IN, input_is_parallel=input_is_parallel, sequence_parallel=sequence_parallel, tp_group=dist.group.WORLD)
    x_full = _inputs((B, T, OUT)).requires_grad_()
    g_full = _inputs((B, T, IN), seed=2)
    y_full = dense(x_full)
    (y_full * g_full).sum().backward()

    x = (_chunk(x_full.detach(), -1) if input_is_parallel else x_full.detach()).clone().requires_grad_()
    y = layer(x)
    g = _chunk(g_full, -2) if sequence_parallel else g_full
    (y * g).sum().backward()
    bias_grad = layer.bias.grad  # with sequence parallel, summed over ranks by the bias's gradient hook
    return {
        "y": _err(y, _chunk(y_full, -2) if sequence_parallel else y_full),
        "x_grad": _err(x.grad, _chunk(x_full.grad, -1) if input_is_parallel else x_full.grad),
        "w_grad": _err(layer.weight.grad, _chunk(dense.weight.grad, 1)),
        "b_grad": _err(bias_grad, dense.bias.grad),
        "init": _err(layer.weight, _chunk(dense.weight, 1)),
        "bias_marked_sp": float(get_spec(layer.bias).sequence_parallel == sequence_parallel),
    }


def embedding(sequence_parallel: bool, vocab: int) -> dict[str, float]:
    torch.manual_seed(0)
    dense = nn.Embedding(vocab, IN)
    torch.manual_seed(0)
    layer = VocabParallelEmbedding(vocab, IN, sequence_parallel=sequence_parallel, tp_group=dist.group.WORLD)
    ids = torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(3))
    g_full = _inputs((B, T, IN), seed=2)
    y_full = dense(ids)
    (y_full * g_full).sum().backward()
    y = layer(ids)
    (y * (_chunk(g_full, -2) if sequence_parallel else g_full)).sum().backward()
    spec = get_spec(layer.weight)
    return {
        "y": _err(y, _chunk(y_full, -2) if sequence_parallel else y_full),
        "w_grad": _err(gather_full(layer.weight.grad, spec), dense.weight.grad),
        "init": _err(gather_full(layer.weight.detach(), spec), dense.weight),
    }


def cross_entropy(label_smoothing: float, vocab: int) -> dict[str, float]:
    world = dist.get_world_size()
    padded = -(-vocab // world) * world
    logits_full = _inputs((B * T, padded)) * 3
    target = torch.randint(0, vocab, (B * T,), generator=torch.Generator().manual_seed(4))
    target[::5] = -100
    dense_logits = logits_full[:, :vocab].clone().requires_grad_()
    expected = F.cross_entropy(dense_logits, target, ignore_index=-100, label_smoothing=label_smoothing)
    expected.backward()
    local = _chunk(logits_full, -1).clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, label_smoothing=label_smoothing, tp_group=dist.group.WORLD, vocab_size=vocab)
    loss.backward()
    grad_full = torch.cat([torch.zeros_like(dense_logits.grad), torch.zeros(B * T, padded - vocab)], dim=1)
    grad_full[:, :vocab] = dense_logits.grad
    return {"loss": abs(float(loss) - float(expected)), "grad": _err(local.grad, _chunk(grad_full, -1))}


CASES: dict[str, Callable[[], dict[str, float]]] = {
    "column": lambda: column(False, False),
    "column_gather": lambda: column(False, True),
    "column_sp": lambda: column(True, False),
    "row": lambda: row(False, True),
    "row_split_input": lambda: row(False, False),
    "row_sp": lambda: row(True, True),
    "embedding": lambda: embedding(False, 64),
    "embedding_padded_vocab": lambda: embedding(False, 62),
    "embedding_sp": lambda: embedding(True, 64),
    "ce": lambda: cross_entropy(0.0, 64),
    "ce_smoothing_padded": lambda: cross_entropy(0.1, 61),
}


def world() -> dict[str, Any]:
    torch.set_default_dtype(torch.float32)
    return run_checks(CASES)


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def tp_world(request) -> list[dict[str, Any]]:
    return run_on_ranks(world, request.param, timeout=180)


@pytest.mark.parametrize("case", list(CASES))
def test_layer_matches_dense(tp_world, case):
    for rank, results in enumerate(tp_world):
        errors = result_of(results, case)
        marked = errors.pop("bias_marked_sp", 1.0)
        assert marked == 1.0
        assert all(err <= TOL for err in errors.values()), f"rank {rank}: {errors}"
