"""The strategy's configuration: one frozen record of eight groups, validated once.

``ThreeDParallelStrategy``'s keywords are the public surface; :class:`ParallelConfig` takes exactly
those keywords (the one place they are mapped onto the groups, :data:`KEYWORDS`) and everything else
-- the strategy, ``parallelize``, the dry run, the recipes and the CLI -- reads the groups:

* ``layout``     the degrees and how they split the model (dp, tp, pp, cp, ep, sequence parallel, a tp plan)
* ``sharding``   ZeRO stage, offload targets, gradient buckets
* ``pipeline``   schedule, micro-batches, chunks per rank, where stages are cut
* ``recompute``  activation checkpointing
* ``checkpoint`` checkpoint format, asynchronous writes, retention
* ``runtime``    collective timeout, health check, replica check, backend, how ranks start
* ``data``       samples per optimizer step, what an elastic restart may change
* ``compile``    ``torch.compile`` of each transformer block (regional)

Validation lives here, not in the strategy, so that recipes, the CLI and the planner can check a
layout before any process is spawned. Every error names the offending value and the fix.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional, Union

from lightning_3d.core import rank_zero
from lightning_3d.core.layout_rules import (
    CONTEXT_PARALLEL_MODES,
    SCHEDULES,
    V_SHAPED,
    ZERO_BUBBLE,
    ModelLike,
    Refusal,
    batch_refusals,
    layout_refusals,
    model_refusals,
    raise_refusals,
    world_refusals,
)
from lightning_3d.core.dims import Degree, ParallelDims

ACTIVATION_CHECKPOINTING = ("none", "full", "selective")
OFFLOAD_TARGETS = ("none", "cpu", "nvme")
ZERO_STAGES = (0, 1, 2, 3)
CHECKPOINT_FORMATS = ("sharded", "consolidated")
START_METHODS = ("popen", "spawn", "fork", "forkserver")
DEFAULT_TIMEOUT_S = 1800.0
DEFAULT_BUCKET_MB = 25.0
SCHEDULE_ALIASES = {
    "interleaved": "interleaved_1f1b", "fill_drain": "gpipe", "zbh1": "zb_h1", "zero_bubble": "zb_h1",
    "zbv": "zb_v", "dualpipev": "dualpipe_v", "dualpipe": "dualpipe_v",
}
OFF = {None: "none", False: "none"}


def _choice(name: str, value: Any, choices: tuple[str, ...], aliases: dict[Any, str]) -> str:
    key = value.lower() if isinstance(value, str) else value
    if key in aliases:
        return aliases[key]
    if key in choices:
        return key
    raise ValueError(f"{name}={value!r} is not supported; choose one of {', '.join(map(repr, choices))}.")


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} is invalid: it must be a positive integer.")


def _set(record: Any, **values: Any) -> None:
    """Normalise fields of a frozen record in its ``__post_init__``."""
    for name, value in values.items():
        object.__setattr__(record, name, value)


def _to_timedelta(value: Union[float, int, timedelta, None]) -> timedelta:
    if value is None:
        return timedelta(seconds=DEFAULT_TIMEOUT_S)
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise ValueError(f"timeout={value!r} is invalid: give seconds (a number) or a datetime.timedelta.")
    if seconds <= 0:
        raise ValueError(f"timeout={value!r} is invalid: it must be positive (seconds).")
    return timedelta(seconds=seconds)


def _user_stacklevel() -> int:
    """The stack level of the first frame outside lightning_3d (and outside dataclasses' generated
    ``__init__``): a warning about a keyword then names the user's line, whether they built the
    strategy or the configuration."""
    import sys

    package = str(Path(__file__).resolve().parents[1])
    frame, level = sys._getframe(1), 1
    while frame is not None and (frame.f_code.co_filename.startswith(package) or frame.f_code.co_filename.startswith("<")):
        frame, level = frame.f_back, level + 1
    return level  # counted as rank_zero.warn counts: 1 is the caller (the __post_init__)


def parse_replica_check_every(every: Any) -> Union[int, str, None]:
    """``"auto"``, a positive step count, or ``None`` / ``0`` (off); anything else is refused by name."""
    if every is None or every == 0 or every is False:
        return None
    if every == "auto":
        return "auto"
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise ValueError(
            f"replica_check_every={every!r} is invalid: use 'auto' (checks costing under 1% of training), a positive "
            f"number of optimizer steps, or None to turn the check off."
        )
    return every


@dataclass(frozen=True)
class LayoutOptions:
    """The parallel degrees, and how tensor parallelism splits the model."""

    data_parallel: Degree = "auto"
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    context_parallel: int = 1
    context_parallel_mode: str = "ring"
    expert_parallel: int = 1
    sequence_parallel: bool = False
    tensor_parallel_plan: Any = field(default=None, compare=False)  # a TensorParallelPlan, a dict, or None
    dims: ParallelDims = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        # the degrees first: every other rule assumes them valid
        _set(self, dims=ParallelDims(
            dp=self.data_parallel, tp=self.tensor_parallel, pp=self.pipeline_parallel, cp=self.context_parallel,
            ep=self.expert_parallel,
        ))
        mode = _choice("context_parallel_mode", self.context_parallel_mode, CONTEXT_PARALLEL_MODES,
                       {"ulysses": "all_to_all", "a2a": "all_to_all", "p2p": "ring"})
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(f"sequence_parallel={self.sequence_parallel!r} is invalid: use True or False.")
        sequence_parallel = self.sequence_parallel
        if sequence_parallel and self.tensor_parallel == 1:
            rank_zero.warn("sequence_parallel=True has no effect with tensor_parallel=1; disabling it.", stacklevel=_user_stacklevel())
            sequence_parallel = False
        _set(self, context_parallel_mode=mode, sequence_parallel=sequence_parallel)


@dataclass(frozen=True)
class ShardingOptions:
    """What ZeRO shards, where it offloads, and the gradient buckets it communicates in."""

    zero_stage: int = 0
    offload_optimizer: Any = "none"  # "none" | "cpu" | "nvme" (None/False: none, True: cpu)
    offload_params: Any = "none"
    nvme_path: Optional[str] = None
    bucket_size_mb: float = DEFAULT_BUCKET_MB

    def __post_init__(self) -> None:
        if self.zero_stage not in ZERO_STAGES or isinstance(self.zero_stage, bool):
            raise ValueError(f"zero_stage={self.zero_stage!r} is invalid: choose 0, 1, 2 or 3.")
        if isinstance(self.bucket_size_mb, bool) or not isinstance(self.bucket_size_mb, (int, float)) or self.bucket_size_mb <= 0:
            raise ValueError(f"bucket_size_mb={self.bucket_size_mb!r} is invalid: it must be positive.")
        offload = {**OFF, True: "cpu"}
        _set(
            self,
            offload_optimizer=_choice("offload_optimizer", self.offload_optimizer, OFFLOAD_TARGETS, offload),
            offload_params=_choice("offload_params", self.offload_params, OFFLOAD_TARGETS, offload),
        )

    def check_nvme_path(self) -> None:
        """The NVMe directory exists and this user can write there (after the layout rules, which say
        first whether NVMe offload is possible at all)."""
        if "nvme" in (self.offload_optimizer, self.offload_params):
            if not self.nvme_path:
                raise ValueError("offload to 'nvme' needs nvme_path=<a directory on a fast local disk>.")
            problem = nvme_directory_problem(str(self.nvme_path))
            if problem:
                raise ValueError(problem)

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_size_mb * 2**20)


@dataclass(frozen=True)
class PipelineOptions:
    """The pipeline schedule and how the model and the batch are cut for it."""

    schedule: str = "1f1b"
    micro_batches: Optional[int] = None
    virtual_stages: int = 1
    partition: Any = "uniform"  # "uniform" | "parameters" | block indices where stages 2.. start

    def __post_init__(self) -> None:
        schedule = _choice("pipeline_schedule", self.schedule, SCHEDULES, SCHEDULE_ALIASES)
        # the V's two chunks per rank are what the V-shaped schedules are
        _set(self, schedule=schedule, virtual_stages=2 if schedule in V_SHAPED and self.virtual_stages == 1 else self.virtual_stages)
        if self.micro_batches is not None:
            _positive_int("micro_batches", self.micro_batches)
        _positive_int("virtual_stages", self.virtual_stages)


@dataclass(frozen=True)
class RecomputeOptions:
    """Activation checkpointing: which blocks recompute what in backward."""

    mode: Any = "none"  # "none" | "full" | "selective" (None/False: none, True: full)
    every_n_layers: int = 1

    def __post_init__(self) -> None:
        _set(self, mode=_choice("activation_checkpointing", self.mode, ACTIVATION_CHECKPOINTING, {**OFF, True: "full"}))
        _positive_int("checkpoint_every_n_layers", self.every_n_layers)


@dataclass(frozen=True)
class CheckpointOptions:
    """How the strategy writes checkpoints."""

    format: str = "sharded"
    async_save: bool = False
    keep_last_k: Optional[int] = None

    def __post_init__(self) -> None:
        if self.format not in CHECKPOINT_FORMATS:
            raise ValueError(f"checkpoint_format={self.format!r}: use 'sharded' or 'consolidated'.")
        check_keep_last_k(self.keep_last_k)


@dataclass(frozen=True)
class RuntimeOptions:
    """How the ranks start, talk and are watched."""

    timeout: Any = DEFAULT_TIMEOUT_S  # seconds or a timedelta; held as a timedelta
    health_check: bool = True
    replica_check_every: Any = "auto"
    process_group_backend: Optional[str] = None
    start_method: str = "popen"

    def __post_init__(self) -> None:
        if self.start_method not in START_METHODS:
            raise ValueError(f"start_method={self.start_method!r} is invalid: use popen, spawn, fork or forkserver.")
        _set(self, timeout=_to_timedelta(self.timeout), replica_check_every=parse_replica_check_every(self.replica_check_every))


LAYOUT_NAMES = ("dp", "tp", "pp", "cp", "ep", "zero_stage", "virtual_stages")  # what a sharded checkpoint records


@dataclass(frozen=True)
class ElasticPolicy:
    """What a restart may change (docs/elastic.md): at least ``min_data_parallel`` replicas, and of the
    checkpoint's layout only the names in ``may_change`` (``"dp"``: a lost node shrinks data parallelism;
    add ``"tp"``, ``"pp"``, ... where a re-plan, the recipes' ``parallel=auto``, may change them)."""

    min_data_parallel: int = 1
    may_change: tuple[str, ...] = ("dp",)

    def __post_init__(self) -> None:
        m = self.min_data_parallel
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"elastic min_data_parallel={m!r} is invalid: give a positive integer.")
        object.__setattr__(self, "may_change", tuple(self.may_change))
        unknown = sorted(set(self.may_change) - set(LAYOUT_NAMES))
        if unknown:
            raise ValueError(f"elastic may_change={list(self.may_change)}: {unknown} are not layout names; choose among {list(LAYOUT_NAMES)}.")

    def refusal(self, saved: dict[str, Any], current: dict[str, Any]) -> Optional[str]:
        """Why resuming a checkpoint of layout ``saved`` at ``current`` breaks the policy (None: it does not)."""
        changed = [f"{k} {saved.get(k, 1)} -> {current[k]}" for k in LAYOUT_NAMES if k in current and k not in self.may_change
                   and saved.get(k, 1) != current[k]]
        if not changed:
            return None
        return (
            f"elastic policy: this restart changes {', '.join(changed)} from the checkpoint's layout, but the policy lets only "
            f"{list(self.may_change) or 'nothing'} change; run with the checkpoint's degrees, or add them to "
            f"elastic=dict(may_change=[...])."
        )


