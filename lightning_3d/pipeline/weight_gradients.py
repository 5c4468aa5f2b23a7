"""Split a backward into its input-gradient half (I) and its weight-gradient half (W) for the
zero-bubble schedules, by deferring the weight gradients of linear layers.

While a zero-bubble schedule runs, :class:`DeferredWeightGradients` intercepts ``F.linear`` (every
``nn.Linear``, the tensor-parallel column and row layers, Hugging Face attention and MLP
projections) and HF ``Conv1D``'s ``torch.addmm(bias, x, weight)`` whose weight is a trainable leaf.
Their backward computes the input gradient at once; inside :meth:`DeferredWeightGradients.collect`
(an I) the weight and bias gradients become closures, run later by the W, which accumulate into
``.grad``; outside it (a whole backward B) they are returned to autograd as usual. Every other
parameter (norms, embeddings, the sequence-parallel layers' own autograd functions) gets its
gradient in I.

Recompute: a checkpointed forward must save the same tensors when it runs again inside the I, but
torch runs backward without the forward's function modes. Our own activation checkpointing enters
:func:`checkpoint_contexts` (its recompute intercepts again while a step intercepts); inside any
other saved-tensor hooks (someone else's checkpoint, a memory probe) nothing is intercepted, so a
foreign recompute meets the plain layers it saved.

Why not torch's ``stage_backward_input``/``stage_backward_weight``: they keep the whole graph
(``retain_graph``) until W and run one autograd call per group of weights, each walking the graph
below it; on CPU that made a split backward 28% slower than the whole one (I + W = 80.6 ms against
63 ms for 4 GPT blocks and the head), which unbalanced the stages. Here I frees the graph, W is one
matmul per weight, and I + W costs what B does (docs/pipeline.md, "How the halves run").
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

Work = Callable[[], None]


def _trainable_leaf(t: Any) -> bool:
    """A parameter W may write ``.grad`` to: a plain (not subclassed) leaf that requires grad."""
    return isinstance(t, Tensor) and type(t) in (Tensor, torch.nn.Parameter) and t.is_leaf and t.requires_grad


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)  # (float64 is left to autograd: autocast does not cast it)


def _plain(t: Any) -> bool:
    return t is None or (isinstance(t, Tensor) and type(t) in (Tensor, torch.nn.Parameter) and t.dtype in _FLOATS)


def _deferrable(x: Any, weight: Any, bias: Any, transposed: bool) -> bool:
    """What this module's function computes exactly as autograd would: a trainable contiguous leaf
    weight, plain float tensors, a bias of one value per output (not one broadcast to all)."""
    if not (_trainable_leaf(weight) and _plain(x) and _plain(bias) and weight.dim() == 2 and weight.is_contiguous()):
        return False
    outputs = weight.shape[1] if transposed else weight.shape[0]
    return (x.dim() == 2 if transposed else x.dim() >= 1) and (bias is None or tuple(bias.shape) == (outputs,))


def _autocast_dtype(device: torch.device) -> Optional[torch.dtype]:
    kind = device.type
    if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return None


def _accumulate(param: Tensor, grad: Tensor) -> None:
    if param.grad is None:
        param.grad = grad
    else:
        param.grad += grad


class _DeferredLinear(torch.autograd.Function):
    """``y = x @ W^T + b`` (``transposed``: ``y = b + x @ W``, HF ``Conv1D``), computed as autocast
    would (every floating input cast to the autocast dtype) and differentiated with the formulas
    autograd uses for ``F.linear``; the weight's and bias's gradients wait for W inside an I."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Optional[Tensor], store: "DeferredWeightGradients", transposed: bool) -> Tensor:
        dtype = _autocast_dtype(x.device)
        xc, bc = (t if t is None or dtype is None else t.to(dtype) for t in (x, bias))
        wc = weight if dtype is None else store.cast(weight, dtype)
        with torch.autocast(x.device.type, enabled=False) if dtype is not None else nullcontext():
            if transposed:
                y = torch.addmm(bc, xc.reshape(-1, xc.shape[-1]), wc).view(*xc.shape[:-1], wc.shape[1])
            else:
                y = F.linear(xc, wc, bc)
        ctx.store, ctx.transposed, ctx.x_dtype = store, transposed, x.dtype
        ctx.weight, ctx.bias = weight, bias
        ctx.save_for_backward(xc, wc)
        return y

    @staticmethod
    def backward(ctx: Any, grad_y: Tensor) -> tuple[Optional[Tensor], ...]:
        if torch.is_grad_enabled():
            raise RuntimeError(
                "a zero-bubble pipeline schedule's linear layers do not support a double backward (create_graph=True); "
                "use pipeline_schedule='1f1b' for it."
            )
        xc, wc = ctx.saved_tensors
        weight, bias = ctx.weight, ctx.bias
        g = grad_y.reshape(-1, grad_y.shape[-1])
        grad_x = None
        if ctx.needs_input_grad[0]:
            w = wc.t() if ctx.transposed else wc
            grad_x = g.mm(w).view(*grad_y.shape[:-1], w.shape[1]).to(ctx.x_dtype)
        need_w, need_b = ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]
        x2 = xc.reshape(-1, xc.shape[-1])

        def weight_grad() -> Tensor:
            gw = x2.t().mm(g) if ctx.transposed else g.t().mm(x2)
            return gw.to(weight.dtype)

        def bias_grad() -> Tensor:
            return g.sum(0).to(bias.dtype)

        pending = ctx.store.collecting
        if pending is None:  # a whole backward: autograd accumulates them
            return grad_x, weight_grad() if need_w else None, bias_grad() if need_b else None, None, None
        deferred_bias = need_b and _trainable_leaf(bias)
        versions = (xc._version, grad_y._version)  # what autograd checks for saved tensors, checked again at W

        def work() -> None:
            if (xc._version, grad_y._version) != versions:
                raise RuntimeError(
                    f"a linear layer's input or output gradient ({tuple(xc.shape)}) was modified in place between the "
                    f"zero-bubble schedule's input-gradient half and its weight-gradient half; its weight gradient would be "
                    f"wrong. Avoid the in-place operation or use pipeline_schedule='1f1b'."
                )
            if need_w:
                _accumulate(weight, weight_grad())
            if deferred_bias:
                _accumulate(bias, bias_grad())

        if need_w or deferred_bias:
            pending.append(work)
        return grad_x, None, bias_grad() if need_b and not deferred_bias else None, None, None


