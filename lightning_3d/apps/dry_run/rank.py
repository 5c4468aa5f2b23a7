"""One rank of the full world, set up and stepped on the meta device under a fake process group.

The set-up is the strategy's own: :func:`lightning_3d.parallel.setup.setup_parallel` (tensor-parallel plan,
context parallelism, recompute, pipeline split and pruning, precision, replica broadcasts, ZeRO) and
:meth:`ZeroCoordinator.wrap_optimizers` around the LightningModule's ``configure_optimizers``. What
is left out is Lightning's wiring (loops, callbacks, logging).

The step runs one micro-batch through the rank's pieces (the pipeline runtime's own
``_piece_forward``; at pipeline_parallel=1 the model's layer sequence, which its forward runs) and
its backward, counting saved tensors and collectives; then the end of the step as the strategy runs
it: the gradients handed over once (the pipeline's deferred-gradient release, whose hooks reduce the
ZeRO buckets), the global-norm all-reduces when clipping, and the ZeRO optimizer's step, which
creates Adam's state and all-gathers the parameters. Per-micro-batch traffic is then multiplied by
the step's micro-batch count; activations by the schedule's own order (which micro-batches are
alive at once on this rank).

Left out, and why: the per-step scalar all-reduces that read values (the loss normalization's target
count, the pipeline's loss broadcast: a few bytes), and the context-parallel input split (a local
index on data every rank loads): the micro-batch enters the layers already cut to this rank's tokens.
"""

from __future__ import annotations

import math
import time
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import Tensor, nn

from lightning_3d.apps.dry_run.counting import Traffic, count
from lightning_3d.core.config import ParallelConfig
from lightning_3d.core.forward_wrappers import wrapper
from lightning_3d.core.saved_tensors import SavedBytes, storage_bytes
from lightning_3d.core.topology import Coordinates, ParallelDims, Topology, use_topology
from lightning_3d.parallel.setup import ParallelSetup, setup_parallel
from lightning_3d.pipeline.plan import peer_of, piece_of
from lightning_3d.pipeline.runtime import PipelineRuntime, _DeferredGradients, _Stash
from lightning_3d.pipeline.schedules import V_SHAPED, build_schedule
from lightning_3d.plugins.precision import ThreeDPrecision
from lightning_3d.tensor_parallel.random import seeded_tracker
from lightning_3d.transforms.activation_checkpointing import CHECKPOINTED
from lightning_3d.zero.memory_report import memory_report

META = torch.device("meta")


