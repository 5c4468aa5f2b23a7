"""ZeRO stages 1 and 2 (and mixed-precision stage 0) around any ``torch.optim`` optimizer.

Each optimizer parameter group is packed, in gradient-ready order, into fixed-size buckets. A
bucket owns a flat buffer in the compute dtype; the model's parameters become views into it.
Every bucket is split evenly over the data-parallel ranks (Megatron's distributed-optimizer
layout), so one reduce-scatter per bucket leaves each rank the averaged gradient of its slice,
and one all-gather per bucket returns the updated slices to everyone (launched per round of buckets
inside the step, all finished when it returns: :meth:`ZeroOptimizer._step_in_memory`): 2 psi of
traffic per step, like DDP.

The user's optimizer object is kept (Lightning, LR schedulers and ``toggle_optimizer`` keep
seeing the model parameters in its ``param_groups``); a shallow copy of it -- the *inner*
optimizer -- runs on this rank's slices of the fp32 master weights, so its state exists only
for the slice. Hyper-parameters (``lr`` set by schedulers, ...) are copied from the user's groups
to the inner ones before every step.

Per stage, with ``psi`` local parameters on ``N`` data-parallel ranks (bf16-mixed, Adam):

* stage 0: full gradients all-reduced, full master and state on every rank: 16 psi;
* stage 1: a persistent full gradient staging buffer (views are ``param.grad``) that is
  reduce-scattered, the reduced slice kept in place: 2 + 2 + 12/N psi;
* stage 2: gradients are copied into transient buckets as they arrive and ``param.grad`` is
  released; only the reduced slice is kept: 2 + 14/N psi.

Gradient accumulation (``no_sync``) communicates nothing: gradients accumulate locally (stage 2
then holds full gradients until the synchronizing micro-step).

One process skips a parameter that got no gradient (``grad is None``): no weight decay, no
momentum, and its own step count stays behind. To match that, the inner optimizer does not see
one flat slice per bucket but one tensor per *segment* -- the part of a parameter that lies in
this rank's slice (the whole parameter, in its shape, when it is not cut) -- each with its own
state, and a segment whose parameter got no gradient on any data-parallel rank this step keeps
``grad=None``. Segments are views of the flat master slice, so offload and the collectives still
move one flat buffer per bucket. Optimizers that need whole parameters are refused where a
parameter can be cut (:mod:`lightning_3d.zero.optimizer_kinds`).

Expert slices (expert parallelism) go into buckets of their own, split over the ranks that hold
them -- their expert replicas -- instead of every data-parallel rank; their gradients are summed
there and divided by the number of weight replicas like every other (``grad_reducer.py`` says why).
Sequence-parallel replicas (a partial gradient on each tp rank) also get buckets of their own: each
reduction's result, this backward's part only, is summed over tp before it joins the slice, in one
call per bucket instead of one per parameter from their hooks (``docs/architecture.md``).
"""

from __future__ import annotations

import copy
import os
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Parameter
from torch.optim import Optimizer
from torch.optim import optimizer as _optimizer_hooks

from lightning_3d.core.distributed import all_gather_flat, current_compute_device, reduce_scatter_flat
from lightning_3d.core.finite import any_nonfinite
from lightning_3d.core.param_meta import is_pipeline_duplicate
from lightning_3d.tensor_parallel.mappings import gather_along
from lightning_3d.tensor_parallel.spec import TPSpec, gather_full, get_spec, sequence_parallel_group, shard_like
from lightning_3d.testing.strict_comm import mark_host
from lightning_3d.zero.buckets import DEFAULT_BUCKET_BYTES, BucketedBackward, assign_buckets, bucket_owners, unique_trainable
from lightning_3d.zero.offload import ChunkAdam, NVMeStateStore, fused_adam_like, host_empty, is_adam
from lightning_3d.zero.optimizer_kinds import ELEMENTWISE, IMPLEMENTATION_KEYS, check_optimizer_layout, prefer_fused_adam

REDUCE_DTYPE = torch.float32
# A ZeRO step in rounds (ZeroOptimizer.step_rounds) leaves the last 1/STEP_ROUNDS of its
# all-gathers and uploads exposed and calls the inner optimizer this many times.
STEP_ROUNDS = 8
ROUNDS_ON_CPU_ENV = "LIGHTNING_3D_ZERO_ROUNDS_ON_CPU"  # "1": CPU ranks step in rounds too (the test suite)


@dataclass
class _Segment:
    """The part ``[start, end)`` (flat, within the parameter) of parameter ``index`` of a bucket that
    lies in this rank's slice, at ``offset`` in the slice; ``tensor`` is the master view the inner
    optimizer updates (parameter-shaped when the segment is the whole parameter; ``None`` on NVMe)."""

    index: int
    start: int
    end: int
    offset: int
    tensor: Optional[Tensor] = None

    @property
    def numel(self) -> int:
        return self.end - self.start

    def of(self, flat_slice: Tensor) -> Tensor:
        """This segment of a flat tensor over the rank's slice."""
        return flat_slice[self.offset : self.offset + self.numel]