def _elastic_policy(value: Any) -> Optional[ElasticPolicy]:
    if value is None or isinstance(value, ElasticPolicy):
        return value
    if isinstance(value, Mapping):
        return ElasticPolicy(**dict(value))
    raise ValueError(f"elastic={value!r} is invalid: give an ElasticPolicy, a dict of its fields, or None.")


@dataclass(frozen=True)
class DataOptions:
    """How many samples an optimizer step takes, whatever the data-parallel size, and what a restart may
    change (elastic training)."""

    global_batch_size: Optional[int] = None  # None: the loaders' batches and the Trainer's accumulation decide
    elastic: Any = None  # an ElasticPolicy (a dict of its fields is taken); None: any restart layout reshards

    def __post_init__(self) -> None:
        g = self.global_batch_size
        if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g < 1):
            raise ValueError(f"global_batch_size={g!r} is invalid: give the samples per optimizer step (a positive integer), or None.")
        _set(self, elastic=_elastic_policy(self.elastic))


COMPILE_KEYS = ("backend", "mode", "fullgraph", "dynamic", "options")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def _compile_keywords(value: Any) -> Optional[dict[str, Any]]:
    """``compile=``: ``False``/``None``/``"off"`` (off), ``True`` (inductor), a backend name, or a dict of
    ``torch.compile`` keywords; held as that dict (or None)."""
    if value is None or value is False or (isinstance(value, str) and value.lower() in ("none", "off", "false", "")):
        return None
    if value is True or (isinstance(value, str) and value.lower() in ("true", "on")):
        value = {}
    elif isinstance(value, str):
        value = {"backend": value}
    if not isinstance(value, Mapping):
        raise ValueError(f"compile={value!r} is invalid: give True, a backend name, a dict of torch.compile keywords, or False.")
    unknown = sorted(set(value) - set(COMPILE_KEYS))
    if unknown:
        raise ValueError(f"compile={dict(value)!r}: {unknown} are not torch.compile keywords used per block; give {list(COMPILE_KEYS)}.")
    out = {"backend": "inductor", **dict(value)}
    backend = out["backend"]
    if isinstance(backend, str):
        _check_backend_name(backend)
    elif not callable(backend):
        raise ValueError(f"compile backend={backend!r} is invalid: give a backend name ('inductor', 'aot_eager') or a callable.")
    cudagraph_options = [k for k in ("triton.cudagraphs",) if (out.get("options") or {}).get(k)]
    if out.get("mode") in CUDA_GRAPH_MODES or backend == "cudagraphs" or cudagraph_options:
        what = f"mode={out.get('mode')!r}" if out.get("mode") in CUDA_GRAPH_MODES else (
            f"options {cudagraph_options}" if cudagraph_options else "backend='cudagraphs'")
        raise ValueError(
            f"compile {what} records CUDA graphs, which need every input at a fixed address; ZeRO re-gathers "
            f"parameters and the pipeline receives activations into fresh buffers. Use mode='max-autotune-no-cudagraphs' "
            f"or mode='default', with the 'inductor' backend."
        )
    return out