@contextmanager
def fake_world(world_size: int, rank: int) -> Iterator[None]:
    """``rank`` of a ``world_size`` world on torch's fake backend: collectives return at once and move
    nothing, so one process can stand in for any rank of any world."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a dry run needs a process without a process group (it creates a fake one per rank).")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        from lightning_3d.core.topology import destroy_world

        destroy_world()


class _FusedAttention(torch.autograd.Function):
    """What a fused attention kernel (FlashAttention, or torch's memory-efficient one) keeps for
    backward: q, k, v, its output and one fp32 log-sum-exp per (head, query). On the meta device
    SDPA can only pick its math path, which would save the ``s x s`` scores no GPU run keeps; the
    dry run stands this in for the kernel, shapes and saved tensors as the kernel has them."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        # the kernels write (batch, sequence, heads, dim) and return it transposed, so the usual
        # ``out.transpose(1, 2).reshape(b, t, -1)`` before the output projection is a view of it (one
        # storage, which the projection saves too), not a copy
        b, h, t, d = q.shape
        out = q.new_empty((b, t, h, d)).transpose(1, 2)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class _FusedRMSNorm(torch.autograd.Function):
    """What ``F.rms_norm`` keeps on a GPU: its fused kernel (``aten._fused_rms_norm``, which torch
    dispatches to when the weight's dtype is the input's) saves the input and one fp32 reciprocal
    standard deviation per row. On the meta device (and the CPU) torch runs its composite instead,
    which saves an fp32 upcast of the input and the fp32 normalized input (4x the kernel's bytes
    in bf16): the dry run stands the kernel in, as for attention."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Optional[Tensor], dims: int) -> Tensor:
        rstd = torch.empty((*x.shape[: x.dim() - dims], *([1] * dims)), dtype=torch.float32, device=x.device)
        ctx.save_for_backward(x, rstd, weight)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        x, _, weight = ctx.saved_tensors
        return torch.empty_like(x), None if weight is None else torch.empty_like(weight), None


@contextmanager
def fused_attention() -> Iterator[None]:
    """``F.scaled_dot_product_attention`` and ``F.rms_norm`` as their fused GPU kernels' footprints
    (see :class:`_FusedAttention`, :class:`_FusedRMSNorm`)."""
    import torch.nn.functional as F

    original, original_rms = F.scaled_dot_product_attention, F.rms_norm

    def sdpa(q: Tensor, k: Tensor, v: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if not q.is_meta:
            return original(q, k, v, *args, **kwargs)
        return _FusedAttention.apply(q, k, v)

    def rms_norm(x: Tensor, normalized_shape: Any, weight: Optional[Tensor] = None, eps: Optional[float] = None) -> Tensor:
        if not x.is_meta or (weight is not None and weight.dtype != x.dtype):  # (a dtype mismatch: torch's composite)
            return original_rms(x, normalized_shape, weight, eps)
        return _FusedRMSNorm.apply(x, weight, len(tuple(normalized_shape)))

    F.scaled_dot_product_attention, F.rms_norm = sdpa, rms_norm
    try:
        yield
    finally:
        F.scaled_dot_product_attention, F.rms_norm = original, original_rms


@dataclass
class Batch:
    """What one step feeds a rank: micro-batch size, micro-batches per step, tokens per sequence on
    this rank (after context parallelism)."""

    micro_batch: int
    micro_batches: int
    local_seq: int
    hidden: int


@dataclass
class RankResult:
    rank: int
    coords: Coordinates
    pieces: list[int]
    layers: int
    memory: dict[str, float]  # params, grads, master, optimizer_state, buffers (bytes, from the tensors)
    activations: float  # peak saved bytes under the schedule
    activation_per_micro_batch: list[float]  # per local chunk, one micro-batch
    in_flight: float  # the peak in micro-batches (of all this rank's chunks)
    recompute: float  # one layer's full activations, re-run in backward under full recompute
    traffic: dict[str, float]  # bytes per step per group (sent / handed to collectives)
    calls: dict[str, int]
    seconds: float
    formula: dict[str, Any] = field(default_factory=dict)


def build_module(cfg: DictConfig, topology: Topology) -> nn.Module:
    """The recipe's LightningModule, its model built by ``configure_model`` on the meta device, under
    the topology (as the strategy's ``model_sharded_context`` does)."""
    from lightning_3d.apps.recipe import build_model

    with torch.device(META):
        module = build_model(cfg)
        with use_topology(topology):
            configure = getattr(module, "configure_model", None)
            if callable(configure):
                configure()
    return module


def set_up(cfg: DictConfig, config: ParallelConfig, topology: Topology) -> ParallelSetup:
    """The strategy's set-up (:func:`~lightning_3d.parallel.setup.setup_parallel`, as
    ``ThreeDParallelStrategy.setup`` calls it) on the meta device; the module's own
    ``configure_optimizers`` stands in for Lightning's."""
    module = build_module(cfg, topology)
    tracker = seeded_tracker("cpu", topology.tp_rank, topology.pp_rank, int(cfg.get("seed", 1234)))
    precision = ThreeDPrecision(str(cfg.trainer.get("precision", "32-true")))
    holder: dict[str, Any] = {}

    def blocker() -> Any:  # the strategy's block_backward_sync
        zero = holder.get("zero")
        return zero.no_sync() if zero is not None else nullcontext()

    def build_optimizers(done: Any) -> list[Any]:
        parallel = done.module
        hp = getattr(parallel, "hparams", None)
        if hp is not None and "decay_steps" in hp and not hp.decay_steps:  # no Trainer to ask for its total steps
            hp.decay_steps = int(cfg.trainer.get("max_steps") or 1)
        return _optimizers_of(parallel.configure_optimizers())

    done = setup_parallel(
        module, topology, config, precision=precision, device=META, rng_tracker=tracker, training=True,
        grad_sync_blocker=blocker, build_optimizers=build_optimizers,
    )
    holder["zero"] = done.zero
    return done


def _optimizers_of(configured: Any) -> list[Any]:
    """The optimizers in whatever ``configure_optimizers`` returned (Lightning's forms)."""
    if isinstance(configured, torch.optim.Optimizer):
        return [configured]
    if isinstance(configured, dict):
        return [configured["optimizer"]]
    if isinstance(configured, (list, tuple)):
        if configured and isinstance(configured[0], (list, tuple)):
            return list(configured[0])
        return [o["optimizer"] if isinstance(o, dict) else o for o in configured if isinstance(o, (dict, torch.optim.Optimizer))]
    raise ValueError(f"dry run: cannot read the optimizers from configure_optimizers() = {type(configured).__name__}.")


def _sequence(module: nn.Module) -> Any:
    from lightning_3d.models.adapters.registry import find_sequences

    found = find_sequences(module)
    if len(found) != 1:
        raise ValueError(f"dry run: expected one model with a layer sequence, found {len(found)}.")
    return found[0][2]


def _inputs(batch: Batch, vocab_dtype: torch.dtype = torch.long) -> dict[str, Tensor]:
    shape = (batch.micro_batch, batch.local_seq)
    return {"input_ids": torch.empty(shape, dtype=vocab_dtype, device=META), "targets": torch.empty(shape, dtype=vocab_dtype, device=META)}


def _dtype_of(module: nn.Module) -> torch.dtype:
    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def measure_rank(
    cfg: DictConfig, config: ParallelConfig, dims: ParallelDims, rank: int, batch: Batch, group_name: Any, clip: bool
) -> RankResult:
    """Set up and step global ``rank`` of the world ``dims`` describes (inside :func:`fake_world`)."""
    start = time.perf_counter()
    topology = Topology.build(dims, "cpu")
    done = set_up(cfg, config, topology)
    module, zero, pipelines, optimizers = done.module, done.zero, done.pipelines, done.optimizers
    runtime = pipelines[0] if pipelines else None
    params = [p for p in {id(p): p for p in module.parameters()}.values()]
    tracker = SavedBytes(exclude=params)
    micro = Traffic()
    p, v = dims.pp, config.pipeline.virtual_stages
    schedule = config.pipeline.schedule
    if runtime is not None:
        chunks = list(range(v))
        pieces = [piece_of(p, topology.pp_rank, c, schedule in V_SHAPED) for c in chunks]
        layers = sum(runtime.ranges[k][1] - runtime.ranges[k][0] for k in pieces)
    else:
        chunks, pieces = [0], [0]
        layers = len(_sequence(module).blocks)
    hidden_dtype = _dtype_of(module)

    # -- one micro-batch, forward then backward of every chunk, counted ----------------------------------
    per_chunk: list[float] = []
    outputs: list[Optional[Tensor]] = []
    inputs: list[Optional[Tensor]] = []
    with ExitStack() as stack:
        stack.enter_context(count(micro))
        stack.enter_context(fused_attention())
        stack.enter_context(zero.no_sync())  # gradient accumulation: no reduction until the step's end
        if runtime is not None:  # the runtime defers sequence-parallel sums to the step's end too
            stack.enter_context(runtime._arrival_hooks_deferred())
        data = _inputs(batch)
        graph: list[tuple[Tensor, Optional[Tensor]]] = []
        for c, piece in zip(chunks, pieces):
            x = None
            if runtime is not None and piece > 0:
                x = torch.empty(_boundary_shape(batch, dims, config), dtype=hidden_dtype, device=META, requires_grad=True)
            before = tracker.current
            with tracker.hooks():
                if runtime is not None:
                    out = runtime._piece_forward(piece, x, data)
                else:
                    out = _whole_forward(module, data)
            loss = getattr(out, "loss", None)
            target = loss if loss is not None else out
            held = 0 if loss is not None or tracker.holds(target) else storage_bytes([target])  # the runtime keeps it to B
            per_chunk.append(float(tracker.current - before + held))
            inputs.append(x)
            outputs.append(None if loss is not None else target)
            graph.append((target, None if loss is not None else torch.empty_like(target)))
        for target, grad in reversed(graph):
            torch.autograd.backward(target, grad)
        graph.clear()
    recompute = 0.0
    if config.recompute.mode == "full":  # (outside the count: an extra forward of one block)
        with zero.no_sync(), fused_attention():
            recompute = _recompute_bytes(module, runtime, pieces, batch, dims, config, hidden_dtype)

    # -- the end of the step -----------------------------------------------------------------------------
    step = Traffic()
    with count(step):
        if runtime is not None:  # the pipeline hands its gradients over once: reduction hooks fire here
            stash = _Stash(runtime, {id(q): q.grad for q in runtime.params})
            for q in runtime.params:
                q.grad = None
            released = _DeferredGradients.apply(torch.zeros((), device=META), stash, *runtime.params)
            released.backward()
        zero.after_backward()
        before_step = memory_report(module, optimizers, zero, topology)
        if clip:
            for opt in optimizers:
                if hasattr(opt, "grad_norm_squared"):
                    opt.grad_norm_squared()
        for opt in optimizers:
            opt.step()
    after_step = memory_report(module, optimizers, zero, topology)

    m = batch.micro_batches
    activations, in_flight = _schedule_peak(per_chunk, schedule, p, m, v, topology.pp_rank)
    total = micro.scaled(m)
    total += _p2p_traffic(schedule, p, m, v, topology, outputs, inputs, batch, dims, config, hidden_dtype)
    total += step
    traffic: dict[str, float] = {}
    calls: dict[str, int] = {}
    for (group, op), n in total.nbytes.items():
        if op == "recv":
            continue
        name = group_name(group)
        traffic[name] = traffic.get(name, 0) + n
        calls[name] = calls.get(name, 0) + total.calls[(group, op)]
    memory = {
        "params": float(before_step["params"]),
        "grads": float(before_step["grads"]),
        "master": float(after_step["master"]),
        "optimizer_state": float(after_step["optimizer_state"]),
        "buffers": float(storage_bytes(list(module.buffers()))),
    }
    return RankResult(
        rank=topology.rank, coords=topology.coords, pieces=pieces, layers=layers, memory=memory,
        activations=activations, activation_per_micro_batch=per_chunk, in_flight=in_flight, recompute=recompute,
        traffic=traffic, calls=calls, seconds=time.perf_counter() - start, formula=after_step["formula"],
    )


def _whole_forward(module: nn.Module, data: dict[str, Tensor]) -> Any:
    """pipeline_parallel=1: what the model's forward runs, through its layer sequence."""
    sequence = _sequence(module)
    x = sequence.embed(data)
    for block in sequence.blocks:
        x = sequence.block(block, x, data)
    return sequence.head(x, data)


def _boundary_shape(batch: Batch, dims: ParallelDims, config: Any) -> tuple[int, ...]:
    """The hidden states one piece hands the next: this rank's tokens, split again over tp under
    sequence parallelism."""
    tokens = batch.local_seq // (dims.tp if config.layout.sequence_parallel and dims.tp > 1 else 1)
    return (batch.micro_batch, tokens, batch.hidden)


def _recompute_bytes(
    module: nn.Module, runtime: Optional[PipelineRuntime], pieces: list[int], batch: Batch, dims: ParallelDims, config: Any, dtype: torch.dtype
) -> float:
    """Full recompute: what one block holds while it is re-run in backward -- its forward without the
    checkpoint wrapper, counted like any forward (the block's original forward, kept by the wrapper)."""
    sequence = _sequence(module) if runtime is None else runtime.sequence
    block = next((b for b in sequence.blocks if wrapper(b, CHECKPOINTED) is not None), None)
    if block is None:
        return 0.0
    replaced = wrapper(block, CHECKPOINTED).previous  # (the wrapper's record: its own __wrapped__ is Dynamo's)
    original = replaced if replaced is not None else type(block).forward.__get__(block)
    x = torch.empty(_boundary_shape(batch, dims, config), dtype=dtype, device=META, requires_grad=True)
    params = list(block.parameters())
    tracker = SavedBytes(exclude=params)
    with tracker.hooks():
        out = original(x)
    held = tracker.current
    del out
    return float(held)


def _schedule_peak(per_chunk: list[float], schedule: str, p: int, m: int, v: int, rank: int) -> tuple[float, float]:
    """The most bytes alive at once under this rank's order of the schedule: a (micro-batch, chunk)
    is alive from its forward to its backward (zero-bubble: to its weight half W)."""
    if p == 1:
        return per_chunk[0], 1.0
    actions = build_schedule(schedule, p, m, v)[rank]
    alive: dict[tuple[int, int], float] = {}
    peak, peak_count = 0.0, 0
    for a in actions:
        if a.kind == "F":
            alive[(a.micro, a.chunk)] = per_chunk[a.chunk]
            current = sum(alive.values())
            if current > peak:
                peak, peak_count = current, len(alive)
        elif a.kind in ("B", "W"):
            alive.pop((a.micro, a.chunk), None)
    return peak, peak_count / len(per_chunk)


def _p2p_traffic(
    schedule: str, p: int, m: int, v: int, topology: Topology, outputs: list[Optional[Tensor]], inputs: list[Optional[Tensor]],
    batch: Batch, dims: ParallelDims, config: Any, dtype: torch.dtype,
) -> Traffic:
    """The pipeline's point-to-point bytes of one step: this rank's sends in the schedule the runtime
    executes (an activation per forward that feeds another rank, an input gradient per backward of a
    piece that has an input), each the size of the tensor the piece produced or received above."""
    out = Traffic()
    if p == 1:
        return out
    group = topology.pp_group
    boundary = math.prod(_boundary_shape(batch, dims, config)) * dtype.itemsize
    rank = topology.pp_rank
    for a in build_schedule(schedule, p, m, v)[rank]:
        if a.kind in ("SEND_ACT", "SEND_GRAD") and peer_of(a, p, rank)[0] != rank:  # (the V's bottom: handed over)
            t = outputs[a.chunk] if a.kind == "SEND_ACT" else inputs[a.chunk]
            nbytes = t.numel() * t.element_size() if t is not None else boundary
            out.add(group, "send", nbytes)
    return out
