"""Execute a pipeline schedule inside the model's forward, the way Lightning expects a forward.

:func:`pipeline_model` prunes a model to this rank's pieces and replaces its ``forward`` (on the
instance: names, state-dict keys and the LightningModule's step code stay the same). A training
forward runs the whole schedule -- forward *and* backward of every micro-batch, with P2P sends
and receives on the pipeline group -- and returns the batch loss (visible on every pipeline
rank). Lightning then zeroes gradients and calls ``loss.backward()``: the schedule's gradients
were set aside, and that backward hands them to the parameters through autograd, so gradient
hooks (data-parallel/ZeRO reduction, sequence-parallel sums) run exactly once, and Lightning's
loss normalization and fp16 scale apply as usual. Evaluation runs forward-only.
"""

from __future__ import annotations

import time
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_3d.loss_normalization import data_parallel_factor
from lightning_3d.pipeline.partition import Method, describe, partition
from lightning_3d.pipeline.schedules import Action, build_schedule, peer_of
from lightning_3d.pipeline.sequences import HeadOutput, Inputs, LayerSequence
from lightning_3d.tensor_parallel.plans import shared_parameters
from lightning_3d.tensor_parallel.random import PIPELINE_STAGE_RNG, RNGStatesTracker
from lightning_3d.topology import Topology

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
_HEADER = 8  # dtype code, ndim, up to 6 dims