def _check_backend_name(name: str) -> None:
    """A backend torch.compile knows, checked before any process starts (not at the first step)."""
    if name in ("inductor", "aot_eager", "eager"):
        return
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=())
    if name not in known:
        raise ValueError(f"compile backend={name!r} is not a torch.compile backend here; choose one of {sorted(known)}.")


@dataclass(frozen=True)
class CompileOptions:
    """``torch.compile`` of each transformer block after the layout is applied (regional, as torchtitan
    does): the blocks of one model share one compiled graph; our communication stays outside it
    (:mod:`lightning_3d.core.eager`)."""

    blocks: Any = None  # None/False: off; True: inductor; a backend name; a dict of torch.compile keywords

    def __post_init__(self) -> None:
        _set(self, blocks=_compile_keywords(self.blocks))

    @property
    def enabled(self) -> bool:
        return self.blocks is not None

    def refusals(self, layout: LayoutOptions, pipeline: PipelineOptions) -> list[Refusal]:
        """What compiled blocks cannot do in this layout (none when compilation is off)."""
        return compile_refusals(
            self.blocks, pp=layout.pipeline_parallel, schedule=pipeline.schedule,
            tp=layout.tensor_parallel, cp=layout.context_parallel, ep=layout.expert_parallel,
        )


def compile_refusals(blocks: Optional[dict[str, Any]], *, pp: int, schedule: str, tp: int, cp: int, ep: int) -> list[Refusal]:
    """The layout rules of ``compile=`` (``blocks``: :class:`CompileOptions`' keywords, None when off),
    on the degrees alone: the strategy's and ``parallel=auto``'s (which skips the layouts refused here)."""
    if blocks is None:
        return []
    out = []
    if pp > 1 and schedule in ZERO_BUBBLE:
        out.append(Refusal("compile_zero_bubble", (
            f"compile with pipeline_schedule={schedule!r} is not supported: the zero-bubble schedules split each "
            f"linear layer's backward into its input and weight halves at run time, and a compiled block's backward is "
            f"one graph; use pipeline_schedule='1f1b' or 'interleaved_1f1b' with compile, or compile=False."
        ), unsupported=True))
    talking = {n: d for n, d in (("tensor_parallel", tp), ("context_parallel", cp), ("expert_parallel", ep)) if d > 1}
    if blocks.get("fullgraph") and talking:
        out.append(Refusal("compile_fullgraph", (
            f"compile fullgraph=True with {', '.join(f'{n}={d}' for n, d in talking.items())}: the blocks' collectives run "
            f"between compiled graphs (each is a graph break), so a block cannot be one graph; use fullgraph=False."
        )))
    return out


