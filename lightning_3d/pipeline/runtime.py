"""Execute a pipeline schedule inside the model's forward, the way Lightning expects a forward.

:func:`pipeline_model` prunes a model to this rank's pieces and replaces its ``forward`` (on the
instance: names, state-dict keys and the LightningModule's step code stay the same). A training
forward runs the whole schedule -- forward *and* backward of every micro-batch, with P2P sends
and receives on the pipeline group -- and returns the batch loss (visible on every pipeline
rank). Lightning then zeroes gradients and calls ``loss.backward()``: the schedule's gradients
were set aside, and that backward hands them to the parameters through autograd, so gradient
hooks (data-parallel/ZeRO reduction, sequence-parallel sums) run exactly once, and Lightning's
loss normalization and fp16 scale apply as usual. Evaluation runs forward-only.

Point-to-point traffic follows the schedule's communication plan (``schedules.communication_plan``):
``batch_isend_irecv`` batches matched round by round on both ends, checked under NCCL semantics
before the first message (docs/pipeline.md, "NCCL semantics"); no tags.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_3d.core.distributed import current_compute_device
from lightning_3d.core.forward_wrappers import wrap_forward, wrapper
from lightning_3d.core.param_meta import meta_of, update_meta
from lightning_3d.core.topology import Topology
from lightning_3d.pipeline.partition import Method, describe, partition
from lightning_3d.pipeline.plan import Action, Post, Step, Wait, headers_of, message_of, peer_of, piece_of, place
from lightning_3d.pipeline.schedules import V_SHAPED, Costs, build_plan
from lightning_3d.pipeline.sequences import HeadOutput, Inputs, LayerSequence
from lightning_3d.pipeline.weight_gradients import DeferredWeightGradients
from lightning_3d.tensor_parallel.plans import shared_parameters
from lightning_3d.tensor_parallel.random import PIPELINE_STAGE_RNG, RNGStatesTracker
from lightning_3d.transforms.loss_normalization import batch_size, data_parallel_factor, data_parallel_factors

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
    new_buffers: int = 0  # receive buffers allocated (the others were reused from earlier micro-batches or steps)
    compute_s: dict[str, float] = field(default_factory=dict)  # seconds per compute kind (F, B, I, W)
    computes: dict[str, int] = field(default_factory=dict)  # how many of each ran

    def count(self, kind: str, seconds: float) -> None:
        self.busy_s += seconds
        self.compute_s[kind] = self.compute_s.get(kind, 0.0) + seconds
        self.computes[kind] = self.computes.get(kind, 0) + 1

    def mean_costs(self) -> dict[str, float]:
        """Mean seconds of one compute of each kind (what :func:`simulate` takes as ``costs``)."""
        return mean_costs([self])

    @property
    def idle_fraction(self) -> float:
        return 1.0 - self.busy_s / self.wall_s if self.wall_s > 0 else 0.0


def mean_costs(steps: Iterable[StepStats]) -> dict[str, float]:
    """Mean seconds of one compute of each kind over several steps (their seconds over their counts)."""
    seconds: dict[str, float] = {}
    counts: dict[str, int] = {}
    for s in steps:
        for kind, sec in s.compute_s.items():
            seconds[kind] = seconds.get(kind, 0.0) + sec
            counts[kind] = counts.get(kind, 0) + s.computes[kind]
    return {k: seconds[k] / n for k, n in counts.items() if n}


@dataclass
class PipelineConfig:
    schedule: str = "1f1b"
    virtual_stages: int = 1
    micro_batches: Optional[int] = None
    partition: Method = "uniform"
    # zb_h1: before this training call (the first is not measured: it allocates), every rank agrees on
    # each stage's measured F, I and W seconds and the order is planned again at those costs; 0: never
    replan_after: int = 3


def default_micro_batches(batch: int, p: int, schedule: str) -> int:
    """The smallest divisor of the batch that is at least the pipeline depth (a multiple of it for the
    interleaved schedule, twice it for the V-shaped ones); the whole batch, one sample each, when none
    exists."""
    depth = 2 * p if schedule in V_SHAPED else p
    for m in range(1, batch + 1):
        if batch % m == 0 and m >= depth and (schedule != "interleaved_1f1b" or m % p == 0):
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
        self.v_shape = config.schedule in V_SHAPED  # pieces r and 2p-1-r on rank r: the last piece on rank 0
        self.grad_sync_blocker, self.loss_scale = grad_sync_blocker, loss_scale
        self.rng_tracker = rng_tracker
        weights = self._layer_weights() if config.partition == "parameters" else ()
        self.ranges = partition(len(sequence.blocks), self.pieces, config.partition, weights)
        self.layout = describe(self.ranges, self.p)
        self.tied: list[Tensor] = []
        self.tied_groups: list[list[str]] = []  # dense-model names of weights tied across first and last stage
        self._prune()
        self.params = [p for p in {id(p): p for p in model.parameters()}.values() if p.requires_grad]
        self._plans: dict[tuple[int, bool], list[Step]] = {}
        self._described: dict[tuple[tuple, int], tuple[torch.dtype, tuple[int, ...]]] = {}
        self._group_ready = False
        self._spare: dict[tuple[tuple[int, ...], torch.dtype], list[Tensor]] = {}  # receive buffers free for reuse
        self.deferred = DeferredWeightGradients()  # the zero-bubble schedules' weight-gradient halves
        self.costs: Optional[Costs] = None  # zb_h1: each stage's agreed F, I, W seconds, once measured
        self._train_calls = 0
        self._piece_aux: Optional[Tensor] = None  # the auxiliary loss of the last piece forward (MoE layers)
        self._aux_total: Optional[Tensor] = None  # this stage's weighted auxiliary losses of the last run
        self._aux_weights: list[Union[float, Tensor]] = []  # each micro-batch's share of the sequences
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
        return self._last_stage() == self.rank

    def _last_stage(self) -> int:
        """The pipeline rank holding the last piece (the head, the loss)."""
        return place(self.p, self.pieces - 1, self.v_shape)[0]

    def _set(self, path: str, module: nn.Module) -> None:
        parent, _, child = path.rpartition(".")
        setattr(self.model.get_submodule(parent) if parent else self.model, child, module)

    def _prune(self) -> None:
        """Keep only this rank's layers; remember weights tied across the first and last stage."""
        ties = shared_parameters(self.model)
        chunks = range(self.config.virtual_stages)
        owned = {i for c in chunks for i in range(*self.ranges[piece_of(self.p, self.rank, c, self.v_shape)])}
        for i in range(len(self.sequence.blocks)):
            if i not in owned:
                self.sequence.blocks[i] = PipelineStub()
        for paths, keep in ((self.sequence.embed_modules, self.owns_first), (self.sequence.head_modules, self.owns_last)):
            if not keep:
                for path in paths:
                    self._set(path, PipelineStub())
        if self._last_stage() == 0:  # the first and last piece on one rank: a tie is one parameter already
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
                    update_meta(param, pipeline_duplicate=True)  # counted once, on the first stage

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

    def _plan(self, m: int, train: bool) -> list[Step]:
        """This rank's communication plan (built and checked once per micro-batch count)."""
        key = (m, train)
        if key not in self._plans:
            costs = self.costs if train else None
            self._plans[key] = build_plan(self.config.schedule, self.p, m, self.config.virtual_stages, not train, costs)[self.rank]
        return self._plans[key]

    def _agree_on_costs(self) -> None:
        """zb_h1 at measured costs (the paper's automatic scheduling): every rank puts its stage's mean
        seconds of F, I and W (training steps after the first) in its row, one all-reduce (max) over the
        whole world gives every rank the same table -- tensor-parallel peers must run one order, and one
        plan everywhere keeps it simple -- and the plans are built again at those costs. Once per run,
        one host read. The sums into each gradient keep their order (see ``_zb_h1_orders``)."""
        measured = mean_costs([s for s in self.history if s.computes.get("W")][1:])  # training steps (evaluation runs no W), not the first
        row = [measured.get(kind, 0.0) for kind in "FIW"]
        table = torch.zeros(self.p, 3, device=self._device())
        table[self.rank] = torch.tensor(row, device=self._device())
        dist.all_reduce(table, op=dist.ReduceOp.MAX)
        costs = tuple(tuple(float(c) for c in r) for r in table.tolist())
        if all(c > 0 for r in costs for c in r):  # (every rank decides alike: they all hold this table)
            self.costs = costs
            self._plans.clear()

    def _weights(self, micro: list[Inputs], train: bool) -> list[Union[float, Tensor]]:
        """Each micro-batch's share of the batch loss: its count of (unmasked) targets over the batch's.
        In training the batch is the global one over data-parallel replicas (see loss_normalization);
        that factor stays on the device. The counts themselves are host ints here: a model that counts
        unmasked targets on the device is read once per micro-batch, before the schedule starts. Auxiliary losses
        (means over sequences) get each micro-batch's share of the sequences (``_aux_weights``)."""
        counts = [int(self.sequence.target_count(mb)) for mb in micro]  # (host ints: the weights are host math)
        total = sum(counts)
        sizes = [batch_size(mb) for mb in micro]
        scale: Union[float, Tensor] = 1.0
        per_sequence: Union[float, Tensor] = 1.0
        if train and self.topology.dp_size > 1:
            if self.sequence.aux_loss is None:
                scale = data_parallel_factor(total, self.topology.dp_group, self._device())
            else:
                scale, per_sequence = data_parallel_factors([total, sum(sizes)], self.topology.dp_group, self._device())
        self._aux_weights = [per_sequence * (s / sum(sizes)) for s in sizes]
        return [scale * (c / total) if total and c else 0.0 for c in counts]

    def _train(self, micro: list[Inputs]) -> Any:
        if self.config.schedule == "zb_h1" and self._train_calls == self.config.replan_after > 0:
            self._agree_on_costs()
        self._train_calls += 1
        saved = {id(p): p.grad for p in self.params}
        for p in self.params:
            p.grad = None
        with ExitStack() as stack:
            stack.enter_context(self.grad_sync_blocker())
            stack.enter_context(self._arrival_hooks_deferred())
            total = self._run(micro, train=True)
        stash = _Stash(self, {id(p): p.grad for p in self.params})
        for p in self.params:
            p.grad = saved[id(p)]
        loss = self._broadcast_scalar(total) if self.sequence.aux_loss is None else self._summed_over_stages(total)
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
        # scaled in place (the stash's tensors are this call's own), without reading the factor on the host
        # once per tensor, should two parameters ever hold one gradient tensor
        unique = {(g.data_ptr(), g.dtype, tuple(g.shape), g.stride()): g for g in grads.values() if g is not None}
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for g in unique.values():
            by_dtype.setdefault(g.dtype, []).append(g)
        for dtype, tensors in by_dtype.items():
            torch._foreach_mul_(tensors, factor.to(dtype))
        out = [grads.get(id(p)) for p in self.params]
        stash.grads = {}
        return out

    @contextmanager
    def _arrival_hooks_deferred(self) -> Any:
        """Gradient hooks that act on each contribution as it arrives (a sequence-parallel sum over tp,
        an expert slice's scale) run once, at the backward that hands the stash over, not also at
        each micro-batch's backward that fills it."""
        hooks = [h for p in self.params for h in (meta_of(p).sequence_parallel_hook, meta_of(p).arrival_scale_hook) if h is not None]
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
        take = self.sequence.aux_loss
        aux: Optional[Tensor] = None
        for i in range(start, end):
            block = self.sequence.blocks[i]
            x = self.sequence.block(block, x, batch)
            found = take(block) if take is not None else None
            if found is not None:
                aux = found if aux is None else aux + found
        self._piece_aux = aux
        return self.sequence.head(x, batch) if piece == self.pieces - 1 else x

    def _run(self, micro: list[Inputs], train: bool) -> Any:
        if not self._group_ready:
            # NCCL: when batch_isend_irecv is the first operation on a group, every rank of the group must
            # take part in that very call; ours pair neighbours. One collective first sets the group up.
            dist.all_reduce(torch.zeros(1, device=self._device()), group=self.topology.pp_group)
            self._group_ready = True
        m = len(micro)
        self._aux_weights = [1.0 / m] * m
        weights = self._weights(micro, train) if _has_targets(micro[0]) else [0.0] * m
        stats = StepStats(micro_batches=m)
        wire = _Wire(self, [_signature(mb, train) for mb in micro], stats if train else None)
        start = time.perf_counter()
        stored: dict[tuple[int, int], tuple[Optional[Tensor], Tensor]] = {}
        held: dict[tuple[int, int], list[Callable[[], None]]] = {}  # I ran, W not yet: the weight gradients it set aside
        losses: list[Tensor] = []
        heads: list[HeadOutput] = []
        aux: dict[tuple[int, int], Tensor] = {}  # a non-last piece's weighted auxiliary loss, until its B
        self._aux_total = None
        scale = self.loss_scale() if train else 1.0
        plan = self._plan(m, train)
        split = any(isinstance(s, Action) and s.kind == "I" for s in plan)
        # every parameter the rank holds, read each step (one frozen at set-up may train later): whose .grad
        # a receive buffer must not be reused under
        parameters = list({id(q): q for q in self.model.parameters()}.values()) if train else []
        with self.deferred.intercepting() if split else nullcontext():
            self._steps(plan, micro, weights, wire, stats, stored, held, losses, heads, scale, train, parameters, aux)
        wire.finish()
        assert not (wire.works or wire.received or wire.outgoing), "the communication plan left messages behind"
        assert not held, "the schedule left weight gradients behind"
        wire.keep_spares()
        stats.wall_s = time.perf_counter() - start
        self.last_step = stats
        self.history.append(stats)
        if not self.owns_last:
            return None
        if losses:
            return torch.stack(losses).sum()
        return torch.cat([h.logits for h in heads], dim=0) if heads and heads[0].logits is not None else None

    def _steps(
        self,
        plan: list[Step],
        micro: list[Inputs],
        weights: list[Union[float, Tensor]],
        wire: "_Wire",
        stats: StepStats,
        stored: dict[tuple[int, int], tuple[Optional[Tensor], Tensor]],
        held: dict[tuple[int, int], list[Callable[[], None]]],
        losses: list[Tensor],
        heads: list[HeadOutput],
        scale: float,
        train: bool,
        parameters: list[Tensor],
        aux: dict[tuple[int, int], Tensor],
    ) -> None:
        """Run this rank's plan: posts, waits, computes, local hand-overs. A piece's auxiliary loss
        (MoE layers) joins its micro-batch's loss with the same weight: in the last piece, added to the
        head's loss; elsewhere, backpropagated together with the received gradient at its B."""
        for step in plan:
            if isinstance(step, Post):
                wire.post(step, stored)
            elif isinstance(step, Wait):
                wire.wait(step.items)
            elif step.kind == "F":
                t0 = time.perf_counter()
                key = (step.micro, step.chunk)
                piece = step.piece(self.p, self.rank)
                x = wire.received.pop(("RECV_ACT", *key), None)
                if x is not None:
                    x.requires_grad_(train)
                out = self._piece_forward(piece, x, micro[step.micro])
                extra = self._piece_aux if train else None
                if extra is not None:  # weighed by the micro-batch's sequences (reported: summed over the stages)
                    extra = extra * self._aux_weights[step.micro]
                    self._aux_total = extra.detach().float() + (self._aux_total if self._aux_total is not None else 0.0)
                if piece == self.pieces - 1:
                    if out.loss is not None:
                        losses.append(_weighted(out.loss.detach().float(), weights[step.micro]))
                    heads.append(out if not train else HeadOutput(logits=out.logits))  # not the loss: its graph waits for W
                    if train:
                        loss = _weighted(out.loss, weights[step.micro])
                        stored[key] = (x, loss if extra is None else loss + extra)
                else:
                    wire.outgoing[("SEND_ACT", *key)] = out.detach()
                    if train:
                        stored[key] = (x, out)
                        if extra is not None:
                            aux[key] = extra
                stats.max_in_flight = max(stats.max_in_flight, len(stored) + len(held))  # alive until B, or W
                stats.count(step.kind, time.perf_counter() - t0)
            elif step.kind in ("B", "I"):
                t0 = time.perf_counter()
                key = (step.micro, step.chunk)
                x, out = stored.pop(key)
                piece = step.piece(self.p, self.rank)
                grad = None if piece == self.pieces - 1 else wire.received.pop(("RECV_GRAD", *key))
                target = out * scale if grad is None else out
                tensors, grads = [target], [grad]
                if key in aux:  # this piece's auxiliary loss, scaled like the head's loss
                    tensors.append(aux.pop(key) * scale)
                    grads.append(None)
                if step.kind == "B":
                    torch.autograd.backward(tensors, grads)
                else:  # the input gradient now (the previous stage waits for it), the linears' weights' at its W
                    with self.deferred.collect([]) as works:
                        torch.autograd.backward(tensors, grads)
                    held[key] = works
                x_grad = x.grad if x is not None else None
                if x is not None:  # a piece that did not use its input still owes its peer a gradient
                    wire.outgoing[("SEND_GRAD", *key)] = x_grad if x_grad is not None else torch.zeros_like(x)
                del x, out, grad, target
                if step.kind == "B":
                    wire.give_back(key, parameters)
                stats.count(step.kind, time.perf_counter() - t0)
            elif step.kind == "W":
                t0 = time.perf_counter()
                self.deferred.run(held.pop((step.micro, step.chunk)))
                wire.give_back((step.micro, step.chunk), parameters)  # (W read the received gradient: buffers go back after it)
                stats.count(step.kind, time.perf_counter() - t0)
            else:
                wire.hand_over(step)

    # -- point to point ----------------------------------------------------------------------------
    def _peer(self, action: Action) -> int:
        """The global rank of the peer a communication action talks to."""
        peer_pp = peer_of(action, self.p, self.rank)[0]
        return self.topology.dims.rank_of(self.topology.coords._replace(pp=peer_pp))

    def _device(self) -> torch.device:
        """The compute device: every tensor handed to torch.distributed is made there (NCCL refuses
        host tensors)."""
        if self.params:
            return self.params[0].device
        for t in (*self.model.parameters(), *self.model.buffers()):
            return t.device
        return current_compute_device()

    def _last_rank(self) -> int:
        return self.topology.dims.rank_of(self.topology.coords._replace(pp=self._last_stage()))

    def _summed_over_stages(self, value: Optional[Tensor]) -> Tensor:
        """The batch loss with every stage's auxiliary losses: the last stage's loss plus each stage's
        weighted auxiliary losses, summed over the pipeline group (every rank gets it)."""
        out = value.reshape(()).float() if value is not None else torch.zeros((), device=self._device())
        if self._aux_total is not None:
            out = out + self._aux_total.to(out.device)
        dist.all_reduce(out, group=self.topology.pp_group)
        return out

    def _broadcast_scalar(self, value: Optional[Tensor]) -> Tensor:
        out = value.reshape(()).float() if value is not None else torch.zeros((), device=self._device())
        dist.broadcast(out, self._last_rank(), self.topology.pp_group)
        return out

    def _broadcast_from_last(self, value: Optional[Tensor]) -> Tensor:
        """The last stage's loss or logits, on every pipeline rank (shape sent first)."""
        src = self._last_rank()
        group = self.topology.pp_group
        device = value.device if value is not None else self._device()
        header = _header(value, device) if value is not None else torch.zeros(_HEADER, dtype=torch.int64, device=device)
        dist.broadcast(header, src, group)
        dtype, shape = _described(header)
        out = value.contiguous() if value is not None else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(out, src, group)
        return out


