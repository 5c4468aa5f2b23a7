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

Non-finite steps: every optimizer step ends with one flag all-reduced over the world (is any loss or
gradient inf/NaN?), so all ranks decide alike. A non-finite step is skipped (the weights are left as
they were), counted in ``skipped_steps`` (logged, on the progress bar), and after
``max_consecutive_nonfinite`` such steps in a row every rank raises :class:`NonFiniteStepsError`. Under
``16-mixed`` only overflows with the loss scale already at its floor count towards that limit: the
steps that back the scale off are the scaler doing its job.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer

from lightning_3d.core.distributed import current_compute_device
from lightning_3d.core.finite import any_nonfinite
from lightning_3d.core.param_meta import is_pipeline_duplicate, replica_mesh_of
from lightning_3d.core.topology import Topology
from lightning_3d.tensor_parallel.spec import get_spec, sum_partial_gradients

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


def global_grad_norm(
    parameters: Iterable[Tensor], topology: Optional[Topology], norm_type: float = 2.0, device: Optional[torch.device] = None
) -> Tensor:
    """Norm of all gradients of the model, counting every parameter once (collective over dp, tp, pp).
    ``device``: the compute device, where the partial sums are reduced (NCCL refuses host tensors, and
    gradients may live on the host: ZeRO-3's CPU offload); default: the first gradient's device."""
    if norm_type not in (2.0, float("inf")):
        raise ValueError(f"gradient_clip norm_type={norm_type} is not supported; use 2 or inf.")
    unique = list({id(p): p for p in parameters if p.grad is not None}.values())
    if device is None:
        device = _local(unique[0].grad).device if unique else current_compute_device()
    tp_rank = topology.tp_rank if topology is not None else 0
    combine = torch.maximum if norm_type == float("inf") else torch.add
    # partial results per (dp-sharded?, gradient device): each moves to the compute device once, not
    # once per parameter (offloaded gradients live on the host)
    partial: dict[tuple[bool, torch.device], Tensor] = {}
    for p in unique:
        owners = replica_mesh_of(p)
        spec = get_spec(p)
        if tp_rank != 0 and not (spec is not None and spec.is_sharded):
            continue  # identical on every tp rank: counted by tp rank 0
        if is_pipeline_duplicate(p):
            continue  # a tied weight's copy on the last pipeline stage: counted on the first
        g = _local(p.grad).detach().float()
        value = g.abs().max() if norm_type == float("inf") else g.pow(2).sum()
        sharded = _is_dp_sharded(p.grad)
        if owners is not None and not sharded:  # an expert slice, whole on each of its expert replicas: the
            sharded = True  # dp sum counts it once per replica, so each adds its share (inf: a max is a max)
            value = value if norm_type == float("inf") else value / owners.size()
        key = (sharded, value.device)
        partial[key] = value if key not in partial else combine(partial[key], value)
    dp_sharded = torch.zeros((), device=device)
    replicated = torch.zeros((), device=device)
    for (sharded, _), value in partial.items():
        if sharded:
            dp_sharded = combine(dp_sharded, value.to(device))
        else:
            replicated = combine(replicated, value.to(device))
    op = dist.ReduceOp.MAX if norm_type == float("inf") else dist.ReduceOp.SUM
    if topology is not None and topology.dp_size > 1:
        dist.all_reduce(dp_sharded, op=op, group=topology.dp_group)
    total = torch.maximum(dp_sharded, replicated) if norm_type == float("inf") else dp_sharded + replicated
    if topology is not None and topology.dims.tp > 1:
        dist.all_reduce(total, op=op, group=topology.tp_group)
    if topology is not None and topology.dims.pp > 1:
        dist.all_reduce(total, op=op, group=topology.pp_group)
    return total if norm_type == float("inf") else total.sqrt()