# Process-wide (a GPU backward, and the recompute in it, runs on autograd's device thread): the store of
# the step now intercepting, and the saved-tensor hooks torch's checkpoint had pushed when our own
# checkpoint's forward or recompute contexts were entered (torch pushes them before entering those).
_intercepting: Optional["DeferredWeightGradients"] = None
_our_hooks: list[Any] = []


def _top_hooks() -> Any:
    return torch._C._autograd._top_saved_tensors_default_hooks(True)


def _may_defer() -> bool:
    """Outside saved-tensor hooks, or right inside our own checkpoint (whose recompute intercepts too).
    Inside any other hooks -- someone else's checkpoint, even one nested in ours, a memory probe --
    nothing is deferred, so a foreign recompute saves what its forward saved."""
    top = _top_hooks()
    return top is None or (bool(_our_hooks) and _our_hooks[-1] is not None and top[0] is _our_hooks[-1][0])


class _Intercept(TorchFunctionMode):
    def __init__(self, store: "DeferredWeightGradients") -> None:
        super().__init__()
        self.store = store

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if torch.is_grad_enabled() and (func is F.linear or func is torch.addmm) and _may_defer():
            if func is F.linear and not kwargs and 2 <= len(args) <= 3:
                x, weight, bias = args[0], args[1], args[2] if len(args) == 3 else None
                if _deferrable(x, weight, bias, transposed=False):
                    self.store.deferred += 1
                    return _DeferredLinear.apply(x, weight, bias, self.store, False)
            elif func is torch.addmm and not kwargs and len(args) == 3:  # HF Conv1D: addmm(bias, x2d, weight)
                bias, x, weight = args
                if bias is not None and _deferrable(x, weight, bias, transposed=True):
                    self.store.deferred += 1
                    return _DeferredLinear.apply(x, weight, bias, self.store, True)
        return func(*args, **kwargs)


class DeferredWeightGradients:
    """Where a zero-bubble step keeps the linear layers' weight gradients between I and W."""

    def __init__(self) -> None:
        self.collecting: Optional[list[Work]] = None
        self.deferred = 0  # linear calls intercepted (a test reads it)
        self._casts: dict[tuple[int, int, torch.dtype], Tensor] = {}

    def cast(self, weight: Tensor, dtype: torch.dtype) -> Tensor:
        """The weight in autocast's dtype, cast once per step as autocast's own cache does (not once per
        micro-batch: every micro-batch between its F and its I would hold its own copy)."""
        if weight.dtype == dtype:
            return weight
        key = (id(weight), weight._version, dtype)
        cast = self._casts.get(key)
        if cast is None:
            cast = self._casts[key] = weight.detach().to(dtype)
        return cast

    @contextmanager
    def intercepting(self) -> Iterator[None]:
        """Around a whole zero-bubble step: forwards (and our recompute inside an I) build deferrable linears."""
        global _intercepting
        previous, _intercepting = _intercepting, self
        try:
            with _Intercept(self):
                yield
        finally:
            _intercepting = previous
            self._casts.clear()

    @contextmanager
    def collect(self, into: list[Work]) -> Iterator[list[Work]]:
        """Around an I: weight gradients of the linears it reaches go to ``into`` instead of ``.grad``."""
        previous, self.collecting = self.collecting, into
        try:
            yield into
        finally:
            self.collecting = previous

    @staticmethod
    def run(works: list[Work]) -> None:
        """W: the weight gradients one I set aside, in the order its backward reached them."""
        for work in works:
            work()
        works.clear()


class _OurCheckpoint:
    """Entered around our checkpoint's forward, and (``recompute``) around its recompute, which then
    intercepts as the forward did when a step is intercepting. Re-enterable: a recompute may run again."""

    def __init__(self, recompute: bool) -> None:
        self.recompute = recompute
        self._modes: list[Optional[_Intercept]] = []

    def __enter__(self) -> None:
        _our_hooks.append(_top_hooks())
        mode = _Intercept(_intercepting) if self.recompute and _intercepting is not None else None
        if mode is not None:
            mode.__enter__()
        self._modes.append(mode)

    def __exit__(self, *exc: Any) -> None:
        mode = self._modes.pop()
        if mode is not None:
            mode.__exit__(*exc)
        _our_hooks.pop()


def checkpoint_contexts() -> tuple[_OurCheckpoint, _OurCheckpoint]:
    """(forward, recompute) contexts for ``torch.utils.checkpoint``'s ``context_fn``."""
    return _OurCheckpoint(False), _OurCheckpoint(True)
