"""Megatron-style tensor-parallel layers.

* :class:`ColumnParallelLinear` splits the output features: each rank computes a slice of ``y``.
* :class:`RowParallelLinear` splits the input features: each rank computes a partial ``y`` that
  is summed over the group (or reduce-scattered along the sequence with sequence parallel).
* :class:`VocabParallelEmbedding` splits the vocabulary: each rank looks up the ids it owns.

A column layer followed by a row layer needs one collective in forward and one in backward.
Built directly, a layer initializes the dense weight exactly as ``nn.Linear``/``nn.Embedding``
would from the same RNG state and keeps its shard, so sharded and dense models built from one
seed agree; :meth:`from_dense` shards an existing module instead.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_3d.core.eager import communicates
from lightning_3d.core.topology import current_topology
from lightning_3d.tensor_parallel.mappings import (
    SEQUENCE_DIM,
    SEQUENCE_SHARD_ATTR,
    SequenceShard,
    SharedRegather,
    copy_to_tensor_parallel,
    gather_along,
    gather_from_tensor_parallel,
    reduce_from_tensor_parallel,
    reduce_scatter_along,
    reduce_scatter_to_sequence_parallel,
    scatter_to_tensor_parallel,
)
from lightning_3d.tensor_parallel.spec import TPSpec, mark_sequence_parallel, padded, replicated_spec, set_spec, shard_tensor


def resolve_tp_group(tp_group: Optional[dist.ProcessGroup]) -> dist.ProcessGroup:
    """An explicit group wins; otherwise the strategy's tensor-parallel group."""
    if tp_group is not None:
        return tp_group
    topology = current_topology()
    if topology is None:
        raise ValueError(
            "No tensor-parallel group: pass tp_group=..., or build the layer inside configure_model() "
            "under ThreeDParallelStrategy (which provides its tp group)."
        )
    return topology.tp_group


def _is_conv1d(module: Optional[nn.Module]) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2), matched by name so transformers is not imported."""
    return module is not None and type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _dense_weight(module: nn.Module) -> tuple[Tensor, Optional[Tensor]]:
    """(weight as [out, in], bias) for ``nn.Linear`` and Hugging Face's ``Conv1D`` ([in, out])."""
    if isinstance(module, nn.Linear):
        return module.weight.detach(), None if module.bias is None else module.bias.detach()
    if _is_conv1d(module):
        return module.weight.detach().t(), None if module.bias is None else module.bias.detach()
    raise TypeError(f"expected nn.Linear or transformers Conv1D, got {type(module).__name__}.")


def _weight_spec(weight: Tensor, module: nn.Module, group: dist.ProcessGroup, **spec) -> TPSpec:
    """The weight's spec; a ``Conv1D``'s dense tensor (in checkpoints and exports) stays ``[in, out]``,
    the transpose of the ``[out, in]`` layout the parallel layer computes with."""
    transposed = _is_conv1d(module)
    dense_shape = tuple(weight.shape)[::-1] if transposed else tuple(weight.shape)
    return TPSpec(full_shape=dense_shape, group=group, transposed=transposed, **spec)


def _linear_init_(weight: Tensor, bias: Optional[Tensor], fan_in: int) -> None:
    """``nn.Linear``'s default init on a shard: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) with the *dense*
    fan-in (what kaiming_uniform(a=sqrt(5)) gives), so a shard is drawn like the dense layer's."""
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    with torch.no_grad():
        weight.uniform_(-bound, bound)
        if bias is not None:
            bias.uniform_(-bound, bound)