GROUPS: dict[str, type] = {
    "layout": LayoutOptions, "sharding": ShardingOptions, "pipeline": PipelineOptions,
    "recompute": RecomputeOptions, "checkpoint": CheckpointOptions, "runtime": RuntimeOptions, "data": DataOptions,
    "compile": CompileOptions,
}
# The strategy's keyword -> (group, field): the one place the public names meet the groups.
KEYWORDS: dict[str, tuple[str, str]] = {
    **{f.name: ("layout", f.name) for f in fields(LayoutOptions) if f.init},
    **{f.name: ("sharding", f.name) for f in fields(ShardingOptions)},
    "pipeline_schedule": ("pipeline", "schedule"),
    "micro_batches": ("pipeline", "micro_batches"),
    "virtual_stages": ("pipeline", "virtual_stages"),
    "pipeline_partition": ("pipeline", "partition"),
    "activation_checkpointing": ("recompute", "mode"),
    "checkpoint_every_n_layers": ("recompute", "every_n_layers"),
    "checkpoint_format": ("checkpoint", "format"),
    "async_checkpoint": ("checkpoint", "async_save"),
    "keep_last_k": ("checkpoint", "keep_last_k"),
    **{f.name: ("runtime", f.name) for f in fields(RuntimeOptions)},
    "global_batch_size": ("data", "global_batch_size"),
    "elastic": ("data", "elastic"),
    "compile": ("compile", "blocks"),
}


