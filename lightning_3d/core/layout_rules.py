"""Which layouts lightning_3d can run: one set of rules for the strategy and the planner.

A layout is the parallel degrees and features (the ``ParallelConfig`` fields) on a model of a
given shape, in a world of a given size. Every rule here returns :class:`Refusal` s -- each
names the offending value and the fix -- instead of raising, so that

* ``ParallelConfig`` raises them at construction (the features), at Trainer construction (the
  world) and at set-up (the model, before anything is sharded);
* the planner proposes only layouts none of them refuses, and explains a ``--layout`` that one
  refuses (``lightning-3d plan`` exits 2 with the reasons).

Nothing here needs processes or a model instance, and nothing here knows a model: the shapes
come in as :class:`ModelDims` (each model family's adapter describes its models:
``lightning_3d.models.adapters``) or as the planner's ``ModelShape``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Union

from lightning_3d.core.dims import ParallelDims

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_v", "dualpipe_v")  # docs/pipeline.md
INTERLEAVED = "interleaved_1f1b"
V_SHAPED = ("zb_v", "dualpipe_v")  # two chunks per rank in a V (lightning_3d.pipeline.schedules)
ZERO_BUBBLE = ("zb_h1", "zb_v", "dualpipe_v")  # split each backward into input (I) and weight (W) halves
CONTEXT_PARALLEL_MODES = ("ring", "all_to_all")


@dataclass(frozen=True)
class Refusal:
    """Why a layout cannot run. ``rule`` is a stable id (for counting); ``message`` names the
    offending value and the fix. ``unsupported`` marks a combination this version does not
    implement (the strategy raises ``NotImplementedError``), as opposed to a wrong value."""

    rule: str
    message: str
    unsupported: bool = False


class LayoutRefused(ValueError):
    """A layout broke one or more rules; ``refusals`` lists them all."""

    def __init__(self, refusals: Iterable[Refusal], prefix: str = "") -> None:
        self.refusals = list(refusals)
        self.prefix = prefix
        super().__init__(prefix + " ".join(r.message for r in self.refusals))


class ModelLike(Protocol):
    """What the rules read of a model (``planner.ModelShape`` and :class:`ModelDims` have it)."""

    n_layer: int
    hidden: int
    n_head: int
    n_kv_head: int
    ffn: int


@dataclass(frozen=True)
class ModelDims:
    """The sizes a layout must divide, with the names the user knows them by (for messages).
    ``seq_len`` is the training sequence length when it is known (the planner's), else None."""

    n_layer: int
    hidden: int
    n_head: int
    n_kv_head: int
    ffn: int
    seq_len: Optional[int] = None
    labels: dict[str, str] = field(default_factory=dict, compare=False)
    n_experts: int = 0  # routed experts of its MoE layers (0: a dense model)
    shared_expert_width: int = 0  # the width of their shared experts (tensor parallelism splits it)


DEFAULT_LABELS = {key: key for key in ("n_layer", "hidden", "n_head", "n_kv_head", "ffn", "seq_len")}
_WHAT = {
    "n_head": "the attention heads (each rank attends with whole heads)",
    "n_kv_head": "the key/value heads (each rank must hold whole key/value heads)",
    "hidden": "the hidden size",
    "ffn": "the MLP width",
}


def _label(model: Any, key: str) -> str:
    labels = getattr(model, "labels", None) or {}
    return labels.get(key) or DEFAULT_LABELS[key]


def _divisors(n: int, limit: int = 64) -> str:
    """The tensor-parallel degrees that divide ``n`` (up to ``limit``: more are never practical)."""
    found = [str(k) for k in range(1, min(n, limit) + 1) if n % k == 0]
    return ", ".join(found) + (", ..." if n > limit else "")


# -- features: the degrees and options alone -------------------------------------------------------------
def feature_refusals(
    *,
    tp: int = 1,
    pp: int = 1,
    zero_stage: int = 0,
    sequence_parallel: bool = False,
    schedule: str = "1f1b",
    virtual_stages: int = 1,
    micro_batches: Optional[int] = None,
    offload_optimizer: str = "none",
    offload_params: str = "none",
) -> list[Refusal]:
    """Combinations of options the strategy refuses whatever the model and world (values already
    normalized as ``ParallelConfig`` does: schedule names, ``"none"`` for no offload)."""
    out: list[Refusal] = []
    if schedule in V_SHAPED and virtual_stages != 2:
        out.append(Refusal(
            "v_schedule_two_chunks",
            f"pipeline_schedule={schedule!r} places exactly two chunks per rank in a V (got virtual_stages="
            f"{virtual_stages}); leave virtual_stages at 1 or 2, or use pipeline_schedule='interleaved_1f1b' for more.",
        ))
    if micro_batches is not None and schedule == "dualpipe_v" and micro_batches < 2 * pp:
        out.append(Refusal(
            "dualpipe_v_micro_batches",
            f"pipeline_schedule='dualpipe_v' needs at least 2 x pipeline_parallel = {2 * pp} micro-batches (got "
            f"micro_batches={micro_batches}); raise micro_batches or use pipeline_schedule='zb_v'.",
        ))
    if virtual_stages > 1 and schedule != INTERLEAVED and schedule not in V_SHAPED:
        out.append(Refusal(
            "virtual_stages_need_interleaved",
            f"virtual_stages={virtual_stages} needs pipeline_schedule='interleaved_1f1b' (got {schedule!r}); set the "
            f"schedule or use virtual_stages=1.",
        ))
    if micro_batches is not None and schedule == INTERLEAVED and (micro_batches < pp or micro_batches % pp):
        out.append(Refusal(
            "interleaved_micro_batches",
            f"the interleaved schedule needs micro_batches to be a multiple of pipeline_parallel (and at least as many): "
            f"micro_batches={micro_batches}, pipeline_parallel={pp}; use micro_batches={max(pp, micro_batches // pp * pp)} "
            f"(or another multiple of {pp}), or pipeline_schedule='1f1b'.",
        ))
    if offload_params != "none" and zero_stage != 3:
        out.append(Refusal(
            "offload_params_needs_zero3",
            f"offload_params={offload_params!r} shards parameters and so needs zero_stage=3 (got zero_stage={zero_stage}); "
            f"use offload_optimizer for stages 1-2.",
        ))
    if offload_optimizer != "none" and zero_stage == 0:
        out.append(Refusal(
            "offload_needs_zero",
            f"offload_optimizer={offload_optimizer!r} offloads the ZeRO optimizer's shard and needs zero_stage >= 1 "
            f"(got 0); set zero_stage=1 or 2, or offload_optimizer=None.",
        ))
    pending = [
        (
            "zero3_with_pipeline",
            pp > 1 and zero_stage == 3,
            f"zero_stage=3 with pipeline_parallel > 1 (pipeline_parallel={pp})",
            "ZeRO-3 under pipeline parallelism (parameters would be re-gathered for every micro-batch; DeepSpeed "
            "refuses it too)",
            "use zero_stage=1 or 2, or pipeline_parallel=1",
        ),
        (
            "zero3_with_sequence_parallel",
            zero_stage == 3 and sequence_parallel and tp > 1,
            "zero_stage=3 with sequence_parallel=True",
            "sequence parallelism under ZeRO-3",
            "use zero_stage <= 2, or sequence_parallel=False",
        ),
        (
            "nvme_with_zero3",
            offload_params == "nvme" or (offload_optimizer == "nvme" and zero_stage == 3),
            "NVMe offload with zero_stage=3",
            "NVMe offload of ZeRO-3 parameters",
            "use offload_params='cpu', or zero_stage 1-2 with offload_optimizer='nvme'",
        ),
    ]
    for rule, missing, setting, feature, fix in pending:
        if missing:
            out.append(Refusal(
                rule, f"{setting}: {feature} is not implemented in this version of lightning_3d yet; {fix}.", unsupported=True
            ))
    return out


# -- the model ----------------------------------------------------------------------------------------------
def tensor_parallel_refusals(tp: int, model: ModelLike) -> list[Refusal]:
    """Tensor parallelism splits heads, key/value heads, the hidden size and the MLP width evenly
    (the vocabulary is padded, so it need not divide)."""
    out = []
    if tp <= 1:
        return out
    for key in ("n_head", "n_kv_head", "hidden", "ffn"):
        value = int(getattr(model, key))
        if value % tp:
            out.append(Refusal(
                "tp_divides_model",
                f"{_label(model, key)}={value} is not divisible by tensor_parallel={tp}: tensor parallelism splits "
                f"{_WHAT[key]} evenly; pick a tensor_parallel that divides {value} ({_divisors(value)}).",
            ))
    return out


def expert_refusals(*, tp: int, pp: int, cp: int, model: Any, ep: int = 1, sequence_parallel: bool = False) -> list[Refusal]:
    """Mixture-of-experts layers run under every degree and ZeRO stage: expert parallelism splits the
    routed experts, so it needs some, in a number it divides; under tensor parallelism the experts
    are split over ``ep x tp`` ranks (the same rule).
    (``cp`` and ``pp`` are kept for the callers: the set-up refuses MoE code that is not
    ``lightning_3d.moe`` under any degree.)"""
    experts = getattr(model, "n_experts", 0)
    out = []
    if ep > 1 and not experts:
        out.append(Refusal(
            "expert_parallel_needs_experts",
            f"expert_parallel={ep} splits the experts of mixture-of-experts layers, but the model has none (a dense "
            f"model); use expert_parallel=1, or give the model experts (e.g. GPTConfig(n_experts=...)).",
        ))
    elif ep > 1 and experts % ep:
        out.append(Refusal(
            "expert_parallel_divides_experts",
            f"expert_parallel={ep} must divide the model's {experts} routed experts (n_experts={experts}) so that each "
            f"rank holds whole experts; choose one of {_divisors(experts)}.",
        ))
    if experts and tp > 1 and experts % (ep * tp):
        out.append(Refusal(
            "expert_tensor_parallel_divides_experts",
            f"expert_parallel={ep} x tensor_parallel={tp} = {ep * tp} ranks split the model's {experts} routed experts "
            f"(n_experts={experts}) between them, which it does not divide; choose degrees whose product divides "
            f"{experts} ({_divisors(experts)}).",
        ))
    shared = int(getattr(model, "shared_expert_width", 0) or 0)
    if experts and tp > 1 and shared % tp:
        out.append(Refusal(
            "tensor_parallel_divides_shared_experts",
            f"tensor_parallel={tp} splits the MoE layers' shared experts, of width {shared} (n_shared_experts x "
            f"expert_hidden), which it does not divide; choose one of {_divisors(shared)}.",
        ))
    return out


def pipeline_refusals(pp: int, virtual_stages: int, model: ModelLike) -> list[Refusal]:
    """Every pipeline piece (pp x virtual stages of them) needs at least one layer."""
    pieces = pp * virtual_stages
    if pieces <= 1 or pieces <= model.n_layer:
        return []
    return [Refusal(
        "pipeline_needs_layers",
        f"pipeline_parallel={pp} x virtual_stages={virtual_stages} = {pieces} pieces need at least {pieces} layers, "
        f"but the model has {model.n_layer} ({_label(model, 'n_layer')}={model.n_layer}); lower pipeline_parallel or "
        f"virtual_stages.",
    )]


def sequence_parallel_refusals(tp: int, sequence_parallel: bool, model: Any) -> list[Refusal]:
    """Sequence parallelism splits the sequence over the tensor-parallel ranks (when the training
    sequence length is known: the planner's; the strategy checks each batch)."""
    seq = getattr(model, "seq_len", None)
    if not sequence_parallel or tp <= 1 or seq is None or seq % tp == 0:
        return []
    return [Refusal(
        "sequence_parallel_divides_sequence",
        f"sequence_parallel=True splits the sequence over tensor_parallel={tp} ranks, but the sequence length "
        f"{seq} ({_label(model, 'seq_len')}) is not divisible by {tp}; use sequence_parallel=False or a "
        f"tensor_parallel that divides {seq}.",
    )]


def context_parallel_refusals(
    cp: int, mode: str, tp: int, sequence_parallel: bool, model: Any
) -> list[Refusal]:
    """Context parallelism cuts each sequence into ``2 * cp`` chunks (load-balanced causal layout),
    which sequence parallel then splits over tp; all-to-all mode shards each tensor-parallel rank's
    heads over cp (key/value heads are replicated when cp does not divide them)."""
    if cp <= 1:
        return []
    out = []
    heads = int(getattr(model, "n_head", 0) or 0)
    if mode == "all_to_all" and heads and (heads // max(tp, 1)) % cp:
        local = heads // max(tp, 1)
        out.append(Refusal(
            "all_to_all_divides_heads",
            f"context_parallel_mode='all_to_all' shards attention heads over context_parallel={cp}, but each "
            f"tensor-parallel rank holds {local} heads ({_label(model, 'n_head')}={heads} / tensor_parallel={tp}); "
            f"use context_parallel_mode='ring' (no constraint on heads) or a context_parallel that divides {local}.",
        ))
    seq = getattr(model, "seq_len", None)
    if seq is not None:
        unit = 2 * cp
        if seq % unit or (sequence_parallel and tp > 1 and (seq // cp) % tp):
            need = math.lcm(unit, cp * tp) if sequence_parallel and tp > 1 else unit
            out.append(Refusal(
                "context_parallel_divides_sequence",
                f"context_parallel={cp} cuts each sequence into 2 x {cp} = {unit} equal chunks"
                + (f" whose per-rank share sequence parallel splits over tensor_parallel={tp}" if sequence_parallel and tp > 1 else "")
                + f", but the sequence length is {seq} ({_label(model, 'seq_len')}); use a length divisible by {need}, "
                f"or a smaller context_parallel.",
            ))
    return out


def model_refusals(
    *, tp: int, pp: int, virtual_stages: int = 1, sequence_parallel: bool = False, model: ModelLike,
    tensor_parallel_plan: bool = True, cp: int = 1, context_parallel_mode: str = "ring", ep: int = 1,
) -> list[Refusal]:
    """What the model's shape refuses. ``tensor_parallel_plan=False``: the user brings their own
    plan, so the built-in plans' divisibility does not apply."""
    out = tensor_parallel_refusals(tp, model) if tensor_parallel_plan else []
    out += expert_refusals(tp=tp, pp=pp, cp=cp, model=model, ep=ep, sequence_parallel=sequence_parallel)
    out += context_parallel_refusals(cp, context_parallel_mode, tp, sequence_parallel, model)
    return out + pipeline_refusals(pp, virtual_stages, model) + sequence_parallel_refusals(tp, sequence_parallel, model)


# -- the world and the batch ------------------------------------------------------------------------------
def world_refusals(
    *, dp: Union[int, str, None], tp: int, pp: int, world_size: int, processes_per_node: Optional[int] = None, cp: int = 1,
    ep: int = 1,
) -> list[Refusal]:
    """The degrees must multiply to the world (``dp="auto"``: divide it), expert parallelism must
    divide the dp x cp replicas it is taken from, and tensor-parallel groups must stay inside a node
    (``processes_per_node``; None skips that rule)."""
    try:
        dims = ParallelDims(dp="auto" if dp is None else dp, tp=tp, pp=pp, cp=cp, ep=ep).resolve(world_size)
    except ValueError as err:
        return [Refusal("world_size", str(err))]
    if processes_per_node is None:
        return []
    try:
        dims.check_nodes(processes_per_node)
    except ValueError as err:
        return [Refusal("tensor_parallel_within_node", str(err))]
    return []


def batch_refusals(*, pp: int, micro_batches: Optional[int], per_replica_batch: Optional[int]) -> list[Refusal]:
    """A pipeline splits each replica's batch into ``micro_batches`` equal micro-batches."""
    if pp <= 1 or micro_batches is None or per_replica_batch is None or per_replica_batch % micro_batches == 0:
        return []
    size = per_replica_batch
    return [Refusal(
        "micro_batches_divide_batch",
        f"micro_batches={micro_batches} does not divide the per-replica batch size {size}; choose a divisor of {size} "
        f"or leave micro_batches=None.",
    )]


# -- the built-in tensor-parallel plans' check --------------------------------------------------------------
def layout_refusals(
    *,
    tp: int = 1,
    pp: int = 1,
    dp: Union[int, str, None] = None,
    cp: int = 1,
    context_parallel_mode: str = "ring",
    ep: int = 1,
    zero_stage: int = 0,
    sequence_parallel: bool = False,
    schedule: str = "1f1b",
    virtual_stages: int = 1,
    micro_batches: Optional[int] = None,
    offload_optimizer: str = "none",
    offload_params: str = "none",
    model: Optional[ModelLike] = None,
    tensor_parallel_plan: bool = True,
    world_size: Optional[int] = None,
    processes_per_node: Optional[int] = None,
    per_replica_batch: Optional[int] = None,
) -> list[Refusal]:
    """Every reason the strategy would refuse this layout; the parts whose inputs are None
    (model, world, batch) are skipped."""
    out = feature_refusals(
        tp=tp, pp=pp, zero_stage=zero_stage, sequence_parallel=sequence_parallel, schedule=schedule,
        virtual_stages=virtual_stages, micro_batches=micro_batches, offload_optimizer=offload_optimizer,
        offload_params=offload_params,
    )
    if model is not None:
        out += model_refusals(
            tp=tp, pp=pp, virtual_stages=virtual_stages, sequence_parallel=sequence_parallel, model=model,
            tensor_parallel_plan=tensor_parallel_plan, cp=cp, context_parallel_mode=context_parallel_mode, ep=ep,
        )
    if world_size is not None:
        out += world_refusals(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, world_size=world_size, processes_per_node=processes_per_node)
    out += batch_refusals(pp=pp, micro_batches=micro_batches, per_replica_batch=per_replica_batch)
    return out


def check_tensor_parallel(model: ModelLike, tp: int) -> None:
    """A tensor-parallel plan's check: a model of shape ``model`` (its adapter's ``dims``) can be split
    ``tp`` ways; raises :class:`LayoutRefused` naming every size that does not divide."""
    raise_refusals(tensor_parallel_refusals(tp, model))


def raise_refusals(refusals: list[Refusal], prefix: str = "") -> None:
    """Raise ``NotImplementedError`` if any refusal is an unsupported combination (the strategy's
    historic type for those), else :class:`LayoutRefused` (a ``ValueError``); nothing if empty."""
    if not refusals:
        return
    if any(r.unsupported for r in refusals):
        raise NotImplementedError(prefix + " ".join(r.message for r in refusals))
    raise LayoutRefused(refusals, prefix)