def _rows_held(t: Tensor) -> tuple[Tensor, int]:
    """(the rows this rank holds, index of the first one in ``t``): all of them, or -- for a ZeRO-3
    (FSDP2) DTensor, sharded along dim 0 like ``torch.chunk`` -- its local chunk."""
    if not hasattr(t, "to_local"):
        return t, 0
    per = -(-t.shape[0] // t.device_mesh.size())
    return t.to_local(), min(t.shape[0], t.device_mesh.get_local_rank() * per)


def _zero_rows_(t: Tensor, start: int, valid: int) -> None:
    """Zero the rows of ``t`` (dense row index ``start`` + i) at or past ``valid``: vocabulary padding."""
    local, first = _rows_held(t)
    keep = max(0, min(local.shape[0], valid - start - first))
    if keep < local.shape[0]:
        with torch.no_grad():
            local[keep:].zero_()


def _check_divisible(what: str, size: int, world: int) -> None:
    if size % world:
        raise ValueError(
            f"{what}={size} is not divisible by tensor_parallel={world}; choose a tensor_parallel that divides it."
        )


# -- sequence-parallel column linear: keep the shard, gather it again in backward ------------------------
def _linear_grads(
    ctx: Any, grad_y: Tensor, shard: Tensor, weight: Tensor, regather: SharedRegather
) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """Gradients of ``y = full @ W^T + b`` (``full``: ``shard`` all-gathered along ``ctx.dim``) for
    input, weight and bias, with the formulas (and kernels) autograd uses for ``F.linear`` on a
    contiguous input, so they agree bit for bit with the gathered-input path. Computed in the dtype
    forward computed in (``grad_y``'s: the autocast dtype under autocast), each returned in its
    tensor's dtype (as autocast's cast back would). The re-gather is started before the input
    gradient's matmul and waited for after it."""
    need_input, need_weight, need_bias = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
    device = grad_y.device.type
    with torch.autocast(device, enabled=False) if torch.amp.is_autocast_available(device) else contextlib.nullcontext():
        if need_weight:
            regather.begin(shard, ctx.dim, ctx.group)
        compute = grad_y.dtype
        grad_2d = grad_y.reshape(-1, grad_y.shape[-1])
        grad_input = grad_weight = grad_bias = None
        if need_input:
            w = weight if weight.dtype == compute else weight.to(compute)
            grad_input = grad_2d.mm(w).view(*grad_y.shape[:-1], w.shape[1]).to(ctx.input_dtype)
        if need_weight:
            full = regather.finish()
            grad_weight = grad_2d.t().mm(full.reshape(-1, full.shape[-1])).to(weight.dtype)
        if need_bias:
            grad_bias = grad_2d.sum(0).to(ctx.bias_dtype)
    return grad_input, grad_weight, grad_bias


class _GatherLinear(torch.autograd.Function):
    """``y = all_gather(x) @ W^T + b`` for a sequence-sharded ``x``, keeping only ``x`` (in the compute
    dtype) and ``W`` for backward. Backward: all-gather ``x`` again for the weight gradient, and
    reduce-scatter the input gradient along the sequence (the adjoint of the forward all-gather)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Optional[Tensor], group: dist.ProcessGroup, dim: int) -> Tensor:
        full = gather_along(x, dim, group)
        y = F.linear(full, weight, bias)  # under the caller's autocast, as the gathered-input path
        ctx.group, ctx.dim, ctx.input_dtype = group, dim, x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.save_for_backward(x if x.dtype == y.dtype else x.detach().to(y.dtype), weight)
        return y

    @staticmethod
    def backward(ctx: Any, grad_y: Tensor) -> tuple[Optional[Tensor], ...]:
        shard, weight = ctx.saved_tensors
        grad_full, grad_weight, grad_bias = _linear_grads(ctx, grad_y, shard, weight, SharedRegather().register())
        grad_x = None if grad_full is None else reduce_scatter_along(grad_full, ctx.dim, ctx.group)
        return grad_x, grad_weight, grad_bias, None, None


class _PreparedGatherLinear(torch.autograd.Function):
    """``y = full @ W^T + b`` where ``full`` came from :func:`~lightning_3d.tensor_parallel.mappings.gather_for_column_parallel`:
    keeps the shard (``source``) instead of ``full``. The input gradient is the full-sequence one:
    the gather's own backward reduce-scatters the sum over the layers that read ``full``."""

    @staticmethod
    def forward(ctx: Any, full: Tensor, weight: Tensor, bias: Optional[Tensor], source: SequenceShard) -> Tensor:
        y = F.linear(full, weight, bias)
        ctx.group, ctx.dim, ctx.input_dtype = source.group, source.dim, full.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.regather = source.regather.register()
        ctx.save_for_backward(source.shard_as(y.dtype), weight)
        return y

    @staticmethod
    def backward(ctx: Any, grad_y: Tensor) -> tuple[Optional[Tensor], ...]:
        shard, weight = ctx.saved_tensors
        grad_full, grad_weight, grad_bias = _linear_grads(ctx, grad_y, shard, weight, ctx.regather)
        return grad_full, grad_weight, grad_bias, None


def column_parallel_linear(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], group: dist.ProcessGroup, sequence_parallel: bool, input_is_prepared: bool
) -> Tensor:
    """The column-parallel matmul with its entry collective: copy (tensor parallel), or all-gather of a
    sequence shard keeping only the shard for backward (sequence parallel). ``input_is_prepared``: the
    caller entered the region; a tensor from :func:`gather_for_column_parallel` still has its shard kept."""
    if dist.get_world_size(group) == 1:
        return F.linear(x, weight, bias)
    if input_is_prepared:
        source = getattr(x, SEQUENCE_SHARD_ATTR, None) if sequence_parallel else None
        if source is not None and torch.is_grad_enabled() and source.matches(x):
            return _PreparedGatherLinear.apply(x, weight, bias, source)
        return F.linear(x, weight, bias)
    if sequence_parallel:
        return _GatherLinear.apply(x, weight, bias, group, SEQUENCE_DIM)
    return F.linear(copy_to_tensor_parallel(x, group), weight, bias)