def _weighted(loss: Tensor, weight: Union[float, Tensor]) -> Tensor:
    """A micro-batch's share of the batch loss. One whose targets are all masked (weight 0.0, known
    on the host from its count) has a NaN mean (0/0): it contributes zero, and zero gradients, as it
    does to the batch mean."""
    if isinstance(weight, float) and weight == 0:
        return loss.nan_to_num(0.0) * 0.0
    return loss * weight  # (a device weight is a 0-dim fp32 tensor: a bf16 loss is promoted, not the weight rounded)


def _has_targets(batch: Inputs) -> bool:
    return any(batch.get(k) is not None for k in ("targets", "labels"))


def _signature(batch: Inputs, train: bool) -> tuple:
    """What determines activation shapes and dtypes: the inputs' shapes, train/eval, autocast."""
    shapes = tuple((k, tuple(v.shape)) for k, v in sorted(batch.items()) if isinstance(v, Tensor))
    return (shapes, train, torch.is_autocast_enabled())


def _header(t: Tensor, device: torch.device) -> Tensor:
    """dtype code, number of dims, the dims: made on ``device`` (it travels through torch.distributed)."""
    if t.dim() > _HEADER - 2:
        raise ValueError(f"pipeline activations may have at most {_HEADER - 2} dimensions, got {t.dim()}.")
    values = [_DTYPES.index(t.dtype), t.dim(), *t.shape]
    return torch.tensor(values + [0] * (_HEADER - len(values)), dtype=torch.int64, device=device)


