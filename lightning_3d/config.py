"""The strategy's keywords as one validated dataclass.

Validation lives here, not in the strategy, so that recipes, the CLI and the planner can
check a layout before any process is spawned. Every error names the offending value and
the fix.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from typing import Any, Optional, Union

from lightning_3d import rank_zero
from lightning_3d.layout_rules import (
    CONTEXT_PARALLEL_MODES,
    V_SHAPED,
    ModelLike,
    Refusal,
    batch_refusals,
    layout_refusals,
    model_refusals,
    raise_refusals,
    world_refusals,
)
from lightning_3d.topology import Degree, ParallelDims

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_v", "dualpipe_v")
ACTIVATION_CHECKPOINTING = ("none", "full", "selective")
OFFLOAD_TARGETS = ("none", "cpu", "nvme")
ZERO_STAGES = (0, 1, 2, 3)
DEFAULT_TIMEOUT_S = 1800.0


def _normalize_choice(name: str, value: Any, choices: tuple[str, ...], aliases: dict[Any, str]) -> str:
    key = value.lower() if isinstance(value, str) else value
    if key in aliases:
        return aliases[key]
    if key in choices:
        return key
    raise ValueError(f"{name}={value!r} is not supported; choose one of {', '.join(map(repr, choices))}.")


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} is invalid: it must be a positive integer.")


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


@dataclass
class ParallelConfig:
    """Everything ``ThreeDParallelStrategy`` is configured with besides Lightning's own plugins."""

    data_parallel: Degree = "auto"
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    zero_stage: int = 0
    sequence_parallel: bool = False
    pipeline_schedule: str = "1f1b"
    micro_batches: Optional[int] = None
    virtual_stages: int = 1
    activation_checkpointing: Optional[Union[str, bool]] = None
    offload_optimizer: Optional[Union[str, bool]] = None
    offload_params: Optional[Union[str, bool]] = None
    nvme_path: Optional[str] = None
    checkpoint_every_n_layers: int = 1
    timeout: Union[float, int, timedelta, None] = DEFAULT_TIMEOUT_S
    context_parallel: int = 1
    context_parallel_mode: str = "ring"
    dims: ParallelDims = field(init=False)

    def __post_init__(self) -> None:
        self.dims = ParallelDims(
            dp=self.data_parallel, tp=self.tensor_parallel, pp=self.pipeline_parallel, cp=self.context_parallel
        )
        self.context_parallel_mode = _normalize_choice(
            "context_parallel_mode", self.context_parallel_mode, CONTEXT_PARALLEL_MODES,
            {"ulysses": "all_to_all", "a2a": "all_to_all", "p2p": "ring"},
        )
        if self.zero_stage not in ZERO_STAGES or isinstance(self.zero_stage, bool):
            raise ValueError(f"zero_stage={self.zero_stage!r} is invalid: choose 0, 1, 2 or 3.")
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(f"sequence_parallel={self.sequence_parallel!r} is invalid: use True or False.")
        self.pipeline_schedule = _normalize_choice(
            "pipeline_schedule",
            self.pipeline_schedule,
            PIPELINE_SCHEDULES,
            {
                "interleaved": "interleaved_1f1b", "fill_drain": "gpipe", "zbh1": "zb_h1", "zero_bubble": "zb_h1",
                "zbv": "zb_v", "dualpipev": "dualpipe_v", "dualpipe": "dualpipe_v",
            },
        )
        if self.pipeline_schedule in V_SHAPED and self.virtual_stages == 1:
            self.virtual_stages = 2  # the V's two chunks per rank are what these schedules are
        if self.micro_batches is not None:
            _positive_int("micro_batches", self.micro_batches)
        _positive_int("virtual_stages", self.virtual_stages)
        _positive_int("checkpoint_every_n_layers", self.checkpoint_every_n_layers)
        self.activation_checkpointing = _normalize_choice(
            "activation_checkpointing",
            self.activation_checkpointing,
            ACTIVATION_CHECKPOINTING,
            {None: "none", False: "none", True: "full"},
        )
        self.offload_optimizer = _normalize_choice(
            "offload_optimizer", self.offload_optimizer, OFFLOAD_TARGETS, {None: "none", False: "none", True: "cpu"}
        )
        self.offload_params = _normalize_choice(
            "offload_params", self.offload_params, OFFLOAD_TARGETS, {None: "none", False: "none", True: "cpu"}
        )
        if self.sequence_parallel and self.tensor_parallel == 1:
            rank_zero.warn("sequence_parallel=True has no effect with tensor_parallel=1; disabling it.", stacklevel=3)
            self.sequence_parallel = False
        self.timeout = _to_timedelta(self.timeout)
        invalid = [r for r in self.refusals() if not r.unsupported]
        raise_refusals(invalid)
        self._check_nvme_path()

    def check_world(self, world_size: int, processes_per_node: int) -> ParallelDims:
        """Resolve the degrees against the world; raise ``ValueError`` before any rank does work."""
        raise_refusals(
            world_refusals(
                dp=self.data_parallel, tp=self.tensor_parallel, pp=self.pipeline_parallel, cp=self.context_parallel,
                world_size=world_size, processes_per_node=processes_per_node,
            )
        )
        return self.dims.resolve(world_size)

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
        """Every reason this layout cannot run (:mod:`lightning_3d.layout_rules`, the rules the
        planner uses too); the model, world and batch parts only when those are given."""
        return layout_refusals(
            tp=self.tensor_parallel,
            pp=self.pipeline_parallel,
            dp=self.data_parallel,
            cp=self.context_parallel,
            context_parallel_mode=self.context_parallel_mode,
            zero_stage=self.zero_stage,
            sequence_parallel=self.sequence_parallel,
            schedule=self.pipeline_schedule,
            virtual_stages=self.virtual_stages,
            micro_batches=self.micro_batches,
            offload_optimizer=str(self.offload_optimizer),
            offload_params=str(self.offload_params),
            model=model,
            tensor_parallel_plan=tensor_parallel_plan,
            world_size=world_size,
            processes_per_node=processes_per_node,
            per_replica_batch=per_replica_batch,
        )

    def check_models(self, models: Iterable[tuple[str, ModelLike]], tensor_parallel_plan: bool = True) -> None:
        """At set-up, before anything is sharded: refuse, with every reason at once, a layout that the
        shapes of the models found in the LightningModule ((name, shape) pairs: the model adapters'
        ``models_in``) cannot take. ``tensor_parallel_plan=False``: the user's own plan decides what
        tensor parallelism splits."""
        reasons = []
        for name, dims in models:
            found = model_refusals(
                tp=self.tensor_parallel,
                pp=self.pipeline_parallel,
                virtual_stages=self.virtual_stages,
                sequence_parallel=self.sequence_parallel,
                model=dims,
                tensor_parallel_plan=tensor_parallel_plan,
                cp=self.context_parallel,
                context_parallel_mode=self.context_parallel_mode,
            )
            where = f"model {name!r}: " if name else ""
            reasons += [replace(r, message=where + r.message) for r in found]
        raise_refusals(reasons)

    def check_batch(self, per_replica_batch: Optional[int]) -> None:
        """Before the first step: the pipeline's micro-batch count must split each replica's batch."""
        raise_refusals(
            batch_refusals(pp=self.pipeline_parallel, micro_batches=self.micro_batches, per_replica_batch=per_replica_batch)
        )

    def _check_nvme_path(self) -> None:
        """At construction (before any rank starts): the NVMe directory exists and this user can write there."""
        if "nvme" not in (self.offload_optimizer, self.offload_params):
            return
        if not self.nvme_path:
            raise ValueError("offload to 'nvme' needs nvme_path=<a directory on a fast local disk>.")
        from lightning_3d.zero.offload import nvme_directory_problem

        problem = nvme_directory_problem(str(self.nvme_path))
        if problem:
            raise ValueError(problem)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("dims")
        out["timeout"] = self.timeout.total_seconds()
        return out