@dataclass(frozen=True, init=False)
class ParallelConfig:
    """Everything ``ThreeDParallelStrategy`` is configured with besides Lightning's own plugins.

    Built from the strategy's keywords (``ParallelConfig(tensor_parallel=2, zero_stage=1)``) and
    frozen: :meth:`replace` makes a changed copy, validated again."""

    layout: LayoutOptions
    sharding: ShardingOptions
    pipeline: PipelineOptions
    recompute: RecomputeOptions
    checkpoint: CheckpointOptions
    runtime: RuntimeOptions
    data: DataOptions
    compile: CompileOptions

    def __init__(self, **keywords: Any) -> None:
        unknown = sorted(set(keywords) - set(KEYWORDS))
        if unknown:
            raise TypeError(f"ParallelConfig got unknown keyword(s) {unknown}; the keywords are the strategy's: {sorted(KEYWORDS)}.")
        grouped: dict[str, dict[str, Any]] = {name: {} for name in GROUPS}
        for key, value in keywords.items():
            group, name = KEYWORDS[key]
            grouped[group][name] = value
        for name, cls in GROUPS.items():  # layout first: its degrees are checked before anything else
            object.__setattr__(self, name, cls(**grouped[name]))
        raise_refusals([r for r in self.refusals() if not r.unsupported])
        self.sharding.check_nvme_path()

    @property
    def dims(self) -> ParallelDims:
        """The degrees (``dp`` may still be ``"auto"``: :meth:`check_world` resolves it)."""
        return self.layout.dims

    def keywords(self) -> dict[str, Any]:
        """The strategy keywords this configuration was built from (normalised): the inverse of the mapping."""
        return {key: getattr(getattr(self, group), name) for key, (group, name) in KEYWORDS.items()}

    def replace(self, **keywords: Any) -> "ParallelConfig":
        return ParallelConfig(**{**self.keywords(), **keywords})

    def to_dict(self) -> dict[str, Any]:
        """The keywords as plain values (the timeout in seconds; a plan object as its text), e.g. for a
        run summary."""
        out = self.keywords()
        out["timeout"] = self.runtime.timeout.total_seconds()
        plan = out["tensor_parallel_plan"]
        out["tensor_parallel_plan"] = plan if plan is None or isinstance(plan, dict) else repr(plan)
        return out

    def check_world(self, world_size: int, processes_per_node: int) -> ParallelDims:
        """Resolve the degrees against the world; raise ``ValueError`` before any rank does work."""
        layout = self.layout
        raise_refusals(
            world_refusals(
                dp=layout.data_parallel, tp=layout.tensor_parallel, pp=layout.pipeline_parallel, cp=layout.context_parallel,
                world_size=world_size, processes_per_node=processes_per_node, ep=layout.expert_parallel,
            )
        )
        dims = self.dims.resolve(world_size)
        policy = self.data.elastic
        if policy is not None and dims.dp < policy.min_data_parallel:
            raise ValueError(
                f"elastic policy: this start has data_parallel={dims.dp} ({world_size} processes), below its "
                f"min_data_parallel={policy.min_data_parallel}; start on more nodes, or lower min_data_parallel."
            )
        return dims

    def require_implemented(self) -> None:
        """Refuse, clearly, the combinations this version does not implement (``NotImplementedError``)."""
        raise_refusals([r for r in self.refusals() if r.unsupported])

    def refusals(
        self,
        model: Optional[ModelLike] = None,
        world_size: Optional[int] = None,
        processes_per_node: Optional[int] = None,
        per_replica_batch: Optional[int] = None,
        tensor_parallel_plan: bool = True,
    ) -> list[Refusal]:
        """Every reason this layout cannot run (:mod:`lightning_3d.core.layout_rules`, the rules the
        planner uses too); the model, world and batch parts only when those are given."""
        layout, pipeline, sharding = self.layout, self.pipeline, self.sharding
        return layout_refusals(
            tp=layout.tensor_parallel, pp=layout.pipeline_parallel, dp=layout.data_parallel, cp=layout.context_parallel,
            context_parallel_mode=layout.context_parallel_mode, zero_stage=sharding.zero_stage, ep=layout.expert_parallel,
            sequence_parallel=layout.sequence_parallel, schedule=pipeline.schedule, virtual_stages=pipeline.virtual_stages,
            micro_batches=pipeline.micro_batches, offload_optimizer=sharding.offload_optimizer,
            offload_params=sharding.offload_params, model=model, tensor_parallel_plan=tensor_parallel_plan,
            world_size=world_size, processes_per_node=processes_per_node, per_replica_batch=per_replica_batch,
        ) + self.compile.refusals(layout, pipeline)

    def _model_refusals(self, model: ModelLike, tensor_parallel_plan: bool) -> list[Refusal]:
        layout = self.layout
        return model_refusals(
            tp=layout.tensor_parallel, pp=layout.pipeline_parallel, virtual_stages=self.pipeline.virtual_stages,
            sequence_parallel=layout.sequence_parallel, model=model, tensor_parallel_plan=tensor_parallel_plan,
            cp=layout.context_parallel, context_parallel_mode=layout.context_parallel_mode, ep=layout.expert_parallel,
        )

    def check_models(self, models: Iterable[tuple[str, ModelLike]], tensor_parallel_plan: bool = True) -> None:
        """At set-up, before anything is sharded: refuse, with every reason at once, a layout that the
        shapes of the models found in the LightningModule ((name, shape) pairs: the model adapters'
        ``models_in``) cannot take. ``tensor_parallel_plan=False``: the user's own plan decides what
        tensor parallelism splits."""
        reasons = []
        for name, dims in models:
            where = f"model {name!r}: " if name else ""
            reasons += [replace(r, message=where + r.message) for r in self._model_refusals(dims, tensor_parallel_plan)]
        raise_refusals(reasons)

    def check_batch(self, per_replica_batch: Optional[int]) -> None:
        """Before the first step: the pipeline's micro-batch count must split each replica's batch."""
        raise_refusals(
            batch_refusals(pp=self.layout.pipeline_parallel, micro_batches=self.pipeline.micro_batches, per_replica_batch=per_replica_batch)
        )