class ColumnParallelLinear(nn.Module):
    """``y = x A^T + b`` with ``A`` split by rows (output features) over the tp group.

    Args:
        gather_output: all-gather ``y`` so every rank holds all output features.
        sequence_parallel: the input is split along the sequence; all-gather it first.
        input_is_prepared: the caller already applied the region's entry collective (several
            column layers reading one input then share one backward all-reduce).
        num_blocks: the output is made of equal blocks split separately (fused q/k/v).
        pad_output: pad ``out_features`` up to a multiple of tp (vocabulary heads); padded
            outputs are zero-weight columns that callers must ignore (``valid_out_features``).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        tp_group: Optional[dist.ProcessGroup] = None,
        input_is_prepared: bool = False,
        num_blocks: int = 1,
        pad_output: bool = False,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
        _dense: Optional[nn.Module] = None,
    ) -> None:
        super().__init__()
        self.tp_group = resolve_tp_group(tp_group)
        world, rank = dist.get_world_size(self.tp_group), dist.get_rank(self.tp_group)
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.input_is_prepared, self.num_blocks = input_is_prepared, num_blocks
        self.shared_entry: Any = None  # set by the plan's "share_entry" style on the parent module
        padded_out = padded(out_features, world) if pad_output else None
        if padded_out is None:
            _check_divisible(f"out_features of a column-parallel layer (per block of {num_blocks})", out_features // num_blocks, world)
        self.valid_out_features = out_features
        dense = _dense if _dense is not None else nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
        weight, dense_bias = _dense_weight(dense)
        spec = dict(dim=0, world=world, rank=rank, num_blocks=num_blocks, padded_size=padded_out)
        self.weight = nn.Parameter(shard_tensor(weight, **spec))
        set_spec(self.weight, _weight_spec(weight, dense, self.tp_group, **spec))
        if dense_bias is not None:
            self.bias = nn.Parameter(shard_tensor(dense_bias, **spec))
            set_spec(self.bias, TPSpec(full_shape=tuple(dense_bias.shape), group=self.tp_group, **spec))
        else:
            self.register_parameter("bias", None)

    def reset_parameters(self) -> None:
        """Re-initialize this rank's shard as ``nn.Linear`` would the dense layer (padding stays zero):
        what materializing a meta-device model calls before any model-level init."""
        _linear_init_(self.weight, self.bias, self.in_features)
        start = dist.get_rank(self.tp_group) * self.weight.shape[0]
        _zero_rows_(self.weight, start, self.valid_out_features)
        if self.bias is not None:
            _zero_rows_(self.bias, start, self.valid_out_features)

    @classmethod
    def from_dense(cls, module: nn.Module, tp_group: Optional[dist.ProcessGroup] = None, **kwargs) -> "ColumnParallelLinear":
        """This rank's shard of an ``nn.Linear`` (or HF ``Conv1D``)."""
        weight, bias = _dense_weight(module)
        return cls(weight.shape[1], weight.shape[0], bias=bias is not None, tp_group=tp_group, _dense=module, **kwargs)

    @communicates
    def forward(self, x: Tensor) -> Tensor:
        prepared = self.input_is_prepared
        shared = self.shared_entry
        if shared is not None and not prepared:
            x, prepared = shared.enter(x), True  # one entry for the siblings reading this tensor
        # under sequence parallelism only the sequence shard is kept for backward (gathered again there)
        y = column_parallel_linear(x, self.weight, self.bias, self.tp_group, self.sequence_parallel, prepared)
        if self.gather_output:
            y = gather_from_tensor_parallel(y, self.tp_group).narrow(-1, 0, self.valid_out_features)
        return y

    def extra_repr(self) -> str:
        world = dist.get_world_size(self.tp_group)
        return f"in_features={self.in_features}, out_features={self.out_features} ({self.weight.shape[0]}/rank, tp={world}), sequence_parallel={self.sequence_parallel}"


