"""``ThreeDPrecision``: dtype policy, dynamic loss scaling and global-norm clipping.

Modes (``Trainer(precision=...)`` is translated by the strategy, or pass the plugin):

* ``"32-true"``: fp32 everywhere.
* ``"bf16-mixed"`` / ``"16-mixed"``: parameters and gradients in bf16/fp16 for compute, fp32 master
  weights in the (sharded) optimizer, as DeepSpeed and Megatron do (with ZeRO 0-2 the ZeRO
  optimizer keeps the masters; with ZeRO 3, FSDP2's sharded fp32 parameters are the masters);
  ``autocast`` covers whatever stays fp32. ``16-mixed`` adds dynamic loss scaling.
* ``"bf16-true"``: bf16 parameters, gradients and optimizer state, no master copy.

Gradient clipping uses the *global* norm: every parameter counted exactly once across ZeRO
shards, tensor-parallel slices (replicated parameters counted on tp rank 0 only) and replicas.
With loss scaling, an overflow on any rank makes every rank skip the step together.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor
from torch.optim import Optimizer

from lightning_3d.tensor_parallel.spec import get_spec
from lightning_3d.topology import Topology

MODES: dict[str, tuple[torch.dtype, torch.dtype]] = {  # compute dtype, master dtype
    "32-true": (torch.float32, torch.float32),
    "bf16-mixed": (torch.bfloat16, torch.float32),
    "16-mixed": (torch.float16, torch.float32),
    "bf16-true": (torch.bfloat16, torch.bfloat16),
}


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _is_dp_sharded(t: Tensor) -> bool:
    """FSDP2 (ZeRO-3) gradients are DTensors sharded over the data-parallel mesh."""
    return hasattr(t, "to_local")


def global_grad_norm(parameters: Iterable[Tensor], topology: Optional[Topology], norm_type: float = 2.0) -> Tensor:
    """Norm of all gradients of the model, counting every parameter once (collective over dp, tp, pp)."""
    if norm_type not in (2.0, float("inf")):
        raise ValueError(f"gradient_clip norm_type={norm_type} is not supported; use 2 or inf.")
    unique = list({id(p): p for p in parameters if p.grad is not None}.values())
    device = _local(unique[0].grad).device if unique else torch.device("cpu")
    tp_rank = topology.tp_rank if topology is not None else 0
    dp_sharded = torch.zeros((), device=device)
    replicated = torch.zeros((), device=device)
    for p in unique:
        spec = get_spec(p)
        if tp_rank != 0 and not (spec is not None and spec.is_sharded):
            continue  # identical on every tp rank: counted by tp rank 0
        if getattr(p, "pipeline_duplicate", False):
            continue  # a tied weight's copy on the last pipeline stage: counted on the first
        g = _local(p.grad).detach().float()
        value = g.abs().max() if norm_type == float("inf") else g.pow(2).sum()
        if _is_dp_sharded(p.grad):
            dp_sharded = torch.maximum(dp_sharded, value) if norm_type == float("inf") else dp_sharded + value
        else:
            replicated = torch.maximum(replicated, value) if norm_type == float("inf") else replicated + value
    op = dist.ReduceOp.MAX if norm_type == float("inf") else dist.ReduceOp.SUM
    if topology is not None and topology.dp_size > 1:
        dist.all_reduce(dp_sharded, op=op, group=topology.dp_group)
    total = torch.maximum(dp_sharded, replicated) if norm_type == float("inf") else dp_sharded + replicated
    if topology is not None and topology.dims.tp > 1:
        dist.all_reduce(total, op=op, group=topology.tp_group)
    if topology is not None and topology.dims.pp > 1:
        dist.all_reduce(total, op=op, group=topology.pp_group)
    return total if norm_type == float("inf") else total.sqrt()


class DynamicLossScaler:
    """fp16 loss scaling: shrink on overflow (after ``hysteresis`` overflows), grow after
    ``growth_interval`` clean steps. Its state is saved in checkpoints."""

    def __init__(
        self,
        initial_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        min_scale: float = 1.0,
    ) -> None:
        if initial_scale <= 0 or min_scale <= 0 or not 0 < backoff_factor < 1 or growth_factor <= 1:
            raise ValueError("loss scaler: initial_scale, min_scale > 0, 0 < backoff_factor < 1 < growth_factor.")
        if growth_interval < 1 or hysteresis < 1:
            raise ValueError("loss scaler: growth_interval and hysteresis must be at least 1.")
        self.scale = float(initial_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.hysteresis, self.min_scale = growth_interval, hysteresis, min_scale
        self._growth_tracker = 0
        self._hysteresis_left = hysteresis
        self.skipped_steps = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.skipped_steps += 1
            self._growth_tracker = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_left = self.hysteresis
                self.scale *= self.growth_factor

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_left": self._hysteresis_left,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self._growth_tracker = int(state["growth_tracker"])
        self._hysteresis_left = int(state["hysteresis_left"])
        self.skipped_steps = int(state.get("skipped_steps", 0))


class ThreeDPrecision(Precision):
    """Precision plugin for ``ThreeDParallelStrategy`` (installed automatically for ``precision=...``).

    Args:
        precision: ``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"`` or ``"bf16-true"``.
        initial_scale, growth_interval, hysteresis, min_scale, backoff_factor, growth_factor:
            dynamic loss scaling for ``"16-mixed"``.
    """

    def __init__(
        self,
        precision: str = "32-true",
        initial_scale: float = 2.0**16,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        min_scale: float = 1.0,
        backoff_factor: float = 0.5,
        growth_factor: float = 2.0,
    ) -> None:
        if precision not in MODES:
            raise ValueError(f"precision={precision!r} is not supported by ThreeDPrecision; choose one of {list(MODES)}.")
        self.precision = precision
        self.compute_dtype, self.master_dtype = MODES[precision]
        self.scaler: Optional[DynamicLossScaler] = None
        if precision == "16-mixed":
            self.scaler = DynamicLossScaler(initial_scale, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale)
        self.topology: Optional[Topology] = None
        self.device_type = "cpu"
        self._unscaled: set[int] = set()  # optimizers whose gradients are unscaled for the coming step

    @property
    def mixed(self) -> bool:
        return self.compute_dtype != self.master_dtype

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        # Mixed modes: the ZeRO optimizer casts trainable parameters once it holds the fp32 masters.
        return module.to(self.compute_dtype) if self.precision == "bf16-true" else module

    def convert_input(self, data: Any) -> Any:
        if self.precision != "bf16-true":
            return data
        from lightning.fabric.utilities.apply_func import apply_to_collection

        return apply_to_collection(data, Tensor, lambda t: t.to(self.compute_dtype) if t.is_floating_point() else t)

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        ctx = torch.autocast(self.device_type, dtype=self.compute_dtype) if self.mixed else nullcontext()
        with ctx:
            yield

    # -- loss scaling ----------------------------------------------------------------------------
    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:
        tensor = super().pre_backward(tensor, module)
        return tensor * self.scaler.scale if self.scaler is not None else tensor

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()
        overflow = self.found_overflow(optimizer)
        if overflow:
            optimizer.zero_grad()  # every rank skips this step together
        else:
            self._unscale_once(optimizer)
            self._after_closure(model, optimizer)
            optimizer.step(**kwargs)
        self._unscaled.discard(id(_raw(optimizer)))
        self.scaler.update(overflow)
        return closure_result

    def _unscale_once(self, optimizer: Any) -> None:
        """Unscale an optimizer's gradients once per step, whoever asks first: the step, or clipping
        that manual optimization calls before ``opt.step()`` (clipping scaled gradients would clip by
        the loss scale too)."""
        if self.scaler is not None and id(_raw(optimizer)) not in self._unscaled:
            self.unscale_(optimizer, 1.0 / self.scaler.scale)
            self._unscaled.add(id(_raw(optimizer)))

    def clip_gradients(self, optimizer: Any, clip_val: float = 0.0, gradient_clip_algorithm: Any = "norm") -> None:
        if clip_val > 0:
            self._unscale_once(optimizer)
        super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    def found_overflow(self, optimizer: Any) -> bool:
        """A non-finite gradient on any rank (a MAX all-reduce over the world, so all agree)."""
        if hasattr(optimizer, "local_overflow"):
            local = optimizer.local_overflow()
        else:
            local = any(not torch.isfinite(_local(p.grad)).all() for p in _params(optimizer) if p.grad is not None)
        device = torch.device("cuda", torch.cuda.current_device()) if self.device_type == "cuda" else torch.device("cpu")
        flag = torch.tensor(float(local), device=device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def unscale_(self, optimizer: Any, inv_scale: float) -> None:
        if hasattr(optimizer, "unscale_"):
            optimizer.unscale_(inv_scale)
            return
        for p in _params(optimizer):
            if p.grad is not None:
                _local(p.grad).mul_(inv_scale)

    # -- clipping by the global norm -------------------------------------------------------------------
    def clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        if hasattr(optimizer, "grad_norm_squared"):  # a ZeroOptimizer: its gradients live in shards
            norm = optimizer.grad_norm_squared().sqrt()
            optimizer.scale_grads_((clip_val / (norm + 1e-6)).clamp(max=1.0))
            return
        params = _params(optimizer)
        norm = global_grad_norm(params, self.topology)
        scale = (clip_val / (norm + 1e-6)).clamp(max=1.0)
        for p in {id(p): p for p in params if p.grad is not None}.values():
            _local(p.grad).detach().mul_(scale.to(_local(p.grad).device))

    def clip_grad_by_value(self, optimizer: Any, clip_val: float) -> None:
        """Element-wise, so local: the ZeRO optimizer clamps its reduced slices (``p.grad`` is ``None``
        there after reduction); otherwise each gradient (or its local shard) is clamped."""
        if hasattr(optimizer, "clip_grad_value_"):
            optimizer.clip_grad_value_(clip_val)
            return
        for p in {id(p): p for p in _params(optimizer) if p.grad is not None}.values():
            _local(p.grad).detach().clamp_(-clip_val, clip_val)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"precision": self.precision}
        if self.scaler is not None:
            state["loss_scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and "loss_scaler" in state_dict:
            self.scaler.load_state_dict(state_dict["loss_scaler"])


def _raw(optimizer: Any) -> Any:
    """The optimizer behind Lightning's ``LightningOptimizer`` wrapper (one identity per optimizer)."""
    return getattr(optimizer, "_optimizer", optimizer)


def _params(optimizer: Optimizer) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def adopt_precision(plugin: Optional[Precision]) -> Optional[Precision]:
    """Swap Lightning's plugin for ``Trainer(precision=...)`` for the equivalent ThreeDPrecision."""
    from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision

    if plugin is None or isinstance(plugin, ThreeDPrecision):
        return plugin
    if type(plugin) is Precision:
        return ThreeDPrecision("32-true")
    if isinstance(plugin, MixedPrecision) and plugin.precision in ("bf16-mixed", "16-mixed"):
        return ThreeDPrecision(plugin.precision)
    if isinstance(plugin, HalfPrecision) and plugin.precision == "bf16-true":
        return ThreeDPrecision("bf16-true")
    name = getattr(plugin, "precision", type(plugin).__name__)
    raise ValueError(
        f"precision={name!r} is not supported by ThreeDParallelStrategy; use '32-true', 'bf16-mixed', "
        f"'16-mixed' or 'bf16-true'."
    )
