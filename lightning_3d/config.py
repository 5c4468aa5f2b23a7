"""The strategy's keywords as one validated dataclass.

Validation lives here, not in the strategy, so that recipes, the CLI and the planner can
check a layout before any process is spawned. Every error names the offending value and
the fix.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any, Optional, Union

from lightning_3d.topology import Degree, ParallelDims

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
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
    dims: ParallelDims = field(init=False)

    def __post_init__(self) -> None:
        self.dims = ParallelDims(dp=self.data_parallel, tp=self.tensor_parallel, pp=self.pipeline_parallel)
        if self.zero_stage not in ZERO_STAGES or isinstance(self.zero_stage, bool):
            raise ValueError(f"zero_stage={self.zero_stage!r} is invalid: choose 0, 1, 2 or 3.")
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(f"sequence_parallel={self.sequence_parallel!r} is invalid: use True or False.")
        self.pipeline_schedule = _normalize_choice(
            "pipeline_schedule",
            self.pipeline_schedule,
            PIPELINE_SCHEDULES,
            {"interleaved": "interleaved_1f1b", "fill_drain": "gpipe"},
        )
        if self.micro_batches is not None:
            _positive_int("micro_batches", self.micro_batches)
        _positive_int("virtual_stages", self.virtual_stages)
        _positive_int("checkpoint_every_n_layers", self.checkpoint_every_n_layers)
        if self.micro_batches is not None and self.pipeline_schedule == "interleaved_1f1b":
            if self.micro_batches < self.pipeline_parallel or self.micro_batches % self.pipeline_parallel:
                raise ValueError(
                    f"the interleaved schedule needs micro_batches to be a multiple of pipeline_parallel (and at least "
                    f"as many): micro_batches={self.micro_batches}, pipeline_parallel={self.pipeline_parallel}."
                )
        if self.virtual_stages > 1 and self.pipeline_schedule != "interleaved_1f1b":
            raise ValueError(
                f"virtual_stages={self.virtual_stages} needs pipeline_schedule='interleaved_1f1b' "
                f"(got {self.pipeline_schedule!r}); set the schedule or use virtual_stages=1."
            )
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
        if "nvme" in (self.offload_optimizer, self.offload_params) and not self.nvme_path:
            raise ValueError("offload to 'nvme' needs nvme_path=<a directory on a fast local disk>.")
        if self.offload_params != "none" and self.zero_stage != 3:
            raise ValueError(
                f"offload_params={self.offload_params!r} shards parameters and so needs zero_stage=3 "
                f"(got zero_stage={self.zero_stage}); use offload_optimizer for stages 1-2."
            )
        if self.offload_optimizer != "none" and self.zero_stage == 0:
            raise ValueError(
                f"offload_optimizer={self.offload_optimizer!r} offloads the ZeRO optimizer's shard and needs "
                f"zero_stage >= 1 (got 0)."
            )
        if self.sequence_parallel and self.tensor_parallel == 1:
            warnings.warn("sequence_parallel=True has no effect with tensor_parallel=1; disabling it.", stacklevel=3)
            self.sequence_parallel = False
        self.timeout = _to_timedelta(self.timeout)

    def check_world(self, world_size: int, processes_per_node: int) -> ParallelDims:
        """Resolve the degrees against the world; raise ``ValueError`` before any rank does work."""
        dims = self.dims.resolve(world_size)
        dims.check_nodes(processes_per_node)
        return dims

    def require_implemented(self) -> None:
        """Refuse, clearly, the features that later milestones add."""
        pending = [
            (
                self.pipeline_parallel > 1 and self.zero_stage == 3,
                "zero_stage=3 with pipeline_parallel > 1",
                "ZeRO-3 under pipeline parallelism (parameters would be re-gathered for every micro-batch; "
                "DeepSpeed refuses it too): use zero_stage=1 or 2",
            ),
            (
                self.zero_stage == 3 and self.sequence_parallel,
                "zero_stage=3 with sequence_parallel=True",
                "sequence parallelism under ZeRO-3 (use zero_stage <= 2, or sequence_parallel=False)",
            ),
            (
                self.offload_params == "nvme" or (self.offload_optimizer == "nvme" and self.zero_stage == 3),
                "NVMe offload with zero_stage=3",
                "NVMe offload of ZeRO-3 parameters (use offload_params='cpu', or zero_stage 1-2 with "
                "offload_optimizer='nvme')",
            ),
        ]
        for missing, setting, feature in pending:
            if missing:
                raise NotImplementedError(
                    f"{setting}: {feature} is not implemented in this version of lightning_3d yet. "
                    f"Data, tensor and pipeline parallelism with ZeRO stages 0-3, CPU offload and NVMe offload "
                    f"of optimizer state (stages 1-2) are."
                )

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("dims")
        out["timeout"] = self.timeout.total_seconds()
        return out