def _described(header: Tensor) -> tuple[torch.dtype, tuple[int, ...]]:
    """A received header's dtype and shape (reading it on the host syncs with the device: once per new shape)."""
    values = header.tolist()
    return _DTYPES[values[0]], tuple(values[2 : 2 + values[1]])


class _Wire:
    """One step's point-to-point traffic: posts a plan's batches, keeps their works and buffers until
    waited, hands received tensors to the computes.

    Activation shapes are described by a header the first time a receiving piece sees the micro-batch's
    input shapes (which every pipeline rank knows, so both ends agree without a message); headers of a
    batch go first, in a batch of their own, waited at once on the receiving side (see
    ``schedules.headers_of``)."""

    def __init__(self, runtime: PipelineRuntime, signatures: list[tuple], stats: Optional[StepStats] = None) -> None:
        self.runtime, self.signatures = runtime, signatures
        # training: receive buffers come from (and go back to) the runtime's spares; ``lent`` holds, per
        # (micro, chunk), those still in use: the input until its piece's backward (B, or W after I),
        # the gradient until then too
        self.stats = stats
        self.lent: dict[tuple[int, int], list[Tensor]] = {}
        self.shapes_used: set[tuple[tuple[int, ...], torch.dtype]] = set()
        self.group = runtime.topology.pp_group
        self.device = runtime._device()
        self.outgoing: dict[tuple[str, int, int], Tensor] = {}  # (SEND_*, micro, chunk) -> what the compute produced
        self.received: dict[tuple[str, int, int], Tensor] = {}  # (RECV_*, micro, chunk) -> buffer
        self.works: dict[int, tuple[list[Any], list[Tensor], list[bool]]] = {}  # posted item -> (works, tensors in flight, sends)
        # sends whose item's receives were waited, still in flight (a backend with one work per operation:
        # gloo); waited at the end of the step. Under NCCL a batch is one work and completes as one.
        self.trailing: list[tuple[Any, Tensor]] = []
        self.arriving: dict[int, list[tuple[tuple[str, int, int], Tensor]]] = {}  # posted item -> its receives
        self.posted = 0

    def _key(self, action: Action) -> tuple[tuple, int]:
        """What decides an activation's shape: the micro-batch's signature and the receiving piece."""
        return self.signatures[action.micro], message_of(action, self.runtime.p, self.runtime.rank)[2]

    def post(self, step: Post, stored: dict[tuple[int, int], tuple[Optional[Tensor], Tensor]]) -> None:
        described = self.runtime._described
        receives, sends = headers_of(step, lambda a: self._key(a) not in described)
        works: list[Any] = []
        tensors: list[Tensor] = []
        sent: list[bool] = []  # per work, when the backend returns one per operation: a send?
        if receives or sends:
            ops, incoming = [], []
            for a in step.ops:
                if a in sends:
                    t = self.outgoing[(a.kind, a.micro, a.chunk)]
                    header = _header(t, self.device)
                    described[self._key(a)] = (t.dtype, tuple(t.shape))
                    ops.append(dist.P2POp(dist.isend, header, self.runtime._peer(a), self.group))
                    tensors.append(header)
                elif a in receives:
                    header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
                    ops.append(dist.P2POp(dist.irecv, header, self.runtime._peer(a), self.group))
                    incoming.append((a, header))
            header_works = dist.batch_isend_irecv(ops)
            if incoming:
                for w in header_works:
                    w.wait()
                for a, header in incoming:
                    described[self._key(a)] = _described(header)
            else:
                works += header_works
                sent += [True] * len(header_works)
        ops, arriving = [], []
        for a in step.ops:
            peer = self.runtime._peer(a)
            if a.kind.startswith("SEND"):
                t = self.outgoing.pop((a.kind, a.micro, a.chunk)).contiguous()
                announced = described[self._key(a)] if a.kind == "SEND_ACT" else None
                if announced is not None and announced != (t.dtype, tuple(t.shape)):
                    raise RuntimeError(
                        f"pipeline stage {self.runtime.rank}: micro-batch {a.micro}'s activation is "
                        f"{t.dtype}{list(t.shape)}, but an earlier one with the same input shapes was "
                        f"{announced[0]}{list(announced[1])} and the next stage expects that "
                        f"again. A stage's output shape and dtype may depend only on the input shapes, train/eval and "
                        f"autocast."
                    )
                ops.append(dist.P2POp(dist.isend, t, peer, self.group))
            else:
                if a.kind == "RECV_ACT":
                    dtype, shape = described[self._key(a)]
                else:  # a gradient has the shape of the activation it belongs to
                    like = stored[(a.micro, a.chunk)][1]
                    dtype, shape = like.dtype, tuple(like.shape)
                t = self._buffer(tuple(shape), dtype, (a.micro, a.chunk))
                ops.append(dist.P2POp(dist.irecv, t, peer, self.group))
                arriving.append(((a.kind, a.micro, a.chunk), t))
            tensors.append(t)
        if not step.batched:
            (op,) = ops
            works.append(op.op(op.tensor, op.peer, op.group))
        else:
            works += dist.batch_isend_irecv(ops)
        sent += [op.op is dist.isend for op in ops]
        self.works[self.posted] = (works, tensors, sent if len(sent) == len(works) == len(tensors) else [])
        self.arriving[self.posted] = arriving
        self.posted += 1

    def _buffer(self, shape: tuple[int, ...], dtype: torch.dtype, owner: tuple[int, int]) -> Tensor:
        """A receive buffer: in training a spare one of this shape when there is one (no allocation
        in the step once the shapes are known), else a new one."""
        if self.stats is None:
            return torch.empty(shape, dtype=dtype, device=self.device)
        self.shapes_used.add((shape, dtype))
        spare = self.runtime._spare.get((shape, dtype))
        if spare:
            t = spare.pop()
            t.grad = None
            t.requires_grad_(False)
        else:
            t = torch.empty(shape, dtype=dtype, device=self.device)
            self.stats.new_buffers += 1
        self.lent.setdefault(owner, []).append(t)
        return t

    def give_back(self, owner: tuple[int, int], parameters: Iterable[Tensor] = ()) -> None:
        """The micro-batch's piece finished its backward (B, or W after I: a deferred weight gradient
        reads the received gradient): its receive buffers are spares again, unless one shares memory
        with a tensor still to be sent (a gradient autograd handed through unchanged) or with one of
        ``parameters``' ``.grad`` (autograd keeps a view of the incoming gradient as the gradient of a
        parameter that reaches the output through views alone, e.g. ``x + w.view(...)``)."""
        lent = self.lent.pop(owner, ())
        if not lent:  # (nothing received for it: the first piece, evaluation) -- no scan on the hot path
            return
        sending = {q.grad.untyped_storage().data_ptr() for q in parameters if q.grad is not None}
        sending |= {t.untyped_storage().data_ptr() for t in self.outgoing.values()}
        sending |= {t.untyped_storage().data_ptr() for _, tensors, _ in self.works.values() for t in tensors}
        sending |= {t.untyped_storage().data_ptr() for _, t in self.trailing}
        for t in lent:
            if t.untyped_storage().data_ptr() not in sending:
                self.runtime._spare.setdefault((tuple(t.shape), t.dtype), []).append(t)

    def keep_spares(self) -> None:
        """End of a training step: keep spares only of the shapes this step received (a changed batch
        shape does not pin the old buffers)."""
        if self.stats is not None:
            self.runtime._spare = {k: v for k, v in self.runtime._spare.items() if k in self.shapes_used}

    def wait(self, items: tuple[int, ...]) -> None:
        """Wait for posted items; their receives are then complete and go to the computes."""
        for i in items:
            works, tensors, sent = self.works.pop(i)  # (the tensors in flight are released with it)
            for j, w in enumerate(works):
                if sent and sent[j]:  # its own work: no need to hold the host until the peer took it
                    self.trailing.append((w, tensors[j]))
                else:
                    w.wait()
            self.received.update(self.arriving.pop(i))

    def finish(self) -> None:
        """End of the step: the sends left in flight are complete (their buffers are free again)."""
        for w, _ in self.trailing:
            w.wait()
        self.trailing.clear()

    def hand_over(self, action: Action) -> None:
        """A message to this very rank (one pipeline rank with virtual stages): no wire."""
        if action.kind.startswith("SEND"):
            _, peer_chunk = peer_of(action, self.runtime.p, self.runtime.rank)
            kind = action.kind.replace("SEND", "RECV")
            self.received[(kind, action.micro, peer_chunk)] = self.outgoing.pop((action.kind, action.micro, action.chunk))


PIPELINE = "pipeline"  # the forward wrapper of a pipelined model


def pipeline_model(model: nn.Module, sequence: LayerSequence, topology: Topology, config: PipelineConfig, **kwargs: Any) -> PipelineRuntime:
    """Prune ``model`` to this rank's pieces and make its forward run the pipeline (idempotent)."""
    existing = pipeline_runtime_of(model)
    if existing is not None:
        return existing
    runtime = PipelineRuntime(model, sequence, topology, config, **kwargs)
    wrap_forward(model, PIPELINE, lambda _: runtime, state=runtime)  # the runtime runs the stage's pieces itself
    return runtime


def pipeline_runtime_of(model: nn.Module) -> Optional["PipelineRuntime"]:
    """The runtime that runs ``model``'s forward as this rank's pipeline stage (None: not pipelined)."""
    found = wrapper(model, PIPELINE)
    return found.state if found is not None else None