class RowParallelLinear(nn.Module):
    """``y = x A^T + b`` with ``A`` split by columns (input features); partial sums are reduced.

    Args:
        input_is_parallel: the input already holds this rank's slice of the features (the output
            of a column-parallel layer); otherwise it is split here.
        sequence_parallel: reduce-scatter the output along the sequence instead of all-reducing.
            The bias is then added to a sequence shard, so its gradient is partial (marked).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        tp_group: Optional[dist.ProcessGroup] = None,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
        _dense: Optional[nn.Module] = None,
    ) -> None:
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear(sequence_parallel=True) needs input_is_parallel=True.")
        self.tp_group = resolve_tp_group(tp_group)
        world, rank = dist.get_world_size(self.tp_group), dist.get_rank(self.tp_group)
        _check_divisible("in_features of a row-parallel layer", in_features, world)
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        dense = _dense if _dense is not None else nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
        weight, dense_bias = _dense_weight(dense)
        self.weight = nn.Parameter(shard_tensor(weight, dim=1, world=world, rank=rank))
        set_spec(self.weight, _weight_spec(weight, dense, self.tp_group, dim=1, world=world, rank=rank))
        if dense_bias is not None:
            self.bias = nn.Parameter(dense_bias.clone())
            if sequence_parallel:  # added after the reduce-scatter, to a sequence shard
                mark_sequence_parallel(self.bias, self.tp_group)
            else:
                set_spec(self.bias, replicated_spec(self.bias, self.tp_group))
        else:
            self.register_parameter("bias", None)

    def reset_parameters(self) -> None:
        """``nn.Linear``'s init of the dense layer, drawn for this rank's columns (fan-in is the dense
        ``in_features``). The bias is replicated: tp peers must draw it alike (same seed)."""
        _linear_init_(self.weight, self.bias, self.in_features)

    @classmethod
    def from_dense(cls, module: nn.Module, tp_group: Optional[dist.ProcessGroup] = None, **kwargs) -> "RowParallelLinear":
        weight, bias = _dense_weight(module)
        return cls(weight.shape[1], weight.shape[0], bias=bias is not None, tp_group=tp_group, _dense=module, **kwargs)

    @communicates
    def forward(self, x: Tensor) -> Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel(x, self.tp_group)
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel(y, self.tp_group)
        else:
            y = reduce_from_tensor_parallel(y, self.tp_group, inplace=True)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        world = dist.get_world_size(self.tp_group)
        return f"in_features={self.in_features} ({self.weight.shape[1]}/rank, tp={world}), out_features={self.out_features}, sequence_parallel={self.sequence_parallel}"


class VocabParallelEmbedding(nn.Module):
    """An embedding table split by vocabulary rows; ids outside this rank's range contribute zeros.

    The vocabulary is padded to a multiple of tp (padded rows are zero and never looked up), so
    any vocabulary size works. Ids outside ``[0, num_embeddings)`` -- padding rows included -- raise
    instead of silently embedding as zeros. With ``sequence_parallel`` the output is reduce-scattered along
    the sequence instead of all-reduced.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: Optional[int] = None,
        sequence_parallel: bool = False,
        tp_group: Optional[dist.ProcessGroup] = None,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
        _dense: Optional[nn.Embedding] = None,
    ) -> None:
        super().__init__()
        self.tp_group = resolve_tp_group(tp_group)
        world, rank = dist.get_world_size(self.tp_group), dist.get_rank(self.tp_group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.sequence_parallel = sequence_parallel
        padded_rows = padded(num_embeddings, world)
        self.rows_per_rank = padded_rows // world
        self.vocab_start = rank * self.rows_per_rank
        dense = _dense if _dense is not None else nn.Embedding(num_embeddings, embedding_dim, padding_idx, device=device, dtype=dtype)
        if dense.max_norm is not None or dense.scale_grad_by_freq or dense.sparse:
            raise ValueError("VocabParallelEmbedding does not support max_norm, scale_grad_by_freq or sparse.")
        self.padding_idx = dense.padding_idx
        weight = dense.weight.detach()
        self.weight = nn.Parameter(shard_tensor(weight, dim=0, world=world, rank=rank, padded_size=padded_rows))
        set_spec(
            self.weight,
            TPSpec(dim=0, world=world, rank=rank, full_shape=tuple(weight.shape), padded_size=padded_rows, group=self.tp_group),
        )

    def reset_parameters(self) -> None:
        """``nn.Embedding``'s init, N(0, 1), on this rank's rows; padding rows and ``padding_idx`` zero."""
        with torch.no_grad():
            self.weight.normal_()
        _zero_rows_(self.weight, self.vocab_start, self.num_embeddings)
        if self.padding_idx is not None and 0 <= self.padding_idx - self.vocab_start < self.rows_per_rank:
            local, first = _rows_held(self.weight)
            row = self.padding_idx - self.vocab_start - first
            if 0 <= row < local.shape[0]:
                with torch.no_grad():
                    local[row].zero_()

    @classmethod
    def from_dense(cls, module: nn.Embedding, tp_group: Optional[dist.ProcessGroup] = None, **kwargs) -> "VocabParallelEmbedding":
        return cls(module.num_embeddings, module.embedding_dim, tp_group=tp_group, _dense=module, **kwargs)

    def _check_ids(self, ids: Tensor) -> None:
        """Ids outside ``[0, num_embeddings)`` -- padding rows included -- are an error, not zeros. On
        the host an exact check; on an accelerator an asynchronous device assert (no host sync)."""
        if ids.numel() == 0 or ids.device.type == "meta":
            return
        world = dist.get_world_size(self.tp_group)
        fix = (
            f"(the table is padded to {self.rows_per_rank * world} rows for tensor_parallel={world}; padding rows are "
            f"not tokens). The data was tokenized for a larger vocabulary: re-tokenize it with the model's tokenizer, "
            f"or give the model a vocab_size above every id."
        )
        if ids.device.type != "cpu":
            ok = ((ids >= 0) & (ids < self.num_embeddings)).all()
            torch._assert_async(ok, f"VocabParallelEmbedding: a token id is outside the vocabulary [0, {self.num_embeddings}) {fix}")
            return
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= self.num_embeddings:
            bad = low if low < 0 else high
            raise ValueError(f"VocabParallelEmbedding: token id {bad} is outside the vocabulary [0, {self.num_embeddings}) {fix}")

    @communicates
    def forward(self, ids: Tensor) -> Tensor:
        self._check_ids(ids)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows_per_rank)
        local_padding = None
        if self.padding_idx is not None and 0 <= self.padding_idx - self.vocab_start < self.rows_per_rank:
            local_padding = self.padding_idx - self.vocab_start
        out = F.embedding(local.masked_fill(outside, 0), self.weight, padding_idx=local_padding)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel(out, self.tp_group)
        return reduce_from_tensor_parallel(out, self.tp_group, inplace=True)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim} ({self.rows_per_rank} rows/rank from {self.vocab_start}), sequence_parallel={self.sequence_parallel}"