class PipelineStub(nn.Module):
    """Stands in for a layer another pipeline stage holds."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("this layer lives on another pipeline stage")


@dataclass
class StepStats:
    wall_s: float = 0.0
    busy_s: float = 0.0
    max_in_flight: int = 0
    micro_batches: int = 0

    @property
    def idle_fraction(self) -> float:
        return 1.0 - self.busy_s / self.wall_s if self.wall_s > 0 else 0.0


@dataclass
class PipelineConfig:
    schedule: str = "1f1b"
    virtual_stages: int = 1
    micro_batches: Optional[int] = None
    partition: Method = "uniform"


def default_micro_batches(batch: int, p: int, schedule: str) -> int:
    """The smallest divisor of the batch that is at least the pipeline depth (a multiple of it for the
    interleaved schedule); the whole batch, one sample each, when none exists."""
    for m in range(1, batch + 1):
        if batch % m == 0 and m >= p and (schedule != "interleaved_1f1b" or m % p == 0):
            return m
    return batch


@dataclass
class _Stash:
    """The gradients one training forward call produced, until its loss's backward hands them over
    (each call has its own: a step may run the pipeline twice before calling backward)."""

    runtime: "PipelineRuntime"
    grads: dict[int, Optional[Tensor]]


class _DeferredGradients(torch.autograd.Function):
    """forward: the batch loss; backward: this call's gradients from the schedule, scaled by the
    incoming gradient (Lightning's accumulation normalization, the fp16 loss scale)."""

    @staticmethod
    def forward(ctx: Any, loss: Tensor, stash: _Stash, *params: Tensor) -> Tensor:
        ctx.stash = stash
        return loss.detach().clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        stash = ctx.stash
        return (None, None, *stash.runtime.release_gradients(grad, stash))


class PipelineRuntime:
    def __init__(
        self,
        model: nn.Module,
        sequence: LayerSequence,
        topology: Topology,
        config: PipelineConfig,
        grad_sync_blocker: Callable[[], ContextManager[Any]] = nullcontext,
        loss_scale: Callable[[], float] = lambda: 1.0,
        rng_tracker: Optional[RNGStatesTracker] = None,
    ) -> None:
        self.model, self.sequence, self.topology, self.config = model, sequence, topology, config
        self.p, self.rank = topology.dims.pp, topology.pp_rank
        self.pieces = self.p * config.virtual_stages
        self.grad_sync_blocker, self.loss_scale = grad_sync_blocker, loss_scale
        self.rng_tracker = rng_tracker
        weights = self._layer_weights() if config.partition == "parameters" else ()
        self.ranges = partition(len(sequence.blocks), self.pieces, config.partition, weights)
        self.layout = describe(self.ranges, self.p)
        self.tied: list[Tensor] = []
        self.tied_groups: list[list[str]] = []  # dense-model names of weights tied across first and last stage
        self._prune()
        self.params = [p for p in {id(p): p for p in model.parameters()}.values() if p.requires_grad]
        self._schedules: dict[tuple[int, bool], list[Action]] = {}
        self._described: dict[tuple[tuple, int], tuple[torch.dtype, tuple[int, ...]]] = {}
        self.last_step = StepStats()
        self.history: list[StepStats] = []

    # -- set-up -------------------------------------------------------------------------------
    def _layer_weights(self) -> list[float]:
        def count(names: tuple[str, ...]) -> float:
            return float(sum(p.numel() for n in names for p in self.model.get_submodule(n).parameters()))

        blocks = [float(sum(p.numel() for p in b.parameters())) for b in self.sequence.blocks]
        return [count(self.sequence.embed_modules), *blocks, count(self.sequence.head_modules)]

    @property
    def owns_first(self) -> bool:
        return self.rank == 0

    @property
    def owns_last(self) -> bool:
        return (self.pieces - 1) % self.p == self.rank

    def _set(self, path: str, module: nn.Module) -> None:
        parent, _, child = path.rpartition(".")
        setattr(self.model.get_submodule(parent) if parent else self.model, child, module)

    def _prune(self) -> None:
        """Keep only this rank's layers; remember weights tied across the first and last stage."""
        ties = shared_parameters(self.model)
        owned = {i for k in range(self.rank, self.pieces, self.p) for i in range(*self.ranges[k])}
        for i in range(len(self.sequence.blocks)):
            if i not in owned:
                self.sequence.blocks[i] = PipelineStub()
        for paths, keep in ((self.sequence.embed_modules, self.owns_first), (self.sequence.head_modules, self.owns_last)):
            if not keep:
                for path in paths:
                    self._set(path, PipelineStub())
        if self.p == 1:
            return
        embed = set(self.sequence.embed_modules)
        head = set(self.sequence.head_modules)
        spanning = [g for g in ties if {m for m, _ in g} & embed and {m for m, _ in g} & head]
        self.tied_groups = [[f"{m}.{a}" for m, a in g] for g in spanning]
        if spanning:
            self.topology.embedding_group()  # collective: every rank creates the groups together
        for group in spanning:
            if self.owns_first or self.owns_last:
                kept = [getattr(self.model.get_submodule(m), a) for m, a in group if not isinstance(self.model.get_submodule(m), PipelineStub)]
                param = kept[0]
                self.tied.append(param)
                if not self.owns_first:
                    param.pipeline_duplicate = True  # type: ignore[attr-defined]  (counted once, on the first stage)

    def broadcast_tied(self) -> None:
        """The last stage's copy of a tied weight starts as the first stage's: they are one weight."""
        if not self.tied:
            return
        group = self.topology.embedding_group()
        for p in self.tied:
            dist.broadcast(p.data, self.topology.first_stage_rank(), group)

    # -- one forward call ---------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        batch = self.sequence.inputs(args, kwargs)
        size = next(v.shape[0] for v in batch.values() if isinstance(v, Tensor))
        m = self._micro_batches(size)
        micro = [{k: (v.tensor_split(m)[i] if isinstance(v, Tensor) and v.dim() and v.shape[0] == size else v) for k, v in batch.items()} for i in range(m)]
        train = torch.is_grad_enabled() and self.model.training
        if train:
            return self._train(micro)
        loss, logits = self._evaluate(micro)
        return self.sequence.output(loss, logits)

    def _micro_batches(self, size: int) -> int:
        m = self.config.micro_batches or default_micro_batches(size, self.p, self.config.schedule)
        if size < m:  # a ragged last batch smaller than the micro-batch count (every schedule takes any m)
            m = default_micro_batches(size, self.p, self.config.schedule)
        return m

    def _schedule(self, m: int, train: bool) -> list[Action]:
        key = (m, train)
        if key not in self._schedules:
            self._schedules[key] = build_schedule(
                self.config.schedule, self.p, m, self.config.virtual_stages, forward_only=not train
            )[self.rank]
        return self._schedules[key]

    def _weights(self, micro: list[Inputs], train: bool) -> list[float]:
        """Each micro-batch's share of the batch loss: its count of (unmasked) targets over the batch's.
        In training the batch is the global one over data-parallel replicas (see loss_normalization)."""
        counts = [self.sequence.target_count(mb) for mb in micro]
        total = sum(counts)
        scale = 1.0
        if train and self.topology.dp_size > 1:
            scale = float(data_parallel_factor(total, self.topology.dp_group, self._device()))
        return [c * scale / total if total else 0.0 for c in counts]

    def _train(self, micro: list[Inputs]) -> Any:
        saved = {id(p): p.grad for p in self.params}
        for p in self.params:
            p.grad = None
        with ExitStack() as stack:
            stack.enter_context(self.grad_sync_blocker())
            stack.enter_context(self._sequence_parallel_sums_deferred())
            total = self._run(micro, train=True)
        stash = _Stash(self, {id(p): p.grad for p in self.params})
        for p in self.params:
            p.grad = saved[id(p)]
        loss = self._broadcast_scalar(total)
        return self.sequence.output(_DeferredGradients.apply(loss, stash, *self.params), None)

    @torch.no_grad()
    def _evaluate(self, micro: list[Inputs]) -> tuple[Optional[Tensor], Optional[Tensor]]:
        outputs = self._run(micro, train=False)
        if _has_targets(micro[0]):
            return self._broadcast_scalar(outputs), None
        return None, self._broadcast_from_last(outputs)

    def release_gradients(self, grad: Tensor, stash: _Stash) -> list[Optional[Tensor]]:
        """Called by ``loss.backward()``: the call's gradients, scaled; tied weights summed over
        the stages that hold them so both copies stay identical."""
        factor = grad / self.loss_scale()
        grads = stash.grads
        if self.tied:
            group = self.topology.embedding_group()
            for p in self.tied:
                g = grads.get(id(p))
                g = torch.zeros_like(p) if g is None else g
                dist.all_reduce(g, group=group)
                grads[id(p)] = g
        unit = bool(factor == 1)
        out = []
        for p in self.params:
            g = grads.get(id(p))
            out.append(g if g is None or unit else g * factor.to(g.dtype))
        stash.grads = {}
        return out

    @contextmanager
    def _sequence_parallel_sums_deferred(self) -> Any:
        hooks = [h for h in (getattr(p, "sequence_parallel_hook", None) for p in self.params) if h is not None]
        for h in hooks:
            h.enabled = False
        try:
            yield
        finally:
            for h in hooks:
                h.enabled = True

    # -- the schedule ------------------------------------------------------------------------------
    def _piece_forward(self, piece: int, x: Optional[Tensor], batch: Inputs) -> Any:
        """One piece's forward, drawing dropout from this stage's own random stream."""
        tracker = self.rng_tracker
        with tracker.fork(PIPELINE_STAGE_RNG) if tracker is not None and tracker.has(PIPELINE_STAGE_RNG) else nullcontext():
            return self._piece_layers(piece, x, batch)

    def _piece_layers(self, piece: int, x: Optional[Tensor], batch: Inputs) -> Any:
        if piece == 0:
            x = self.sequence.embed(batch)
        start, end = self.ranges[piece]
        for i in range(start, end):
            x = self.sequence.block(self.sequence.blocks[i], x, batch)
        return self.sequence.head(x, batch) if piece == self.pieces - 1 else x

    def _run(self, micro: list[Inputs], train: bool) -> Any:
        m = len(micro)
        weights = self._weights(micro, train) if _has_targets(micro[0]) else [0.0] * m
        signatures = [_signature(mb, train) for mb in micro]
        stats = StepStats(micro_batches=m)
        start = time.perf_counter()
        inbox: dict[tuple[int, int], Tensor] = {}
        outbox: dict[tuple[int, int], Tensor] = {}
        grads_in: dict[tuple[int, int], Tensor] = {}
        grads_out: dict[tuple[int, int], Tensor] = {}
        stored: dict[tuple[int, int], tuple[Optional[Tensor], Tensor]] = {}
        sends: list[Any] = []
        losses: list[Tensor] = []
        heads: list[HeadOutput] = []
        scale = self.loss_scale() if train else 1.0
        for action in self._schedule(m, train):
            key = (action.micro, action.chunk)
            piece = action.piece(self.p, self.rank)
            if action.kind == "RECV_ACT":
                inbox[key] = self._recv_activation(action, signatures[action.micro], requires_grad=train)
            elif action.kind == "SEND_ACT":
                sends += self._send(action, outbox.pop(key).detach(), signature=signatures[action.micro])
            elif action.kind == "RECV_GRAD":
                grads_in[key] = self._recv_like(action, stored[key][1])
            elif action.kind == "SEND_GRAD":
                sends += self._send(action, grads_out.pop(key))
            elif action.kind == "F":
                t0 = time.perf_counter()
                x = inbox.pop(key, None)
                out = self._piece_forward(piece, x, micro[action.micro])
                if piece == self.pieces - 1:
                    if out.loss is not None:
                        losses.append(_weighted(out.loss.detach().float(), weights[action.micro]))
                    heads.append(out)
                    if train:
                        stored[key] = (x, _weighted(out.loss, weights[action.micro]))
                else:
                    outbox[key] = out
                    if train:
                        stored[key] = (x, out)
                stats.max_in_flight = max(stats.max_in_flight, len(stored))
                stats.busy_s += time.perf_counter() - t0
            else:  # "B"
                t0 = time.perf_counter()
                x, out = stored.pop(key)
                if piece == self.pieces - 1:
                    torch.autograd.backward(out * scale)
                else:
                    torch.autograd.backward(out, grads_in.pop(key))
                if x is not None:
                    grads_out[key] = x.grad
                stats.busy_s += time.perf_counter() - t0
        for work in sends:
            work.wait()
        stats.wall_s = time.perf_counter() - start
        self.last_step = stats
        self.history.append(stats)
        if not self.owns_last:
            return None
        if losses:
            return torch.stack(losses).sum()
        return torch.cat([h.logits for h in heads], dim=0) if heads and heads[0].logits is not None else None

    # -- point to point ----------------------------------------------------------------------------
    def _route(self, action: Action) -> tuple[int, int]:
        """(peer's global rank, the piece that receives the message) for a communication action."""
        peer_pp, peer_chunk = peer_of(action, self.p, self.rank)
        peer = self.topology.dims.rank_of(self.topology.coords._replace(pp=peer_pp))
        receiver = peer_chunk * self.p + peer_pp if action.kind.startswith("SEND") else action.piece(self.p, self.rank)
        return peer, receiver

    def _tag(self, action: Action, receiver: int, payload: int) -> int:
        """Unique per message, so sends and receives match whatever order the ranks post them in."""
        gradient = int(action.kind.endswith("GRAD"))
        return ((action.micro * self.pieces + receiver) * 2 + gradient) * 2 + payload

    def _send(self, action: Action, tensor: Tensor, signature: Optional[tuple] = None) -> list[Any]:
        """Gradients and already-described activations go alone; a new activation shape is described
        first by a small header. Both ends decide "new" from the micro-batch's input shapes, which
        every pipeline rank sees, so they agree without a message."""
        peer, receiver = self._route(action)
        group = self.topology.pp_group
        tensor = tensor.contiguous()
        ops = []
        if signature is not None and (signature, receiver) not in self._described:
            self._described[(signature, receiver)] = (tensor.dtype, tuple(tensor.shape))
            ops.append(dist.P2POp(dist.isend, _header(tensor), peer, group, tag=self._tag(action, receiver, 0)))
        ops.append(dist.P2POp(dist.isend, tensor, peer, group, tag=self._tag(action, receiver, 1)))
        return dist.batch_isend_irecv(ops)

    def _recv_activation(self, action: Action, signature: tuple, requires_grad: bool) -> Tensor:
        """Activations may change shape between steps (batch size, sequence length, train/eval)."""
        peer, receiver = self._route(action)
        described = self._described.get((signature, receiver))
        if described is None:
            header = torch.empty(_HEADER, dtype=torch.int64)
            dist.recv(header, peer, self.topology.pp_group, tag=self._tag(action, receiver, 0))
            described = (_DTYPES[int(header[0])], tuple(int(d) for d in header[2 : 2 + int(header[1])]))
            self._described[(signature, receiver)] = described
        x = torch.empty(described[1], dtype=described[0], device=self._device())
        dist.recv(x, peer, self.topology.pp_group, tag=self._tag(action, receiver, 1))
        return x.requires_grad_(requires_grad)

    def _recv_like(self, action: Action, like: Tensor) -> Tensor:
        """A gradient has the shape of the activation it belongs to: no header needed."""
        peer, receiver = self._route(action)
        g = torch.empty(like.shape, dtype=like.dtype, device=like.device)
        dist.recv(g, peer, self.topology.pp_group, tag=self._tag(action, receiver, 1))
        return g

    def _device(self) -> torch.device:
        return self.params[0].device if self.params else torch.device("cpu")

    def _last_rank(self) -> int:
        return self.topology.dims.rank_of(self.topology.coords._replace(pp=(self.pieces - 1) % self.p))

    def _broadcast_scalar(self, value: Optional[Tensor]) -> Tensor:
        out = value.reshape(()).float() if value is not None else torch.zeros((), device=self._device())
        dist.broadcast(out, self._last_rank(), self.topology.pp_group)
        return out

    def _broadcast_from_last(self, value: Optional[Tensor]) -> Tensor:
        """The last stage's loss or logits, on every pipeline rank (shape sent first)."""
        src = self._last_rank()
        group = self.topology.pp_group
        header = _header(value) if value is not None else torch.empty(_HEADER, dtype=torch.int64)
        dist.broadcast(header, src, group)
        dtype, shape = _DTYPES[int(header[0])], [int(d) for d in header[2 : 2 + int(header[1])]]
        out = value.contiguous() if value is not None else torch.empty(shape, dtype=dtype, device=self._device())
        dist.broadcast(out, src, group)
        return out


def _weighted(loss: Tensor, weight: float) -> Tensor:
    """A micro-batch's share of the batch loss. One whose targets are all masked (weight 0) has a
    NaN mean (0/0): it contributes zero, and zero gradients, as it does to the batch mean."""
    return loss.nan_to_num(0.0) * 0.0 if weight == 0 else loss * weight


def _has_targets(batch: Inputs) -> bool:
    return any(batch.get(k) is not None for k in ("targets", "labels"))


def _signature(batch: Inputs, train: bool) -> tuple:
    """What determines activation shapes and dtypes: the inputs' shapes, train/eval, autocast."""
    shapes = tuple((k, tuple(v.shape)) for k, v in sorted(batch.items()) if isinstance(v, Tensor))
    return (shapes, train, torch.is_autocast_enabled())


def _header(t: Tensor) -> Tensor:
    if t.dim() > _HEADER - 2:
        raise ValueError(f"pipeline activations may have at most {_HEADER - 2} dimensions, got {t.dim()}.")
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0], header[1] = _DTYPES.index(t.dtype), t.dim()
    header[2 : 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return header


def pipeline_model(model: nn.Module, sequence: LayerSequence, topology: Topology, config: PipelineConfig, **kwargs: Any) -> PipelineRuntime:
    """Prune ``model`` to this rank's pieces and make its forward run the pipeline (idempotent)."""
    existing = getattr(model, "pipeline_runtime", None)
    if existing is not None:
        return existing
    runtime = PipelineRuntime(model, sequence, topology, config, **kwargs)
    model.forward = runtime  # type: ignore[method-assign]
    model.pipeline_runtime = runtime  # type: ignore[assignment]
    return runtime