@dataclass
class _Bucket:
    params: list[Parameter]
    offsets: list[int]
    padded: int
    shard_start: int
    shard_size: int
    group_index: int
    param_buf: Tensor  # (padded,) compute dtype; params are views into it
    master: Tensor  # (shard_size,) fp32 master slice, or a view of param_buf when dtypes match
    grad_buf: Optional[Tensor] = None  # stage 0/1: persistent staging buffer (param.grad are views)
    grad_shard: Optional[Tensor] = None  # stage 2: reduced slice; stage 0/1 use grad_buf's slice
    # Offload: host buffers kept from step to step (pinned with a GPU). A fresh host tensor per step
    # costs a page fault per 4 KiB: on the H200 run that made ZeRO-2 offload 10x slower than DeepSpeed.
    host_grad: Optional[Tensor] = None  # the reduced slice in the master's dtype, for the host step
    host_upload: Optional[Tensor] = None  # updated masters in the parameters' dtype, on their way up
    send: Optional[Tensor] = None  # transient fp32 reduction input
    recv: Optional[Tensor] = None  # transient fp32 reduce-scatter output
    present: list[bool] = field(default_factory=list)  # gradient taken in this backward
    used: list[bool] = field(default_factory=list)  # gradient produced on this rank since the last step
    segments: list[_Segment] = field(default_factory=list)
    reduced: bool = False  # this bucket's slice holds a reduced gradient not yet consumed by a step
    counted: list[tuple[int, int]] = field(default_factory=list)  # slice ranges counted in norms here
    owners: Optional[dist.ProcessGroup] = None  # the ranks holding these parameters (None: this one alone)
    partial: bool = False  # held by fewer ranks than the data-parallel group (expert slices)
    partial_sum: Optional[dist.ProcessGroup] = None  # sequence-parallel replicas: the tp group each reduction is summed over
    _grad_views: list[Tensor] = field(default_factory=list, repr=False)  # of _grad_views_of, one per parameter
    _grad_views_of: Optional[Tensor] = field(default=None, repr=False)

    def view(self, buf: Tensor, i: int) -> Tensor:
        p = self.params[i]
        return buf[self.offsets[i] : self.offsets[i] + p.numel()].view_as(p)

    def grad_views(self, recheck: bool = False) -> list[Tensor]:
        """Each parameter's view of ``grad_buf`` (stages 0-1), made once per buffer: the same objects are
        handed out as ``param.grad`` at every step, so that "is this gradient still its view?" is an
        identity test and a step creates no tensors here. ``recheck`` (once a step, in ``zero_grad``):
        also remake them if they no longer share the buffer's storage (moving the module re-points
        ``param.grad.data`` and so the views)."""
        stale = recheck and bool(self._grad_views) and self._grad_views[0].untyped_storage().data_ptr() != self.grad_buf.untyped_storage().data_ptr()
        if self._grad_views_of is not self.grad_buf or stale:
            self._grad_views = [self.view(self.grad_buf, i) for i in range(len(self.params))]
            self._grad_views_of = self.grad_buf
        return self._grad_views

    def slice_of(self, buf: Tensor) -> Tensor:
        return buf[self.shard_start : self.shard_start + self.shard_size]

    def host_grad_buffer(self, dtype: torch.dtype) -> Tensor:
        """The kept host buffer for this rank's gradient slice (allocated at first use)."""
        if self.host_grad is None:
            self.host_grad = host_empty(self.shard_size, dtype)
            mark_host(self.host_grad, "offload: a gradient slice in host memory")
        return self.host_grad