class NonFiniteStepsError(RuntimeError):
    """Too many consecutive optimizer steps had a non-finite loss or gradients (raised on every rank)."""


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
        self._warned_floor = False

    @property
    def at_floor(self) -> bool:
        return self.scale <= self.min_scale

    def update(self, overflow: bool) -> None:
        if overflow:
            self.skipped_steps += 1
            self._growth_tracker = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            if self.at_floor and not self._warned_floor:
                self._warned_floor = True
                rank_zero_warn(
                    f"lightning_3d: the fp16 loss scale reached its floor min_scale={self.min_scale:g} after "
                    f"{self.skipped_steps} skipped step(s); gradients still overflow, so steps keep being skipped. "
                    f"Look for NaN/inf in the loss or data, lower the learning rate, or train in bf16-mixed."
                )
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
        max_consecutive_nonfinite: stop (:class:`NonFiniteStepsError` on every rank) after this many
            consecutive skipped steps with a non-finite loss or gradients -- under ``"16-mixed"``,
            overflows with the loss scale at ``min_scale``. ``None``: never stop (steps are still
            skipped and counted).
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
        max_consecutive_nonfinite: Optional[int] = 10,
    ) -> None:
        if precision not in MODES:
            raise ValueError(f"precision={precision!r} is not supported by ThreeDPrecision; choose one of {list(MODES)}.")
        limit = max_consecutive_nonfinite
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(
                f"max_consecutive_nonfinite={limit!r} must be a positive integer (steps), or None to never stop "
                f"on non-finite losses."
            )
        self.max_consecutive_nonfinite = limit
        self._consecutive: dict[int, int] = {}  # per optimizer: non-finite steps in a row (that count)
        self._skipped = 0  # skipped steps without a loss scaler (the scaler counts its own)
        self._warned_first_skip = False
        self._logged: Optional[tuple[int, Optional[float]]] = None  # (skipped steps, loss scale) as last logged
        self._clip_norm: dict[int, Tensor] = {}  # per optimizer: this step's global gradient norm, if clipped
        self.precision = precision
        self.compute_dtype, self.master_dtype = MODES[precision]
        self.scaler: Optional[DynamicLossScaler] = None
        if precision == "16-mixed":
            self.scaler = DynamicLossScaler(initial_scale, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale)
        self.topology: Optional[Topology] = None
        self.device_type = "cpu"
        self._unscaled: set[int] = set()  # optimizers whose gradients are unscaled for the coming step
        self._summed: set[int] = set()  # optimizers whose partial gradients are summed over tp for it

    @property
    def mixed(self) -> bool:
        return self.compute_dtype != self.master_dtype

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """``bf16-true``: parameters and the buffers a checkpoint holds in bf16. Buffers a module
        computes for itself and does not save (a rotary ``inv_freq``) keep their dtype, as Hugging
        Face's bf16 models keep them: in bf16 the rotary angles of positions past a few dozen are off
        by whole radians. Mixed modes: the ZeRO optimizer casts trainable parameters once it holds
        the fp32 masters."""
        if self.precision != "bf16-true":
            return module
        computed = [
            (sub, name, buffer)
            for sub in module.modules()
            for name, buffer in sub._buffers.items()
            if buffer is not None and name in sub._non_persistent_buffers_set
        ]
        module.to(self.compute_dtype)
        for sub, name, buffer in computed:
            sub._buffers[name] = buffer
        return module

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
        self._clip_norm.clear()  # a norm from before this backward no longer describes the gradients
        # gradients this backward adds are scaled and partial again: the next clip or step unscales and
        # sums (a clip that no step followed -- a skipped batch -- must not leave its mark on the next step)
        self._unscaled.clear()
        self._summed.clear()
        tensor = super().pre_backward(tensor, module)
        return tensor * self.scaler.scale if self.scaler is not None else tensor

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """Run the closure, agree over the world whether the step is finite, then step or skip it."""
        if self.scaler is None and _drives_its_closure(_raw(optimizer)):
            try:  # (each closure call sums its partial gradients: _wrap_closure)
                return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)  # re-runs its closure
            finally:
                self._step_done(optimizer)
        closure_result = closure()
        self._sum_partials_once(optimizer)
        if self.scaler is not None:
            at_floor = self.scaler.at_floor  # the scale this step used
            skip = self.found_overflow(optimizer)
            counts = skip and at_floor
            if not skip:
                self._unscale_once(optimizer)
                self._after_closure(model, optimizer)
        else:
            self._after_closure(model, optimizer)  # clipping may compute the global norm we check below
            skip = self._found_nonfinite(optimizer, closure_result)
            counts = skip
        if skip:
            optimizer.zero_grad()  # every rank skips this step together
        else:
            optimizer.step(**kwargs)
        self._step_done(optimizer)
        if self.scaler is not None:
            self.scaler.update(skip)
        else:
            self._skipped += int(skip)
        self._after_step(optimizer, model, counts)
        return closure_result

    def summarize_skipped(self, steps: int) -> Optional[str]:
        """The end-of-fit line about skipped steps (None when none was skipped)."""
        if not self.skipped_steps:
            return None
        return (
            f"lightning_3d: {self.skipped_steps} of {steps} optimizer steps were skipped (non-finite loss or gradients "
            f"under precision={self.precision!r}); the weights never took those updates."
        )

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because of a non-finite loss or gradients (all optimizers)."""
        return self.scaler.skipped_steps if self.scaler is not None else self._skipped

    def _after_step(self, optimizer: Any, model: Any, counts: bool) -> None:
        """Log the counters; stop after too many counted non-finite steps in a row (every rank alike:
        the decision came from an all-reduced flag)."""
        key = id(_raw(optimizer))
        self._consecutive[key] = self._consecutive.get(key, 0) + 1 if counts else 0
        self._log(model)
        if counts and not self._warned_first_skip:  # said once, whatever logger or bar is on (fp16: at the scale's floor)
            self._warned_first_skip = True
            trainer = getattr(model, "_trainer", None)
            step = f"global step {trainer.global_step}" if trainer is not None else "an optimizer step"
            rank_zero_warn(
                f"lightning_3d: {step} was skipped: its loss or gradients were not finite (inf/NaN) under "
                f"precision={self.precision!r}; further skips are counted (skipped_steps) and summarised when fit ends."
            )
        limit, run = self.max_consecutive_nonfinite, self._consecutive[key]
        if limit is None or run < limit:
            return
        trainer = getattr(model, "_trainer", None)
        where = f" (global step {trainer.global_step})" if trainer is not None else ""
        if self.scaler is not None:
            what = (
                f"{run} consecutive optimizer steps overflowed (inf/NaN gradients) with the fp16 loss scale at its "
                f"floor min_scale={self.scaler.min_scale:g}{where}; {self.skipped_steps} step(s) skipped in all. "
                f"Backing the scale off further cannot help."
            )
        else:
            what = (
                f"{run} consecutive optimizer steps had a non-finite loss or gradients (inf/NaN) under "
                f"precision={self.precision!r}{where}; they were skipped ({self.skipped_steps} in all), the weights "
                f"are those before the first of them."
            )
        raise NonFiniteStepsError(
            f"lightning_3d: {what} Usual causes: a learning rate that is too high, bad data (token ids outside "
            f"the vocabulary, NaN inputs), or a numerically unstable layer; lower the learning rate, clip gradients "
            f"(gradient_clip_val), check the data, or resume from an earlier checkpoint. "
            f"ThreeDPrecision(max_consecutive_nonfinite=...) sets this limit (None: never stop)."
        )

    def _log(self, model: Any) -> None:
        """``skipped_steps`` on the progress bar and in the logger (and the loss scale under fp16): on
        the steps whose logs Lightning writes, and on any step that changed them (so ``callback_metrics``
        is always current), not on every step -- a ``self.log`` call costs more host time than the check."""
        from lightning.pytorch.trainer.connectors.logger_connector.fx_validator import _FxValidator

        from lightning_3d.monitoring.callbacks import writes_logs_now

        trainer = getattr(model, "_trainer", None)
        fx = getattr(model, "_current_fx_name", None)
        if trainer is None or fx is None:
            return  # not inside a Trainer's hook: nowhere to log
        values = (self.skipped_steps, float(self.scaler.scale) if self.scaler is not None else None)
        shown = getattr(getattr(trainer, "_logger_connector", None), "_callback_metrics", {})  # (emptied at each fit's start)
        if values == self._logged and "skipped_steps" in shown and not writes_logs_now(trainer):
            return
        try:
            _FxValidator.check_logging_levels(fx, on_step=True, on_epoch=False)
        except Exception:  # noqa: BLE001 - a hook (e.g. on_train_epoch_end) where per-step logging is not allowed
            return
        self._logged = values
        # CPU tensors: logging them (and the progress bar reading them) never waits for the device
        model.log("skipped_steps", torch.tensor(float(values[0])), prog_bar=True, on_step=True, on_epoch=False, batch_size=1)
        if values[1] is not None:
            model.log("loss_scale", torch.tensor(values[1]), on_step=True, on_epoch=False, batch_size=1)

    def _device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.device_type == "cuda" else torch.device("cpu")

    def _local_grads(self, optimizer: Any) -> list[Tensor]:
        """This rank's gradients: a ZeRO optimizer's reduced slices, or the parameters' (local shards')."""
        raw = _raw(optimizer)
        if hasattr(raw, "_grad_slices"):
            return [grad for _, grad in raw._grad_slices()]
        return [_local(p.grad) for p in {id(p): p for p in _params(raw) if p.grad is not None}.values()]

    def _grads_nonfinite(self, optimizer: Any, device: torch.device) -> Tensor:
        """This rank's "some gradient is inf or NaN" flag: what a ZeRO-2 offload optimizer saw on the
        device as its slices went to the host (no pass over host memory), else a look at the slices."""
        raw = _raw(optimizer)
        seen = raw.offloaded_nonfinite() if hasattr(raw, "offloaded_nonfinite") else None
        if seen is not None:
            return seen.to(device)
        return any_nonfinite(self._local_grads(optimizer), device)

    def _agree(self, local: Tensor, optimizer: Any = None) -> bool:
        """MAX all-reduce of a 0/1 flag over the whole world: one small collective and one host sync.
        A ZeRO optimizer whose data-parallel group is the world has its used-parameter vote ride along
        (``world_vote_flags``), which saves it a collective and a host sync of its own."""
        if not (dist.is_available() and dist.is_initialized()):
            return bool(local.item())
        raw = _raw(optimizer) if optimizer is not None else None
        used = raw.world_vote_flags() if hasattr(raw, "world_vote_flags") else None
        if used is None:
            dist.all_reduce(local, op=dist.ReduceOp.MAX)
            return bool(local.item())
        votes = torch.cat([local.reshape(1).to(used.dtype), used.to(local.device)])
        dist.all_reduce(votes, op=dist.ReduceOp.MAX)
        values = votes.tolist()
        raw.take_world_vote(values[1:])
        return values[0] > 0

    def _found_nonfinite(self, optimizer: Any, loss: Any) -> bool:
        """A non-finite loss or gradient on any rank. Reuses the global norm if clipping computed one
        this step (one all-reduce); only when that says "non-finite" -- which a finite gradient above
        ~1e19 can make the sum of squares say -- are the gradients themselves looked at. Otherwise one
        fused max-abs over the local gradients."""
        device = self._device()
        lost = (~torch.isfinite(loss.detach())).any().float().to(device) if isinstance(loss, Tensor) else None
        norm = self._clip_norm.get(id(_raw(optimizer)))
        if norm is not None:
            flag = (~torch.isfinite(norm.detach())).float().to(device)
            if not self._agree(flag if lost is None else torch.maximum(flag, lost), optimizer):
                return False  # the common case: finite, decided by the norm every rank already shares
        flag = self._grads_nonfinite(optimizer, device)
        return self._agree(flag if lost is None else torch.maximum(flag, lost), optimizer)

    def _unscale_once(self, optimizer: Any) -> None:
        """Unscale an optimizer's gradients once per step, whoever asks first: the step, or clipping
        that manual optimization calls before ``opt.step()`` (clipping scaled gradients would clip by
        the loss scale too)."""
        if self.scaler is not None and id(_raw(optimizer)) not in self._unscaled:
            self.unscale_(optimizer, 1.0 / self.scaler.scale)
            self._unscaled.add(id(_raw(optimizer)))

    def _step_done(self, optimizer: Any) -> None:
        """The step (or its skip) consumed this optimizer's once-per-step marks and its clip norm."""
        key = id(_raw(optimizer))
        self._unscaled.discard(key)
        self._summed.discard(key)
        self._clip_norm.pop(key, None)

    def _wrap_closure(self, model: Any, optimizer: Any, closure: Callable[[], Any]) -> Any:
        """Lightning's closure wrapper (for optimizers that call their closure themselves), with the tp
        sum of partial gradients between the backward and the clipping."""
        closure_result = closure()
        self._sum_partials_once(optimizer)
        self._after_closure(model, optimizer)
        return closure_result

    def _sum_partials_once(self, optimizer: Any) -> None:
        """ZeRO-3: the gradients of replicated parameters that see partial inputs, summed over tp
        (FSDP2 dropped their hooks), once per step, whoever asks first: the step, or clipping that
        manual optimization calls before ``opt.step()`` (a norm over partial gradients is another norm)."""
        if id(_raw(optimizer)) not in self._summed:
            sum_partial_gradients([p for g in _raw(optimizer).param_groups for p in g["params"]], self._device())
            self._summed.add(id(_raw(optimizer)))

    def clip_gradients(self, optimizer: Any, clip_val: float = 0.0, gradient_clip_algorithm: Any = "norm") -> None:
        if clip_val > 0:
            self._sum_partials_once(optimizer)
            self._unscale_once(optimizer)
        super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    def found_overflow(self, optimizer: Any) -> bool:
        """A non-finite gradient on any rank (a MAX all-reduce over the world, so all agree)."""
        return self._agree(self._grads_nonfinite(optimizer, self._device()), optimizer)

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
            self._clip_norm[id(_raw(optimizer))] = norm
            optimizer.scale_grads_((clip_val / (norm + 1e-6)).clamp(max=1.0))
            return
        params = _params(optimizer)
        norm = global_grad_norm(params, self.topology, device=self._device())
        self._clip_norm[id(_raw(optimizer))] = norm
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
        else:
            state["skipped_steps"] = self._skipped
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and "loss_scaler" in state_dict:
            self.scaler.load_state_dict(state_dict["loss_scaler"])
        if self.scaler is None:
            self._skipped = int(state_dict.get("skipped_steps", 0))


def _drives_its_closure(optimizer: Any) -> bool:
    """Optimizers that may call their closure themselves (LBFGS, line searches, SAM-style two-pass
    steps) keep Lightning's ``optimizer.step(closure)``: the plugin cannot run the closure for them.
    Known closure-free ones (torch.optim, ZeRO) get the non-finite check before their step."""
    from lightning_3d.zero.sharded_optimizer import ZeroOptimizer

    if isinstance(optimizer, ZeroOptimizer):
        return False
    return isinstance(optimizer, torch.optim.LBFGS) or not type(optimizer).__module__.startswith("torch.optim")


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
    raise unsupported_precision(getattr(plugin, "precision", type(plugin).__name__))


def unsupported_precision(name: Any) -> ValueError:
    modes = list(MODES)
    return ValueError(
        f"precision={name!r} is not supported by ThreeDParallelStrategy; use "
        f"{', '.join(repr(p) for p in modes[:-1])} or {modes[-1]!r}."
    )
