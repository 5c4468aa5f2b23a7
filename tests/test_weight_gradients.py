"""The zero-bubble I/W split (lightning_3d/pipeline/weight_gradients.py): deferred linear weight
gradients equal autograd's bit for bit, wait for W inside an I, and are left alone where they cannot
be deferred."""

from __future__ import annotations

from typing import Callable, Optional

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_3d.pipeline.weight_gradients import DeferredWeightGradients
from lightning_3d.transforms.activation_checkpointing import checkpoint_forward


class Conv1D(nn.Module):
    """Hugging Face GPT-2's Conv1D: ``y = b + x @ W`` with W stored (in, out), via ``torch.addmm``."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.1)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return out.view(x.size()[:-1] + (self.weight.shape[1],))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.b = nn.Linear(16, 16, bias=False)
        self.c = Conv1D(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.a(x))
        h = self.b(self.norm(h))
        # a weight used through a computed (non-leaf) tensor: autograd's, in I
        h = torch.nn.functional.linear(h, self.b.weight * 1.0)
        return self.c(h)


class Net(nn.Module):
    """recompute: None, "ours" (lightning_3d's activation checkpointing) or "foreign" (torch's checkpoint
    called by the model itself: nothing inside it is deferred)."""

    def __init__(self, recompute: Optional[str] = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = Block()
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.scale = nn.Parameter(torch.ones(8))
        self.recompute = recompute
        if recompute == "ours":
            checkpoint_forward(self.block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.block, x, use_reentrant=False) if self.recompute == "foreign" else self.block(x)
        return (self.frozen(h) * self.scale).pow(2).mean()


def _grads(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    out["input"] = x.grad.clone()
    model.zero_grad(set_to_none=True)
    x.grad = None
    return out


def _run(model: nn.Module, x: torch.Tensor, mode: str, autocast: bool = False) -> tuple[dict[str, torch.Tensor], int]:
    """mode: "plain" (autograd), "B" (intercepted, whole backward), "IW" (intercepted, I then W)."""
    store = DeferredWeightGradients()
    works: list[Callable[[], None]] = []
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        if mode == "plain":
            loss = model(x)
            loss.backward()
        else:
            with store.intercepting():
                loss = model(x)
                if mode == "B":
                    loss.backward()
                else:
                    with store.collect(works):
                        loss.backward()
    if mode == "IW":
        deferred = model.recompute != "foreign"
        assert (model.block.a.weight.grad is None) == deferred and (model.block.c.weight.grad is None) == deferred
        assert model.block.norm.weight.grad is not None and x.grad is not None  # not deferred: computed in I
        assert bool(works) == deferred
        store.run(works)
    return _grads(model, x), store.deferred


@pytest.mark.parametrize("recompute", [None, "ours", "foreign"])
@pytest.mark.parametrize("autocast", [False, True])
def test_deferred_weight_gradients_equal_autograd_bit_for_bit(recompute: Optional[str], autocast: bool) -> None:
    model = Net(recompute)
    x = torch.randn(3, 5, 8, requires_grad=True)
    reference, _ = _run(model, x, "plain", autocast)
    for mode in ("B", "IW"):
        got, deferred = _run(model, x, mode, autocast)
        assert deferred == {None: 3, "ours": 6, "foreign": 0}[recompute]  # a, b, c (again in our recompute, under I)
        assert got.keys() == reference.keys()
        for name, g in reference.items():
            assert got[name].dtype == g.dtype, name
            assert torch.equal(got[name], g), (mode, name, (got[name] - g).abs().max())
    assert "frozen.weight" not in reference


def test_deferred_gradients_accumulate_over_micro_batches() -> None:
    model = Net()
    xs = [torch.randn(2, 5, 8, requires_grad=True) for _ in range(3)]
    for x in xs:
        model(x).backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    store = DeferredWeightGradients()
    held = []
    with store.intercepting():
        for x in xs:  # three I's, then their W's: the order a zero-bubble rank runs them in
            loss = model(x)
            with store.collect([]) as works:
                loss.backward()
            held.append(works)
    for works in held:
        store.run(works)
    for name, g in reference.items():
        torch.testing.assert_close(model.get_parameter(name).grad, g, rtol=1e-6, atol=1e-7)


def test_nothing_is_intercepted_without_grad() -> None:
    model = Net()
    store = DeferredWeightGradients()
    with store.intercepting(), torch.no_grad():
        model(torch.randn(2, 5, 8))
    assert store.deferred == 0


# -- second review's findings ------------------------------------------------------------------------------
class Square(nn.Module):
    """Square weights (q/k/v-like): a recompute that saved W where the forward saved W^T would pass
    torch's shape check and silently use the transpose."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.a = nn.Linear(4, 4)
        self.inner = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return checkpoint(lambda t: torch.tanh(self.inner(t)), h, use_reentrant=False)  # the model's own checkpoint


@pytest.mark.parametrize("mode", ["B", "IW"])
def test_a_foreign_checkpoint_nested_in_ours_is_left_alone(mode: str) -> None:
    model = Square()
    checkpoint_forward(model)  # ours around the model's own
    x = torch.randn(3, 4, requires_grad=True)
    model(x).pow(2).sum().backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    store, works = DeferredWeightGradients(), []
    with store.intercepting():
        loss = model(x).pow(2).sum()
        if mode == "IW":
            with store.collect(works):
                loss.backward()
        else:
            loss.backward()
    store.run(works)
    assert store.deferred == 2  # model.a, in our forward and our recompute; not inner, inside the foreign one
    for n, g in reference.items():
        assert torch.equal(model.get_parameter(n).grad, g), n


def test_an_in_place_change_between_i_and_w_is_an_error() -> None:
    layer = nn.Linear(4, 4)
    x = torch.randn(3, 4)
    store, works = DeferredWeightGradients(), []
    with store.intercepting():
        h = x.clone().requires_grad_()
        y = layer(h)
        with store.collect(works):
            y.sum().backward()
    with torch.no_grad():  # the layer's saved input changes after I, before W
        h.add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place"):
        store.run(works)


def test_double_backward_is_refused() -> None:
    layer = nn.Linear(4, 4)
    store = DeferredWeightGradients()
    with store.intercepting():
        y = layer(torch.randn(3, 4, requires_grad=True)).pow(2).sum()
        with pytest.raises(RuntimeError, match="double backward"):
            torch.autograd.grad(y, layer.weight, create_graph=True)


def test_what_autograd_would_compute_differently_is_left_to_autograd() -> None:
    """A bias broadcast over the outputs, float64, a non-contiguous weight: not intercepted."""
    store = DeferredWeightGradients()
    w = nn.Parameter(torch.randn(6, 4))
    cases = [
        (torch.randn(3, 4), w, nn.Parameter(torch.randn(1))),
        (torch.randn(3, 4, dtype=torch.float64), nn.Parameter(torch.randn(6, 4, dtype=torch.float64)), None),
        (torch.randn(3, 4), nn.Parameter(torch.randn(4, 6).t()), None),
    ]
    with store.intercepting():
        for x, weight, bias in cases:
            torch.nn.functional.linear(x, weight, bias).sum().backward()
    assert store.deferred == 0


def test_under_autocast_a_weight_is_cast_once_per_step() -> None:
    layer = nn.Linear(8, 8)
    store = DeferredWeightGradients()
    outs = []
    with store.intercepting(), torch.autocast("cpu", dtype=torch.bfloat16):
        for _ in range(4):  # four micro-batches in flight
            outs.append(layer(torch.randn(2, 8)))
        assert len(store._casts) == 1  # (autograd's autocast shares one cast too)
    assert not store._casts  # dropped with the step