class ShardedGradients(BucketedBackward[_Bucket]):
    """The backward half of :class:`ZeroOptimizer`: bucket reductions into per-rank slices.

    Stages 0/1 accumulate into the persistent staging buffer (``param.grad`` are views into it)
    and reduce it once per step. Stage 2 -- and stages 0/1 when a second synchronizing backward
    reaches a bucket before the optimizer stepped -- copies each new gradient into a transient
    bucket, releases ``param.grad`` and *adds* the reduction to the slice. After a reduction
    ``param.grad`` is ``None``: the reduced gradient lives in the optimizer's slice.
    """

    def __init__(
        self,
        buckets: list[_Bucket],
        group: dist.ProcessGroup,
        stage: int,
        grad_device: Optional[torch.device] = None,
        host_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(group)
        self.stage = stage
        self.grad_device = grad_device  # stage 2 with offload: reduced slices go to host memory
        self.host_dtype = host_dtype  # ... in the masters' dtype, which the host step reads
        self._host_copies: Optional[Any] = None  # CUDA event after the last device-to-host copy
        # offload: inf/NaN seen in the reduced slices on their way to the host (a device flag), and
        # whether it still describes the host slices (a host-side add or rescale makes it stale)
        self.nonfinite_seen: Optional[Tensor] = None
        self.nonfinite_known = True
        self._register(buckets)

    def forget_nonfinite(self) -> None:
        """A new step: nothing reduced yet, so nothing seen."""
        self.nonfinite_seen, self.nonfinite_known = None, True

    def _transient(self, bucket: _Bucket) -> bool:
        return self.stage == 2 or bucket.reduced

    def _accumulated(self, bucket: _Bucket, index: int) -> None:
        bucket.used[index] = True

    def _gradient_ready(self, bucket: _Bucket, index: int, param: Parameter) -> bool:
        if bucket.present[index]:
            return False
        bucket.used[index] = True
        if self._transient(bucket):
            self._stage(bucket, index, param)
        else:
            view = bucket.grad_views()[index]
            if param.grad is not view:  # autograd created a fresh tensor (grad was None, or replaced)
                view.copy_(param.grad)
                param.grad = view
        bucket.present[index] = True
        return True

    def _stage(self, bucket: _Bucket, index: int, param: Parameter) -> None:
        """Move the gradient into a transient bucket and release ``param.grad``."""
        if bucket.send is None:
            bucket.send = torch.zeros(bucket.padded, dtype=REDUCE_DTYPE, device=bucket.param_buf.device)
        if param.grad is not None:
            bucket.view(bucket.send, index).copy_(param.grad)
            bucket.used[index] = True
            param.grad = None

    def _launch(self, bucket: _Bucket) -> Optional[dist.Work]:
        if self._transient(bucket):
            for i, p in enumerate(bucket.params):
                if not bucket.present[i]:
                    self._stage(bucket, i, p)  # accumulated in earlier micro-steps, or zeros
            send = bucket.send
        else:
            send = bucket.grad_buf if bucket.grad_buf.dtype == REDUCE_DTYPE else bucket.grad_buf.to(REDUCE_DTYPE)
            bucket.send = send
        if self.world > 1:  # the weight replicas, whoever holds the bucket (one replica: nothing to scale)
            send.mul_(1.0 / self.world)
        if bucket.owners is None:  # held by this rank alone (an expert slice): nothing to sum
            bucket.recv = send
            return None
        if self.stage == 0:
            return dist.all_reduce(send, group=bucket.owners, async_op=True)
        bucket.recv = torch.empty(bucket.shard_size, dtype=REDUCE_DTYPE, device=send.device)
        return reduce_scatter_flat(bucket.recv, send, group=bucket.owners, async_op=True)

    def _complete(self, bucket: _Bucket) -> None:
        reduced = bucket.send if self.stage == 0 else bucket.recv  # stage 0: the slice is the whole bucket
        if bucket.partial_sum is not None:  # this backward's (dp-averaged) part only, so a held slice is not summed again
            dist.all_reduce(reduced, group=bucket.partial_sum)  # (every rank in bucket order; tp peers share the layout)
        if self.stage == 2 and self.grad_device is not None:
            self._to_host(bucket, reduced)
        elif self.stage == 2:
            if bucket.grad_shard is None:
                bucket.grad_shard = torch.zeros(bucket.shard_size, dtype=bucket.param_buf.dtype, device=reduced.device)
            bucket.grad_shard.add_(reduced)
        elif bucket.reduced:  # a second synchronizing backward this step: add to the held slice
            bucket.slice_of(bucket.grad_buf).add_(reduced)
        else:  # the staging buffer is consumed: zero it, keep the reduced slice in place
            if reduced is bucket.grad_buf:
                reduced = reduced.clone()
            bucket.grad_buf.zero_()
            bucket.slice_of(bucket.grad_buf).copy_(reduced)
            for p in bucket.params:
                p.grad = None
        bucket.send = bucket.recv = None
        bucket.present = [False] * len(bucket.params)
        bucket.reduced = True

    def _to_host(self, bucket: _Bucket, reduced: Tensor) -> None:
        """ZeRO-2 offload: the reduced slice into the bucket's host buffer. The step's first reduction
        copies it there asynchronously (from a GPU into pinned memory: the copy overlaps the rest of the
        backward; :meth:`grad_slice` waits for it); a later one in the same step adds to it."""
        if bucket.grad_shard is None:
            # checked here, on the device and in the backward's shadow, so the step need not read host memory
            seen = any_nonfinite([reduced], reduced.device)
            self.nonfinite_seen = seen if self.nonfinite_seen is None else torch.maximum(self.nonfinite_seen, seen)
            if self.host_dtype != reduced.dtype:  # a narrower host copy (bf16/fp16 masters) can overflow where this did not
                self.nonfinite_known = False
            bucket.grad_shard = bucket.host_grad_buffer(self.host_dtype).copy_(reduced, non_blocking=True)
            if reduced.is_cuda:
                self._host_copies = torch.cuda.Event()
                self._host_copies.record()
        else:  # a second synchronizing backward before the step (rare): the host adds right away
            self.await_host_copies()
            bucket.grad_shard.add_(reduced.to(bucket.grad_shard.device))
            self.nonfinite_known = False  # two finite parts can sum to inf

    def await_host_copies(self) -> None:
        """Before the host reads an offloaded gradient: the asynchronous copies into it have landed."""
        if self._host_copies is not None:
            self._host_copies.synchronize()
            self._host_copies = None

    def grad_slice(self, bucket: _Bucket) -> Optional[Tensor]:
        """The reduced gradient of this rank's slice (``None`` if nothing was reduced yet)."""
        if self.stage == 2:
            self.await_host_copies()
            return bucket.grad_shard
        return bucket.slice_of(bucket.grad_buf) if bucket.reduced else None


class ZeroOptimizer:
    """Wraps a user optimizer for ZeRO stages 0 (mixed precision), 1 and 2. See the module docstring.

    Args:
        optimizer: the optimizer from ``configure_optimizers`` (over the model's parameters).
        dp_group: the data-parallel group the state is sharded over.
        stage: 0, 1 or 2.
        compute_dtype: dtype of the model's parameters and gradients (bf16/fp16 for mixed modes).
        master_dtype: dtype of the master weights the inner optimizer updates (fp32 normally).
        tp_group / pp_group: for counting each parameter once in global norms.
        offload: ``"none"``, ``"cpu"`` (masters and state in host memory, the step on the CPU) or
            ``"nvme"`` (masters and Adam moments in a file under ``nvme_path``); see ``offload.py``.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        dp_group: dist.ProcessGroup,
        stage: int,
        compute_dtype: torch.dtype = torch.float32,
        master_dtype: torch.dtype = torch.float32,
        tp_group: Optional[dist.ProcessGroup] = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        pp_group: Optional[dist.ProcessGroup] = None,
        offload: str = "none",
        nvme_path: Optional[str] = None,
    ) -> None:
        if stage not in (0, 1, 2):
            raise ValueError(f"ZeroOptimizer handles stages 0-2, got {stage}.")
        check_optimizer_layout(optimizer, stage, dist.get_world_size(tp_group) if tp_group is not None else 1)
        if offload == "nvme" and not is_adam(optimizer):
            raise ValueError(
                f"offload_optimizer='nvme' streams Adam/AdamW state; {type(optimizer).__name__} is not supported there "
                f"(use offload_optimizer='cpu', which runs any optimizer)."
            )
        self.optimizer = optimizer
        self.dp_group, self.tp_group, self.pp_group, self.stage = dp_group, tp_group, pp_group, stage
        self.compute_dtype, self.master_dtype, self.offload = compute_dtype, master_dtype, offload
        self.host = torch.device("cpu") if offload != "none" else None
        self.dp_size, self.dp_rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
        self._agreed_used: Optional[list[list[bool]]] = None  # the used vote, taken ahead of the step (take_world_vote)
        tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
        layout: list[tuple[int, list[Parameter]]] = []
        seen: set[int] = set()
        for g_idx, group in enumerate(optimizer.param_groups):
            params = [p for p in unique_trainable(group["params"]) if id(p) not in seen]
            seen.update(id(p) for p in params)
            layout.extend((g_idx, members) for members in assign_buckets(params[::-1], bucket_bytes))
        self.store: Optional[NVMeStateStore] = None
        self.chunk_adam: Optional[ChunkAdam] = None
        owners = [bucket_owners(members, dp_group) for _, members in layout]
        shards = [1 if stage == 0 else dist.get_world_size(group) for group in owners]
        if offload == "nvme":  # the file exists before any master does: masters go straight to disk
            if not nvme_path:
                raise ValueError("offload_optimizer='nvme' needs nvme_path=<a directory on a fast local disk>.")
            sizes = [-(-sum(p.numel() for p in members) // n) for (_, members), n in zip(layout, shards)]
            self.store = NVMeStateStore(nvme_path, dist.get_rank(), sizes)
            self.chunk_adam = ChunkAdam(optimizer)
        self.buckets = [
            self._build_bucket(slot, members, g_idx, shards[slot], 0 if stage == 0 else dist.get_rank(owners[slot]), tp_rank)
            for slot, (g_idx, members) in enumerate(layout)
        ]
        for bucket, group in zip(self.buckets, owners):
            bucket.owners = group if dist.get_world_size(group) > 1 else None
            bucket.partial = dist.get_world_size(group) < self.dp_size
            bucket.partial_sum = sequence_parallel_group(bucket.params[0])
        # NVMe keeps Adam's step count per segment here (the moments are in the file).
        self.nvme_steps: list[list[int]] = [[0] * len(b.segments) for b in self.buckets]
        self.grads = ShardedGradients(self.buckets, dp_group, stage, grad_device=self.host, host_dtype=master_dtype)
        try:
            self.inner = None if self.store is not None else self._inner_optimizer()
        except BaseException:
            self.grads.remove()  # give the hooks back their tp sums: no reducer will do them
            raise
        self.state = self.optimizer.state  # Lightning moves/inspects this; ours lives in self.inner
        self._uploads: Optional[Any] = None  # CUDA event after the last step's master -> parameter copies
        self.rounds: Optional[int] = None  # inner step calls per step; None: step_rounds decides

    # -- construction ------------------------------------------------------------------------
    @property
    def separate_master(self) -> bool:
        """Whether the masters are a copy of the parameters (mixed precision or offload)."""
        return self.compute_dtype != self.master_dtype or self.offload != "none"

    def _build_bucket(self, slot: int, params: list[Parameter], g_idx: int, shards: int, rank: int, tp_rank: int) -> _Bucket:
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += p.numel()
        padded = -(-total // shards) * shards
        device = params[0].device
        exact = torch.zeros(padded, dtype=self.master_dtype, device=device)
        for p, off in zip(params, offsets):
            exact[off : off + p.numel()].copy_(p.detach().reshape(-1))
        shard_size = padded // shards
        shard_start = rank * shard_size
        param_buf = exact if self.compute_dtype == self.master_dtype else exact.to(self.compute_dtype)
        mine = exact[shard_start : shard_start + shard_size]
        if self.store is not None:  # NVMe: the master slice lives in the file
            self.store.write_all(slot, "master", mine)
            master = torch.empty(0)
        elif self.host is not None:  # offloaded: a host copy of this rank's slice
            master = host_empty(shard_size, self.master_dtype)
            master.copy_(mine)
        else:  # on the device: the parameter slice itself when the dtypes match
            master = mine if param_buf is exact else mine.clone()
        for p, off in zip(params, offsets):
            p.data = param_buf[off : off + p.numel()].view_as(p)
        bucket = _Bucket(params, offsets, padded, shard_start, shard_size, g_idx, param_buf, master)
        bucket.present = [False] * len(params)
        bucket.used = [False] * len(params)
        for i, (p, off) in enumerate(zip(params, offsets)):
            lo, hi = max(off, shard_start), min(off + p.numel(), shard_start + shard_size)
            if lo < hi:
                segment = _Segment(i, lo - off, hi - off, lo - shard_start)
                if master.numel():
                    view = segment.of(master)
                    segment.tensor = view.view_as(p) if segment.numel == p.numel() else view
                bucket.segments.append(segment)
        if self.stage < 2:
            bucket.grad_buf = torch.zeros(padded, dtype=self.compute_dtype, device=device)
            for p, view in zip(params, bucket.grad_views()):
                p.grad = view
        # Slice ranges whose squares count toward the global norm on this rank: tensor-parallel
        # shards always; replicated parameters only on tp rank 0.
        for segment in bucket.segments:
            p = params[segment.index]
            spec = get_spec(p)
            if is_pipeline_duplicate(p):
                continue  # a tied weight's copy on the last pipeline stage: counted on the first
            if tp_rank == 0 or (spec is not None and spec.is_sharded):
                bucket.counted.append((segment.offset, segment.offset + segment.numel))
        return bucket

    def _inner_optimizer(self) -> Optimizer:
        """The optimizer that updates this rank's master segments: with CPU offload of Adam/AdamW,
        torch's fused CPU kernel; otherwise a shallow copy of the user's optimizer, on the fused
        kernel where the user left Adam's choice to torch (one call over every segment, not a dozen
        ops per segment)."""
        groups = []
        for g_idx, group in enumerate(self.optimizer.param_groups):
            segments = [s.tensor for b in self.buckets if b.group_index == g_idx for s in b.segments]
            groups.append({**group, "params": segments})
        if self.offload == "cpu" and is_adam(self.optimizer):
            return fused_adam_like(self.optimizer, groups)
        inner = copy.copy(self.optimizer)
        inner.__dict__.pop("step", None)  # LR schedulers patch the instance's step; ours is the class's
        inner.param_groups = groups
        prefer_fused_adam(inner)
        inner.state = defaultdict(dict)
        try:  # optimizers that create state eagerly in __init__ (Adagrad)
            fresh = type(self.optimizer)([dict(g) for g in groups], **self.optimizer.defaults)
            inner.state = fresh.state
        except Exception:  # noqa: BLE001 - a custom constructor: lazily created state only
            pass
        return inner

    # -- the Optimizer surface Lightning uses ------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        for bucket in self.buckets:
            if bucket.grad_buf is not None:
                bucket.grad_buf.zero_()
                for p, view in zip(bucket.params, bucket.grad_views(recheck=True)):
                    if p.grad is not view:
                        p.grad = view
            else:
                bucket.grad_shard = None
                for p in bucket.params:
                    p.grad = None
            bucket.reduced = False
            bucket.used = [False] * len(bucket.params)
        self._agreed_used = None
        self.grads.forget_nonfinite()

    def _grad_slices(self) -> Iterator[tuple[_Bucket, Tensor]]:
        for _, bucket, grad in self._indexed_grad_slices():
            yield bucket, grad

    def world_vote_flags(self) -> Optional[Tensor]:
        """This rank's used flags (1.0 per parameter with a gradient), for a MAX all-reduce over the whole
        world that carries other flags too (the precision plugin's finite vote): one collective and one
        host read per step instead of two. ``None`` where that vote cannot carry them: the data-parallel
        group is not the whole world (tp/pp peers hold other buckets), nobody else votes, or a dry run.
        Each call votes afresh (a second finite vote in one step overwrites the first's agreement)."""
        if self.dp_size == 1 or not self.buckets or self.buckets[0].param_buf.is_meta:
            return None
        if self.dp_size != dist.get_world_size():
            return None
        return self._local_used_flags()

    def take_world_vote(self, values: list[float]) -> None:
        """The agreed (MAX over the world) flags of :meth:`world_vote_flags`: the coming step uses them."""
        self._agreed_used = self._per_bucket([v > 0 for v in values])

    def _local_used_flags(self) -> Tensor:
        """1.0 per parameter (buckets in order) that has a gradient on this rank, on the buckets' device."""
        return torch.tensor([float(u) for b in self.buckets for u in b.used], device=self.buckets[0].param_buf.device)

    def _per_bucket(self, flat: list[bool]) -> list[list[bool]]:
        """A flat per-parameter list (buckets in order) cut back into one list per bucket."""
        values = iter(flat)
        return [[next(values) for _ in b.params] for b in self.buckets]

    def _used_anywhere(self) -> list[list[bool]]:
        """Per bucket and parameter: did any data-parallel rank produce a gradient since the last step?
        (One small all-reduce per step, unless the finite vote carried it; a parameter nobody used is
        skipped, as one process skips it.)"""
        if self._agreed_used is not None:
            agreed, self._agreed_used = self._agreed_used, None
            return agreed
        if not any(b.params for b in self.buckets):
            return []
        if self.dp_size == 1 and not self.buckets[0].param_buf.is_meta:  # nobody to ask: no trip to the device
            return [list(b.used) for b in self.buckets]  # and back (a host sync per step on a GPU)
        votes = self._local_used_flags()
        if self.dp_size > 1:
            dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=self.dp_group)
        if votes.is_meta:  # a dry run (lightning_3d.apps.dry_run) has no values: every parameter counts as used
            return [[True] * len(b.params) for b in self.buckets]
        return self._per_bucket(votes.bool().tolist())

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = closure() if closure is not None else None
        used = self._used_anywhere()
        if self.store is not None:
            gathers = [self._gather(bucket) for bucket in self._step_nvme(used)]
        else:
            gathers = self._step_in_memory(used)
        self.optimizer._opt_called = True  # type: ignore[attr-defined]  (LR schedulers check it)
        for handle in gathers:
            if handle is not None:
                handle.wait()
        self.zero_grad()
        return loss

    def _gather(self, bucket: _Bucket) -> Optional[dist.Work]:
        """Launch the all-gather that gives every owner of ``bucket`` this step's updated slices."""
        if self.stage == 0 or bucket.owners is None:
            return None
        mine = bucket.slice_of(bucket.param_buf)
        return all_gather_flat(bucket.param_buf, mine.clone(), group=bucket.owners, async_op=True)

    def _sync_hyperparameters(self, inner: Optimizer) -> None:
        """The user's current hyper-parameters (a schedule changes ``lr``) into the inner optimizer's
        groups; not how it runs (the user's ``fused=None`` would turn offload's fused kernel off)."""
        for inner_group, group in zip(inner.param_groups, self.optimizer.param_groups):
            inner_group.update({k: v for k, v in group.items() if k not in ("params", *IMPLEMENTATION_KEYS) and k in inner_group})

    def _step_in_memory(self, used: list[list[bool]]) -> list[Optional[dist.Work]]:
        """Step this rank's segments and launch each stepped bucket's all-gather; the handles to wait on.

        Where there is something to overlap (:attr:`step_rounds`), the inner optimizer steps the
        buckets in up to that many consecutive rounds of about equal size, and a round's
        uploads and all-gathers are launched before the next round steps: they run on the network
        (and, offloaded, on the copy engine) while the next round's update computes, instead of after
        all of it; only the last round's are left to wait for. Otherwise one call steps every segment.
        (Rounds, not one call per bucket: each ``step()`` call scans every tensor of the optimizer.)"""
        assert self.inner is not None
        self._await_uploads()
        self._sync_hyperparameters(self.inner)
        slices = list(self._indexed_grad_slices())
        if self.host is not None:
            # Offloaded, every slice comes to its kept host buffer before the first round: a blocking copy
            # down queued behind the last round's upload would wait for it, undoing the overlap. (In device
            # memory a dtype change allocates, so there it is done per round: a lower peak.)
            slices = [(b_idx, bucket, self._like_master(bucket, grad)) for b_idx, bucket, grad in slices]
        gathers = []
        try:
            for batch in _rounds(slices, self.step_rounds):
                for b_idx, bucket, grad in batch:
                    grad = self._like_master(bucket, grad)
                    for segment in bucket.segments:
                        seg = segment.tensor
                        assert seg is not None
                        seg.grad = segment.of(grad).view_as(seg) if used[b_idx][segment.index] else None
                self.inner.step()
                for _, bucket, _ in batch:
                    self._clear_segment_grads(bucket)
                    mine = bucket.slice_of(bucket.param_buf)
                    if mine.data_ptr() != bucket.master.data_ptr():
                        self._upload(bucket, mine)
                    gathers.append(self._gather(bucket))
        except BaseException:
            # No segment keeps a gradient view past a failed step (a later step would apply it again). The
            # parameters are then partly updated and gathered, as after any optimizer that raises mid-step.
            for _, bucket, _ in slices:
                self._clear_segment_grads(bucket)
            raise
        return gathers

    @staticmethod
    def _clear_segment_grads(bucket: _Bucket) -> None:
        for segment in bucket.segments:
            segment.tensor.grad = None  # type: ignore[union-attr]

    @property
    def step_rounds(self) -> int:
        """How many inner ``step()`` calls the step is cut into (see :meth:`_step_in_memory`).

        More than one only for torch's own element-wise optimizers, whose ``step()`` touches only the
        tensors that have a gradient and keeps all state per tensor (a custom optimizer may count steps
        per call or per group, so it is called once per step, as one process calls it; so is any optimizer
        while global step hooks are registered), with more than
        one bucket, and where a bucket's result leaves the rank (an all-gather, or an upload from host
        memory). By default only on a GPU (and on the meta device, where the dry run stands in for one):
        there the all-gathers and uploads run on other engines than the update. On CPU ranks gloo's
        all-gather is CPU work on the same cores as the update, and the rounds measured no faster
        (``benchmarks``: ``zero_step_rounds``); ``LIGHTNING_3D_ZERO_ROUNDS_ON_CPU=1`` runs them there too
        (the test suite does, so the GPU's path is the one tested). Set :attr:`rounds` to choose."""
        if self.inner is None or type(self.inner) not in ELEMENTWISE or len(self.buckets) < 2:
            return 1
        if _optimizer_hooks._global_optimizer_pre_hooks or _optimizer_hooks._global_optimizer_post_hooks:
            return 1  # hooks registered for every optimizer's step() would run once per round
        if self.rounds is not None:
            return max(1, self.rounds)
        gathers = self.stage > 0 and any(b.owners is not None for b in self.buckets)
        uploads = self.host is not None
        device = self.buckets[0].param_buf.device
        gpu_like = device.type in ("cuda", "meta") or os.environ.get(ROUNDS_ON_CPU_ENV) == "1"
        return STEP_ROUNDS if gpu_like and (gathers or uploads) else 1

    def _like_master(self, bucket: _Bucket, grad: Tensor) -> Tensor:
        """The gradient slice in the master's dtype and place; offloaded, through the bucket's reused
        host buffer (a blocking copy: the step reads it next)."""
        master = bucket.master
        if (grad.dtype, grad.device) == (master.dtype, master.device):
            return grad
        if self.host is None:
            return grad.to(master.device, master.dtype)
        return bucket.host_grad_buffer(master.dtype).copy_(grad)

    def _upload(self, bucket: _Bucket, mine: Tensor) -> None:
        """Updated masters into this rank's slice of the parameters. From host memory to a GPU in
        another dtype, the host converts into the bucket's reused pinned buffer (all cores) and the
        copy up runs asynchronously; :meth:`_await_uploads` waits for it before the host writes again."""
        source = bucket.master
        if mine.is_cuda and not source.is_cuda:
            if source.dtype != mine.dtype:
                if bucket.host_upload is None:
                    bucket.host_upload = host_empty(bucket.shard_size, mine.dtype)
                source = bucket.host_upload.copy_(source)
            mine.copy_(source, non_blocking=True)
            self._uploads = torch.cuda.Event()
            self._uploads.record()
        else:
            mine.copy_(source)

    def _await_uploads(self) -> None:
        """Before the host writes offloaded masters again: the asynchronous host-to-device copies of the
        last step must have read them (pinned memory is copied by the GPU after the call returned)."""
        if self._uploads is not None:
            self._uploads.synchronize()
            self._uploads = None

    def _indexed_grad_slices(self) -> Iterator[tuple[int, _Bucket, Tensor]]:
        for b_idx, bucket in enumerate(self.buckets):
            grad = self.grads.grad_slice(bucket)
            if grad is not None:
                yield b_idx, bucket, grad

    def _step_nvme(self, used: list[list[bool]]) -> list[_Bucket]:
        """Stream master and moments chunk by chunk: read ahead, step, write behind. Within a chunk,
        runs of consecutive used segments with one step count are stepped together."""
        assert self.store is not None and self.chunk_adam is not None
        reduced = list(self._indexed_grad_slices())
        work = [(slot, bucket, grad, span) for slot, bucket, grad in reduced for span in self.store.chunks(slot)]
        pending = self.store.prefetch(work[0][0], *work[0][3]) if work else None
        writes = []
        for i, (slot, bucket, grad, (start, end)) in enumerate(work):
            buffers = pending.result()
            if i + 1 < len(work):
                pending = self.store.prefetch(work[i + 1][0], *work[i + 1][3])
            group = self.optimizer.param_groups[bucket.group_index]
            chunk_grad = grad[start:end].to("cpu", torch.float32)
            for lo, hi, step in self._runs(slot, bucket, used[slot], start, end):
                views = {name: buf[lo - start : hi - start] for name, buf in buffers.items() if name != "_set"}
                self.chunk_adam.step(group, step, views, chunk_grad[lo - start : hi - start])
            # blocking: the host buffer goes back to the pool (and is overwritten) once written behind
            bucket.slice_of(bucket.param_buf)[start:end].copy_(buffers["master"])
            writes.append(self.store.write_back(slot, start, buffers))
        for w in writes:
            w.result()
        for slot, bucket, _ in reduced:
            for k, segment in enumerate(bucket.segments):
                if used[slot][segment.index]:
                    self.nvme_steps[slot][k] += 1
        return [bucket for _, bucket, _ in reduced]

    def _runs(self, slot: int, bucket: _Bucket, used: list[bool], start: int, end: int) -> Iterator[tuple[int, int, int]]:
        """(lo, hi, step count) over ``[start, end)`` of the slice: used segments, merged while contiguous
        and at the same step count."""
        run: Optional[list[int]] = None
        for k, segment in enumerate(bucket.segments):
            lo, hi = max(segment.offset, start), min(segment.offset + segment.numel, end)
            if lo >= hi or not used[segment.index]:
                continue
            step = self.nvme_steps[slot][k]
            if run is not None and run[1] == lo and run[2] == step:
                run[1] = hi
                continue
            if run is not None:
                yield run[0], run[1], run[2]
            run = [lo, hi, step]
        if run is not None:
            yield run[0], run[1], run[2]

    # -- precision support: unscale, overflow, global norm, clipping ----------------------------------------
    def offloaded_nonfinite(self) -> Optional[Tensor]:
        """ZeRO-2 offload: 1.0 if a reduced slice held inf or NaN when it left the device, else 0.0 (a
        device tensor, no pass over host memory); ``None`` where the slices must be looked at (no
        offload, nothing reduced, or the host changed them since: a second backward's add, a rescale)."""
        grads = self.grads
        if self.stage != 2 or grads.grad_device is None or not grads.nonfinite_known:
            return None
        return grads.nonfinite_seen

    def _host_slices_changed(self) -> None:
        self.grads.nonfinite_known = False

    def unscale_(self, inv_scale: float) -> None:
        self._host_slices_changed()
        for _, grad in self._grad_slices():
            grad.mul_(inv_scale)

    def grad_norm_squared(self) -> Tensor:
        """Sum of squared gradient entries over the whole model (a collective over dp, tp and pp)."""
        device = self.buckets[0].param_buf.device if self.buckets else current_compute_device()
        total = torch.zeros((), dtype=torch.float32, device=device)
        partial = torch.zeros((), dtype=torch.float32, device=device)  # stage 0: expert slices, held by fewer ranks
        for bucket, grad in self._grad_slices():
            for lo, hi in bucket.counted:
                squares = grad[lo:hi].float().pow(2).sum().to(device)
                if self.stage == 0 and bucket.partial:
                    partial += squares / (dist.get_world_size(bucket.owners) if bucket.owners is not None else 1)
                else:
                    total += squares
        if self.stage > 0:  # every rank's slices are distinct (dense and expert buckets alike)
            dist.all_reduce(total, group=self.dp_group)
        elif any(b.partial for b in self.buckets):  # each expert slice summed once over its expert group
            dist.all_reduce(partial, group=self.dp_group)
            total += partial
        for group in (self.tp_group, self.pp_group):
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(total, group=group)
        return total

    def scale_grads_(self, factor: Tensor) -> None:
        self._host_slices_changed()
        for _, grad in self._grad_slices():
            grad.mul_(factor.to(grad.device, grad.dtype))

    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp every reduced gradient element to ``[-clip_value, clip_value]`` (element-wise: local)."""
        self._host_slices_changed()  # (a clamped inf is finite: the slices say so, not the flag)
        for _, grad in self._grad_slices():
            grad.clamp_(-clip_value, clip_value)

    # -- state: per segment, local; dense (layout-independent) only on request -------------------------------
    def _flat_params(self) -> list[Parameter]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _full_bucket(self, bucket: _Bucket, local: Tensor) -> Tensor:
        """All-gather a per-rank slice tensor back to the whole bucket (stage 0: already whole)."""
        if self.stage == 0 or bucket.owners is None:
            return local
        return gather_along(local.to(bucket.param_buf.device).contiguous(), 0, bucket.owners)

    def _master_of(self, slot: int, bucket: _Bucket) -> Tensor:
        return self.store.read_all(slot, "master") if self.store is not None else bucket.master

    def segment_states(self, slot: int, bucket: _Bucket) -> list[tuple[_Segment, dict[str, Any]]]:
        """This rank's optimizer state, per segment of bucket ``slot`` that has any: per-element tensors
        flattened to the segment's length, other values (``step``, ...) as they are."""
        if self.store is not None:
            moments = {name: self.store.read_all(slot, name) for name in ("exp_avg", "exp_avg_sq")}
            out = []
            for k, segment in enumerate(bucket.segments):
                if self.nvme_steps[slot][k]:
                    entry: dict[str, Any] = {"step": torch.tensor(float(self.nvme_steps[slot][k]))}
                    entry.update({name: segment.of(flat) for name, flat in moments.items()})
                    out.append((segment, entry))
            return out
        assert self.inner is not None
        out = []
        for segment in bucket.segments:
            state = self.inner.state.get(segment.tensor)
            if state:
                flat = {k: v.reshape(-1) if _per_element(v, segment) else v for k, v in state.items()}
                out.append((segment, flat))
        return out

    def state_dict(self) -> dict[str, Any]:
        """This rank's own state, without communication (safe to call on one rank only): for each
        parameter the segment this rank holds. It loads back at the same layout; checkpoints use the
        strategy's sharded format or :meth:`dense_state_dict`, which load under any layout."""
        index = {id(p): i for i, p in enumerate(self._flat_params())}
        state: dict[int, dict[str, Any]] = {}
        segments: dict[int, list[int]] = {}
        for slot, bucket in enumerate(self.buckets):
            for segment in bucket.segments:
                segments[index[id(bucket.params[segment.index])]] = [segment.start, segment.end]
            for segment, entry in self.segment_states(slot, bucket):
                state[index[id(bucket.params[segment.index])]] = {k: _detached(v) for k, v in entry.items()}
        return {"state": state, "param_groups": self._groups(index), "zero_segments": segments, "zero_layout": self._layout_key()}

    def _layout_key(self) -> list[Any]:
        """Who this rank is and what its segments are: a local state loads only into the same."""
        return [self.stage, dist.get_world_size(), dist.get_rank(), [[p.numel() for p in b.params] for b in self.buckets]]

    def _groups(self, index: dict[int, int]) -> list[dict[str, Any]]:
        return [
            {**{k: v for k, v in group.items() if k != "params"}, "params": [index[id(p)] for p in group["params"]]}
            for group in self.optimizer.param_groups
        ]

    def dense_state_dict(self) -> dict[str, Any]:
        """Per-parameter dense state, as a plain optimizer over the unsharded model would save it.
        A collective over the data- and tensor-parallel groups: every rank must call it."""
        index = {id(p): i for i, p in enumerate(self._flat_params())}
        summary = {slot: self._segment_summary(slot, bucket) for slot, bucket in enumerate(self.buckets)}
        per_rank: list[Any] = [summary]
        if self.stage > 0 and self.dp_size > 1:
            per_rank = [None] * self.dp_size
            dist.all_gather_object(per_rank, summary, group=self.dp_group)
        state: dict[int, dict[str, Any]] = {}
        for slot, bucket in enumerate(self.buckets):
            summaries = [rank_summary[slot] for rank_summary in per_rank]
            names = sorted({n for s in summaries for n in s["per_element"]})
            has_state = sorted({i for s in summaries for i in s["scalars"]})
            own = {segment.index: entry for segment, entry in self.segment_states(slot, bucket)}
            flats = {}
            dtype = torch.float32 if self.store is not None else self.master_dtype  # NVMe state is fp32
            for name in names:
                flat = torch.zeros(bucket.shard_size, dtype=dtype, device=bucket.param_buf.device)
                for segment in bucket.segments:
                    value = own.get(segment.index, {}).get(name)
                    if value is not None:
                        segment.of(flat).copy_(value)
                flats[name] = self._full_bucket(bucket, flat)
            for i in has_state:
                p = bucket.params[i]
                entry = dict(next(s["scalars"][i] for s in summaries if i in s["scalars"]))
                for name in names:
                    entry[name] = _dense(bucket.view(flats[name], i), get_spec(p))
                state[index[id(p)]] = entry
        return {"state": state, "param_groups": self._groups(index)}

    def _segment_summary(self, slot: int, bucket: _Bucket) -> dict[str, Any]:
        per_element: set[str] = set()
        scalars: dict[int, dict[str, Any]] = {}
        for segment, entry in self.segment_states(slot, bucket):
            per_element.update(k for k, v in entry.items() if _per_element(v, segment))
            scalars[segment.index] = {k: _portable(v) for k, v in entry.items() if not _per_element(v, segment)}
        return {"per_element": sorted(per_element), "scalars": scalars}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take a dense optimizer state (from any layout), or this rank's own :meth:`state_dict`.
        Parameters without saved state start fresh, each on its own (partial states load)."""
        local = "zero_segments" in state_dict
        if local and state_dict.get("zero_layout") != self._layout_key():
            raise ValueError(
                "this ZeroOptimizer state was saved by a rank of another layout (ZeRO stage, data-parallel size or "
                "rank, buckets); load a checkpoint written by the strategy instead, which reshards."
            )
        params = self._flat_params()
        index = {id(p): i for i, p in enumerate(params)}
        for group, saved in zip(self.optimizer.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
        saved_state = {int(k): v for k, v in state_dict["state"].items()}
        for slot, bucket in enumerate(self.buckets):
            # like Optimizer.load_state_dict, the loaded state replaces everything: segments without an
            # entry start fresh (on NVMe: zero moments, step 0)
            flats: dict[str, Tensor] = {}
            if self.store is not None:
                flats = {name: torch.zeros(bucket.shard_size, dtype=torch.float32) for name in ("exp_avg", "exp_avg_sq")}
            for k, segment in enumerate(bucket.segments):
                p = bucket.params[segment.index]
                entry = saved_state.get(index[id(p)])
                if entry is None:
                    if self.store is not None:
                        self.nvme_steps[slot][k] = 0
                    elif self.inner is not None:
                        self.inner.state.pop(segment.tensor, None)
                    continue
                state: dict[str, Any] = {}
                for name, value in entry.items():
                    if isinstance(value, Tensor) and value.dim() > 0 and local and value.numel() == segment.numel:
                        state[name] = value.reshape(-1)
                    elif isinstance(value, Tensor) and value.dim() > 0 and not local and value.numel() == _dense_numel(p):
                        state[name] = _local(value, get_spec(p)).reshape(-1)[segment.start : segment.end]
                    else:
                        state[name] = value.clone() if isinstance(value, Tensor) else value
                if self.store is not None:
                    self.nvme_steps[slot][k] = int(float(state.pop("step", 0)))
                    for name, piece in state.items():
                        flat = flats.setdefault(name, torch.zeros(bucket.shard_size, dtype=torch.float32))
                        segment.of(flat).copy_(piece)
                else:
                    assert self.inner is not None and segment.tensor is not None
                    group = self.inner.param_groups[bucket.group_index]
                    self.inner.state[segment.tensor] = {
                        name: _cast_state(name, v, segment, group) for name, v in state.items()
                    }
            if self.store is not None:
                for name, flat in flats.items():
                    self.store.write_all(slot, name, flat)

    def dense_master(self) -> dict[int, Tensor]:
        """id(param) -> dense (tp-gathered) master weight; empty when the master is the parameter."""
        out: dict[int, Tensor] = {}
        if not self.separate_master:
            return out
        for slot, bucket in enumerate(self.buckets):
            full = self._full_bucket(bucket, self._master_of(slot, bucket))
            for i, p in enumerate(bucket.params):
                out[id(p)] = _dense(bucket.view(full, i), get_spec(p))
        return out

    def load_dense_master(self, dense: dict[int, Tensor]) -> None:
        """Set master slices (and parameters) from dense weights keyed by id(param)."""
        self._await_uploads()
        for slot, bucket in enumerate(self.buckets):
            if not all(id(p) in dense for p in bucket.params):
                continue
            # the NVMe file holds fp32 masters whatever the master dtype: keep what the checkpoint has
            dtype = torch.float32 if self.store is not None else self.master_dtype
            flat = torch.zeros(bucket.padded, dtype=dtype, device=bucket.param_buf.device)
            for i, p in enumerate(bucket.params):
                bucket.view(flat, i).copy_(_local(dense[id(p)], get_spec(p)))
            if self.store is not None:
                self.store.write_all(slot, "master", bucket.slice_of(flat))
            elif bucket.master.data_ptr() != bucket.slice_of(bucket.param_buf).data_ptr():
                bucket.master.copy_(bucket.slice_of(flat))
            bucket.param_buf.copy_(flat)

    def remove(self) -> None:
        """Stop reducing gradients (training ended). The state stays: a checkpoint may still be saved."""
        self.grads.remove()

    def close(self) -> None:
        """Release the state for good (the NVMe file is deleted); the optimizer is unusable after."""
        self.remove()
        if self.store is not None:
            self.store.close()
            self.store = None


def _rounds(slices: list[tuple[int, _Bucket, Tensor]], count: int) -> list[list[tuple[int, _Bucket, Tensor]]]:
    """``slices`` cut into at most ``count`` consecutive runs of about equal numbers of elements."""
    total = sum(grad.numel() for _, _, grad in slices)
    rounds: list[list[tuple[int, _Bucket, Tensor]]] = [[]]
    done = 0
    for item in slices:
        if rounds[-1] and total and done * count >= total * len(rounds):
            rounds.append([])
        rounds[-1].append(item)
        done += item[2].numel()
    return rounds


def _per_element(value: Any, segment: _Segment) -> bool:
    return isinstance(value, Tensor) and value.dim() > 0 and value.numel() == segment.numel


def _cast_state(name: str, value: Any, segment: _Segment, group: dict[str, Any]) -> Any:
    """A loaded state value as the inner optimizer keeps it (what ``Optimizer.load_state_dict`` does)."""
    target = segment.tensor
    assert target is not None
    if name == "step":
        step = value if isinstance(value, Tensor) else torch.tensor(float(value), dtype=torch.float32)
        return step.to(device=target.device, dtype=torch.float32) if group.get("fused") or group.get("capturable") else step
    if not isinstance(value, Tensor):
        return value
    value = value.to(device=target.device, dtype=target.dtype if value.is_floating_point() else value.dtype)
    return value.view_as(target).clone() if value.dim() > 0 and value.numel() == target.numel() else value


def _portable(value: Any) -> Any:
    """A state value that pickles to any rank (host memory)."""
    return value.detach().cpu().clone() if isinstance(value, Tensor) else value


def _detached(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, Tensor) else value


def _dense_numel(p: Tensor) -> int:
    spec = get_spec(p)
    if spec is None or not spec.is_sharded:
        return p.numel()
    n = 1
    for d in spec.full_shape:
        n *= d
    return n


def _dense(local: Tensor, spec: Optional[TPSpec]) -> Tensor:
    local = local.detach().clone()
    return gather_full(local, spec) if spec is not None and spec.differs_from_dense else local


def _local(dense: Tensor, spec: Optional[TPSpec]) -> Tensor:
    return shard_like(dense, spec) if spec is not None and spec.differs_from_dense else dense