def check_accumulation(accumulate: Any) -> None:
    """``Trainer(accumulate_grad_batches=...)``: a whole number of batches per optimizer step."""
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise ValueError(
            f"Trainer(accumulate_grad_batches={accumulate!r}) is invalid: it is the number of batches whose "
            f"gradients make one optimizer step, a whole number >= 1 (1: no accumulation)."
        )


def check_world_size_variable(given: Optional[str], processes: int, nodes: int) -> None:
    """A hand-set WORLD_SIZE that disagrees with devices x num_nodes would be ignored in silence: the job
    would run at another size than the one asked for. Refused, naming both (launchers set it to the world).
    ``given``: the variable, or None when unset or when torchrun / SLURM read it themselves."""
    world = processes * nodes
    if given is None:
        return
    if not given.isdigit() or int(given) != world:
        raise ValueError(
            f"WORLD_SIZE={given} is set in the environment, but this Trainer starts devices x num_nodes = "
            f"{processes} x {nodes} = {world} processes and would ignore it; unset WORLD_SIZE, "
            f"or set devices / num_nodes to match (under torchrun or SLURM their variables decide)."
        )


def check_keep_last_k(keep_last_k: Any) -> None:
    """``None`` (keep every checkpoint) or a positive integer; checked where the strategy is built."""
    if keep_last_k is not None and (isinstance(keep_last_k, bool) or not isinstance(keep_last_k, int) or keep_last_k < 1):
        raise ValueError(f"keep_last_k={keep_last_k!r} must be at least 1 (or None to keep every checkpoint).")


def nvme_directory_problem(directory: str) -> Optional[str]:
    """Why ``directory`` cannot hold NVMe offload files -- missing, not a directory, not writable by
    this user -- or None. Writability is tested by creating (and removing) a file there, so read-only
    mounts and ACLs are caught too, not only the permission bits."""
    root = Path(directory)
    if not root.exists():
        return (
            f"nvme_path={directory!r} does not exist; create it on a fast local disk (an NVMe drive), e.g. "
            f"`mkdir -p {directory}`, or fix the path."
        )
    if not root.is_dir():
        return f"nvme_path={directory!r} does not exist as a directory (it is a file); point nvme_path at a directory."
    fix = "fix its permissions (chmod/chown) or choose a directory on a local disk this user can write"
    if not os.access(root, os.W_OK | os.X_OK):
        return f"nvme_path={directory!r} is not writable by this user (uid {os.getuid()}); {fix}."
    try:
        fd, probe = tempfile.mkstemp(prefix=".lightning_3d_write_test_", dir=root)
    except OSError as err:
        return f"nvme_path={directory!r} is not writable: creating a file there failed ({err.strerror}); {fix}."
    os.close(fd)
    os.unlink(probe)
    return None
