"""docs/errors.md is true and stays true: every row's refusal is triggered by a test.

Rows whose test column is ``tests/test_errors_table.py::test_refusal[<id>]`` are triggered here,
in this process, by ``REFUSALS[<id>]``: construction-time checks, pure functions, crafted
directories, small stand-ins for a Trainer. :func:`test_refusal` checks that the refusal happens
with the kind the table names (exception class, warning class or CLI exit status) and that the
table's excerpt is a substring of the real message. Rows that need a multi-rank world (set-up and
step time) name an existing test; :func:`test_rows_tested_elsewhere_name_a_real_test` checks that
the test function exists in that file and that the file contains the excerpt verbatim, so a
renamed test or a changed message fails here.

Adding a row: one line in docs/errors.md and, for an in-process row, one line in ``REFUSALS``.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import re
import tempfile
import warnings
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, NamedTuple, Optional

import lightning as L
import numpy as np
import pytest
import torch
from torch import nn

from lightning_3d import ParallelConfig, ThreeDParallelStrategy
from lightning_3d.apps.plan_cli import parse_layout
from lightning_3d.checkpoint import AtomicCheckpointIO
from lightning_3d.checkpoint.sharded import FORMAT, CheckpointError, ShardedCheckpoint, _crc32, latest_complete, read_manifest
from lightning_3d.core.compose import compose_config
from lightning_3d.core.model_shape import ModelShape
from lightning_3d.data import TextDataModule, TokenWindows
from lightning_3d.data.corpus import prepare_byte_tokens, read_token_file, split_tokens
from lightning_3d.models import GPT, GPTConfig, GPTModule
from lightning_3d.models.adapters.gpt import gpt_plan
from lightning_3d.models.adapters.hf_sequence import hf_inputs as _hf_inputs
from lightning_3d.parallel.parallelize import apply_activation_checkpointing
from lightning_3d.pipeline.partition import partition
from lightning_3d.planner import problem_from_config
from lightning_3d.planner.hardware import ClusterSpec, DeviceSpec, load_cluster
from lightning_3d.planner.memory import zero_model_state_bytes
from lightning_3d.planner.search import Planner, Problem, best_completion
from lightning_3d.plugins.precision import DynamicLossScaler, ThreeDPrecision, global_grad_norm
from lightning_3d.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from lightning_3d.tensor_parallel.plans import PlanContext, TensorParallelPlan, apply_plan
from lightning_3d.transforms.activation_checkpointing import attention_of
from lightning_3d.zero.coordinator import ZeroCoordinator
from lightning_3d.zero.fsdp import apply_zero3
from lightning_3d.zero.offload import ChunkAdam, NVMeStateStore
from lightning_3d.zero.optimizer_kinds import check_optimizer_layout
from lightning_3d.zero.sharded_optimizer import ZeroOptimizer

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "docs" / "errors.md"
THIS_FILE = "tests/test_errors_table.py"
FIRES_AT = ("construction", "set-up", "step", "CLI")

# -- what a trigger returns: (kinds, message) per refusal it observed; kinds are the exception or warning -------
# class and its bases (the table may name a base: `ValueError` for a subclass), or ("exit <status>",) for the CLI.
Observed = list[tuple[tuple[str, ...], str]]


def _kinds(cls: type) -> tuple[str, ...]:
    return tuple(c.__name__ for c in cls.__mro__ if c is not object)


def raises(exc: type[BaseException], call: Callable[[], Any]) -> Callable[[], Observed]:
    """``call()`` must raise ``exc`` (or a subclass); observed: its classes and message."""

    def trigger() -> Observed:
        with pytest.raises(exc) as info:
            call()
        return [(_kinds(type(info.value)), str(info.value))]

    return trigger


def warns(call: Callable[[], Any]) -> Callable[[], Observed]:
    """``call()`` must warn; observed: every warning's classes and message."""

    def trigger() -> Observed:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call()
        assert caught, "no warning was emitted"
        return [(_kinds(w.category), str(w.message)) for w in caught]

    return trigger


def exits(argv: list[str], code: int = 2) -> Callable[[], Observed]:
    """``lightning-3d ARGV`` must end with ``code``; observed: ``("exit <code>", stderr)``."""

    def trigger() -> Observed:
        from lightning_3d.apps.cli import main

        err, out = io.StringIO(), io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                status: Any = main(argv)
            except SystemExit as stop:  # argparse errors
                status = stop.code
        assert status == code, f"lightning-3d {' '.join(argv)} exited {status!r}, expected {code}; stderr: {err.getvalue()}"
        return [((f"exit {code}",), err.getvalue())]

    return trigger


# -- small stand-ins -------------------------------------------------------------------------------------------
def trainer(strategy: ThreeDParallelStrategy, devices: int = 2, **kwargs: Any) -> L.Trainer:
    """Trainer construction only: the layout is checked here, no process is started."""
    return L.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, **kwargs,
    )


def on_train_start(strategy: ThreeDParallelStrategy, loader: torch.utils.data.DataLoader) -> None:
    """The strategy's own before-step-1 check, with a stand-in for the module whose trainer holds ``loader``."""
    fit_loop = SimpleNamespace(_combined_loader=SimpleNamespace(flattened=[loader]))
    strategy.connect(SimpleNamespace(trainer=SimpleNamespace(fit_loop=fit_loop)))  # type: ignore[arg-type]
    strategy.on_train_start()


def apply_pipeline(module: nn.Module) -> None:
    from lightning_3d.parallel.parallelize import apply_pipeline as split

    split(module, None, ParallelConfig(pipeline_parallel=2))  # type: ignore[arg-type]  # refused before the topology is read


def with_world_size(value: str) -> None:
    import os

    previous = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = value
    try:
        trainer(ThreeDParallelStrategy(), devices=2)
    finally:
        if previous is None:
            os.environ.pop("WORLD_SIZE", None)
        else:
            os.environ["WORLD_SIZE"] = previous


def _accumulation(global_batch: int, batch_size: int, replicas: int, current: int) -> int:
    from torch.utils.data import DataLoader

    from lightning_3d.data.sampler import accumulation_for

    return accumulation_for(global_batch, DataLoader(list(range(64)), batch_size=batch_size), replicas, current)


def hf_model(kind: str) -> nn.Module:
    import transformers

    from tests.hf_families import hf_family_config

    return transformers.AutoModelForCausalLM.from_config(hf_family_config(kind))


def hf_plan(kind: str, plan: Optional[dict[str, str]] = None) -> None:
    from lightning_3d.models.adapters.hf_plans import translate_tp_plan

    model = hf_model(kind)
    translate_tp_plan(model, model.tp_plan if plan is None else plan)


def ring(**kwargs: Any) -> Any:
    from lightning_3d.context_parallel.apply import ContextParallel

    q = torch.zeros(1, 2, 4, 8)
    return ContextParallel(None, 2, 0, "ring").attention(q, q, q, **kwargs)


def hf_context_parallel(model: Any, mode: str = "ring") -> None:
    from lightning_3d.context_parallel.apply import ContextParallel
    from lightning_3d.models.adapters.hf_context_parallel import wire_context_parallel

    wire_context_parallel(hf_model(model) if isinstance(model, str) else model, ContextParallel(None, 2, 0, mode))


def hf_config_model(config_class: str, **config: Any) -> nn.Module:
    import transformers

    return transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_class)(vocab_size=64, hidden_size=32, **config))


def hf_attention_with(**kwargs: Any) -> Any:
    from lightning_3d.context_parallel.apply import ContextParallel
    from lightning_3d.models.adapters.hf_context_parallel import CP_ATTR, context_parallel_attention

    module = nn.Module()
    setattr(module, CP_ATTR, ContextParallel(None, 2, 0, "all_to_all"))
    q = torch.zeros(1, 2, 4, 8)
    return context_parallel_attention(module, q, q, q, None, **kwargs)


def hf_capture() -> Any:
    from lightning_3d.models.adapters.hf_sequence import _Capture

    capture = _Capture("OddForCausalLM")
    capture.visit(0, 2, torch.zeros(1, 4, 4), (), {})
    return capture  # the next layer gets another shape: the family's loop is not a plain sequence


def hf_before_split() -> None:
    from lightning_3d.models.adapters.hf_context_parallel import before_split

    before_split((), {"input_ids": torch.zeros(2, 8, dtype=torch.long), "attention_mask": torch.tensor([[1] * 8, [0] + [1] * 7])})


def load_weights_as_checkpoint() -> None:
    from lightning_3d.checkpoint.formats import JobState, checkpoint_format

    weights = Path(tempfile.mkdtemp()) / "model.safetensors"
    weights.write_bytes(b"\0" * 16)
    checkpoint_format("sharded").load(JobState(module=None, optimizers=[], topology=None), weights)


def two_optimizers_one_parameter() -> None:
    layer = nn.Linear(2, 2)
    topology = SimpleNamespace(dims=SimpleNamespace(tp=1, ep=1))  # all the check reads of the topology
    zero = ZeroCoordinator(1, topology, torch.float32, torch.float32, 2**20)  # type: ignore[arg-type]
    zero.wrap_optimizers(layer, [torch.optim.SGD(layer.parameters(), lr=0.1), torch.optim.SGD([layer.weight], lr=0.1)])


def adafactor() -> torch.optim.Optimizer:
    return torch.optim.Adafactor(nn.Linear(2, 2).parameters(), lr=0.01)


def tiny_gpt_model(**overrides: Any) -> GPT:
    return GPT(GPTConfig(**{**dict(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8), **overrides}))


def gpt_plan_check(world: int, **overrides: Any) -> None:
    model = tiny_gpt_model(**overrides)
    gpt_plan(model).check(model, world)  # type: ignore[misc]


def plan_on(model: nn.Module, styles: dict[str, Any], sequence_parallel: bool = False, **plan: Any) -> None:
    apply_plan(model, TensorParallelPlan(styles=styles, **plan), PlanContext(None, sequence_parallel, None))  # type: ignore[arg-type]


def device(**overrides: Any) -> DeviceSpec:
    return DeviceSpec(**{**dict(model="test-gpu", memory_gb=80.0, peak_tflops=1000.0, memory_bandwidth_gb_per_s=3000.0), **overrides})


def cluster(**overrides: Any) -> ClusterSpec:
    return ClusterSpec(**{**dict(name="test", devices_per_node=8, device=device(), intra_node_gb_per_s=300.0), **overrides})


def problem(**overrides: Any) -> Problem:
    model = ModelShape.from_config(dict(n_layer=4, n_embd=256, n_head=4, vocab_size=1024, block_size=128))
    return Problem(**{**dict(model=model, cluster=cluster(), global_batch=16), **overrides})


def cluster_dict(**overrides: Any) -> dict[str, Any]:
    return {**asdict(cluster()), **overrides}


def checkpoint_dir(files: Optional[dict[str, bytes]] = None, manifest_files: Optional[dict[str, Any]] = None, fmt: str = FORMAT) -> Path:
    """A sharded-checkpoint directory, crafted: ``files`` written, the manifest listing ``manifest_files``."""
    path = Path("crafted.ckpt")
    path.mkdir()
    for name, data in (files or {}).items():
        (path / name).write_bytes(data)
    manifest = {"format": fmt, "step": 1, "layout": {}, "pieces": [], "files": manifest_files or {}}
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


def interrupted_save(run: str) -> Path:
    """A complete checkpoint of run "run-a" and a save of ``step=2.ckpt`` by ``run`` that never finished."""
    done = Path("step=1.ckpt")
    done.mkdir()
    (done / "manifest.json").write_text(json.dumps({"format": FORMAT, "step": 1, "run_id": "run-a", "pieces": [], "files": {}}))
    Path(f"step=2.ckpt.tmp-{run}.123").mkdir()
    return Path("step=2.ckpt")


def checkpoint_with_code_in_meta() -> ShardedCheckpoint:
    buffer = io.BytesIO()
    torch.save({"hyper_parameters": {"where": Path("/etc")}}, buffer)
    path = checkpoint_dir({"meta.pt": buffer.getvalue()})
    info = {"bytes": (path / "meta.pt").stat().st_size, "crc32": _crc32(path / "meta.pt")}
    (path / "manifest.json").write_text(json.dumps({**read_manifest(path), "files": {"meta.pt": info}}))
    return ShardedCheckpoint(path)


def token_file_with_wrong_count() -> None:
    directory = Path(tempfile.mkdtemp())  # (not the working directory: the files would end up committed)
    (directory / "tokens.bin").write_bytes(np.arange(3, dtype=np.uint16).tobytes())
    (directory / "tokens.bin.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 256, "num_tokens": 5, "tokenizer": "bytes"}))
    read_token_file(directory / "tokens.bin")


def token_file_with_meta(text: str) -> None:
    path = Path(tempfile.mkdtemp()) / "tokens.bin"
    path.write_bytes(b"\0" * 8)
    path.with_name("tokens.bin.json").write_text(text)
    read_token_file(path)


def checkpoint_dir_with_manifest(text: str) -> Path:
    from lightning_3d.checkpoint.sharded import MANIFEST

    path = Path(tempfile.mkdtemp()) / "step=2.ckpt"
    path.mkdir()
    (path / MANIFEST).write_text(text)
    return path


def per_replica_batch(global_batch_size: int, devices: int) -> int:
    data = TextDataModule(global_batch_size=global_batch_size)
    data.trainer = trainer(ThreeDParallelStrategy(), devices=devices)
    return data.per_replica_batch_size()


def sampler_loader(samples: int, replicas: int) -> torch.utils.data.DataLoader:
    dataset = torch.utils.data.TensorDataset(torch.arange(samples))
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=replicas, rank=0, shuffle=False)
    return torch.utils.data.DataLoader(dataset, batch_size=2, sampler=sampler)


def empty_dir(name: str = "empty") -> str:
    Path(name).mkdir()
    return name


# -- the registry: table id -> a zero-argument trigger (runs in a fresh temporary working directory) -----------
REFUSALS: dict[str, Callable[[], Observed]] = {
    # layout / config
    "layout-degree": raises(ValueError, lambda: ParallelConfig(tensor_parallel=0)),
    "strategy-replica-check-every": raises(ValueError, lambda: ThreeDParallelStrategy(replica_check_every=-1)),
    "data-global-batch-zero": raises(ValueError, lambda: TextDataModule(global_batch_size=0)),
    "optim-lr-nan": raises(ValueError, lambda: GPTModule(lr=float("nan"))),
    "ckpt-weights-as-checkpoint": raises(CheckpointError, load_weights_as_checkpoint),
    "optim-lr-negative": raises(ValueError, lambda: GPTModule(lr=-0.1)),
    "cp-ring-window": raises(ValueError, lambda: ring(window=2)),
    "cp-ring-softcap": raises(ValueError, lambda: hf_context_parallel("gemma2")),
    "cp-hf-padding": raises(ValueError, lambda: hf_before_split()),
    "cp-hf-ring-sliding": raises(ValueError, lambda: hf_context_parallel("mistral")),
    "cp-hf-own-attention": raises(ValueError, lambda: hf_context_parallel(hf_config_model("GPTNeoConfig", num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]]))),
    "cp-hf-mask-window": raises(ValueError, lambda: hf_context_parallel(hf_config_model("PhimoeConfig", intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, sliding_window=4, num_local_experts=2), "all_to_all")),
    "cp-hf-attention-kwarg": raises(ValueError, lambda: hf_attention_with(s_aux=torch.zeros(2))),
    "layout-dp-degree": raises(ValueError, lambda: ThreeDParallelStrategy(data_parallel=0)),
    "layout-world-size": raises(ValueError, lambda: trainer(ThreeDParallelStrategy(data_parallel=3), devices=2)),
    "layout-auto-indivisible": raises(ValueError, lambda: trainer(ThreeDParallelStrategy(tensor_parallel=2), devices=3)),
    "layout-tp-spans-nodes": raises(ValueError, lambda: trainer(ThreeDParallelStrategy(tensor_parallel=4), devices=2, num_nodes=2)),
    "layout-world-size-variable": raises(ValueError, lambda: with_world_size("4")),
    "config-zero-stage": raises(ValueError, lambda: ParallelConfig(zero_stage=4)),
    "config-sequence-parallel-type": raises(ValueError, lambda: ParallelConfig(sequence_parallel="yes")),
    "config-sp-without-tp": warns(lambda: ParallelConfig(sequence_parallel=True)),
    "config-timeout-type": raises(ValueError, lambda: ParallelConfig(timeout="soon")),
    "config-timeout-sign": raises(ValueError, lambda: ParallelConfig(timeout=-5)),
    "strategy-bucket-size": raises(ValueError, lambda: ThreeDParallelStrategy(bucket_size_mb=0)),
    "strategy-global-batch": raises(ValueError, lambda: ThreeDParallelStrategy(global_batch_size=0)),
    "strategy-elastic-names": raises(ValueError, lambda: ThreeDParallelStrategy(elastic={"may_change": ["bogus"]})),
    "data-global-batch-divides": raises(ValueError, lambda: _accumulation(12, batch_size=4, replicas=2, current=1)),
    "data-global-batch-accumulation": raises(ValueError, lambda: _accumulation(16, batch_size=4, replicas=2, current=4)),
    "strategy-start-method": raises(ValueError, lambda: ThreeDParallelStrategy(start_method="thread")),
    # ZeRO & optimizers
    "zero3-pipeline": raises(NotImplementedError, lambda: ThreeDParallelStrategy(zero_stage=3, pipeline_parallel=2)),
    "zero3-sequence-parallel": raises(NotImplementedError, lambda: ThreeDParallelStrategy(zero_stage=3, tensor_parallel=2, sequence_parallel=True)),
    "zero-non-elementwise": raises(ValueError, lambda: check_optimizer_layout(adafactor(), 1, 1)),
    "zero-non-elementwise-tp": raises(ValueError, lambda: check_optimizer_layout(adafactor(), 0, 2)),
    "zero-shared-parameter": raises(ValueError, two_optimizers_one_parameter),
    "zero3-root-parameters": raises(ValueError, lambda: apply_zero3(nn.Linear(2, 2), None)),  # type: ignore[arg-type]
    # offload, NVMe & activation checkpointing
    "offload-needs-zero": raises(ValueError, lambda: ParallelConfig(offload_optimizer="cpu")),
    "offload-params-needs-zero3": raises(ValueError, lambda: ParallelConfig(zero_stage=1, offload_params="cpu")),
    "offload-target": raises(ValueError, lambda: ParallelConfig(zero_stage=1, offload_optimizer="gpu")),
    "nvme-needs-path": raises(ValueError, lambda: ParallelConfig(zero_stage=1, offload_optimizer="nvme")),
    "nvme-zero3": raises(NotImplementedError, lambda: ThreeDParallelStrategy(zero_stage=3, offload_params="nvme", nvme_path=".")),
    "nvme-path-missing": raises(FileNotFoundError, lambda: NVMeStateStore("no/such/dir", 0, [10])),
    "nvme-disk-space": raises(OSError, lambda: NVMeStateStore(".", 0, [2**50])),
    "nvme-not-adam": raises(ValueError, lambda: ZeroOptimizer(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1), None, 1, offload="nvme")),  # type: ignore[arg-type]
    "nvme-amsgrad": raises(ValueError, lambda: ChunkAdam(torch.optim.AdamW(nn.Linear(2, 2).parameters(), amsgrad=True))),
    "recompute-mode": raises(ValueError, lambda: ParallelConfig(activation_checkpointing="sometimes")),
    "recompute-every-n": raises(ValueError, lambda: ParallelConfig(checkpoint_every_n_layers=0)),
    "recompute-no-sequence": raises(ValueError, lambda: apply_activation_checkpointing(nn.Sequential(nn.Linear(2, 2)), "full")),
    "recompute-no-attention": raises(ValueError, lambda: attention_of(nn.Linear(2, 2))),
    # tensor-parallel plans
    "tp-heads": raises(ValueError, lambda: gpt_plan_check(4, n_head=2)),
    "tp-kv-heads": raises(ValueError, lambda: gpt_plan_check(2, n_head=2, n_kv_head=1)),
    "tp-unknown-style": raises(ValueError, lambda: plan_on(nn.Sequential(nn.Linear(2, 2)), {"0": "diagonal"})),
    "tp-unmatched-pattern": raises(ValueError, lambda: plan_on(nn.Sequential(nn.Linear(2, 2)), {"1": "column"})),
    "tp-plan-without-sp": raises(NotImplementedError, lambda: plan_on(nn.Linear(2, 2), {}, True, supports_sequence_parallel=False)),
    "tp-hf-no-plan": raises(ValueError, lambda: hf_plan("opt")),
    "tp-hf-unmapped-style": raises(ValueError, lambda: hf_plan("llama", {"model.layers.*.mlp.gate_proj": "local_colwise"})),
    "tp-layer-without-group": raises(ValueError, lambda: ColumnParallelLinear(4, 4)),
    "tp-row-sequence-parallel": raises(ValueError, lambda: RowParallelLinear(4, 4, input_is_parallel=False, sequence_parallel=True)),
    # pipeline
    "pp-schedule": raises(ValueError, lambda: ParallelConfig(pipeline_parallel=2, pipeline_schedule="zigzag")),
    "pp-micro-batches": raises(ValueError, lambda: ParallelConfig(micro_batches=0)),
    "pp-virtual-stages": raises(ValueError, lambda: ParallelConfig(pipeline_parallel=2, virtual_stages=2)),
    "pp-interleaved-micro-batches": raises(ValueError, lambda: ParallelConfig(pipeline_parallel=2, pipeline_schedule="interleaved_1f1b", virtual_stages=2, micro_batches=3)),
    "pp-too-few-layers": raises(ValueError, lambda: partition(2, 4)),
    "pp-split-points": raises(ValueError, lambda: partition(6, 3, [3, 2])),
    "pp-partition-method": raises(ValueError, lambda: partition(6, 3, "greedy")),
    "pp-nothing-to-split": raises(ValueError, lambda: apply_pipeline(nn.Sequential(nn.Linear(2, 2)))),
    "pp-hf-no-plan": raises(ValueError, lambda: apply_pipeline(hf_model("opt"))),
    "pp-hf-layer-loop": raises(RuntimeError, lambda: hf_capture().visit(1, 2, torch.zeros(1, 3, 4), (), {})),
    "pp-batch-not-divisible": raises(ValueError, lambda: on_train_start(ThreeDParallelStrategy(pipeline_parallel=2, micro_batches=2), torch.utils.data.DataLoader(range(6), batch_size=3))),
    "pp-hf-arguments": raises(NotImplementedError, lambda: _hf_inputs((), {"input_ids": torch.zeros(1, 2), "inputs_embeds": torch.zeros(1, 2, 4)})),
    "pp-hf-mask-shape": raises(ValueError, lambda: _hf_inputs((), {"input_ids": torch.zeros(1, 2), "attention_mask": torch.ones(1, 1, 2, 2)})),
    # precision
    "precision-plugin": raises(ValueError, lambda: ThreeDPrecision("fp8")),
    "precision-trainer": raises(ValueError, lambda: trainer(ThreeDParallelStrategy(), precision="64-true")),
    "precision-scaler-factors": raises(ValueError, lambda: ThreeDPrecision("16-mixed", backoff_factor=2.0)),
    "precision-scaler-interval": raises(ValueError, lambda: ThreeDPrecision("16-mixed", growth_interval=0)),
    "precision-clip-norm": raises(ValueError, lambda: global_grad_norm([], None, norm_type=1.0)),
    "precision-transformer-engine": raises(ValueError, lambda: trainer(ThreeDParallelStrategy(), precision="transformer-engine")),
    "precision-nonfinite-limit": raises(ValueError, lambda: ThreeDPrecision("bf16-mixed", max_consecutive_nonfinite=0)),
    "precision-fp16-floor": warns(lambda: DynamicLossScaler(initial_scale=2.0, hysteresis=1).update(True)),
    # checkpoints
    "ckpt-format-option": raises(ValueError, lambda: ThreeDParallelStrategy(checkpoint_format="zip")),
    "ckpt-keep-last-k": raises(ValueError, lambda: ThreeDParallelStrategy(keep_last_k=0)),
    "ckpt-sharded-storage-options": raises(TypeError, lambda: ThreeDParallelStrategy().save_checkpoint({}, "x.ckpt", storage_options={})),
    "ckpt-atomic-storage-options": raises(TypeError, lambda: AtomicCheckpointIO().save_checkpoint({}, "x.ckpt", storage_options={})),
    "ckpt-unknown-format": raises(RuntimeError, lambda: read_manifest(checkpoint_dir(fmt="other/9"))),
    "ckpt-file-missing": raises(RuntimeError, lambda: ShardedCheckpoint(checkpoint_dir()).verify("rank0.pt")),
    "ckpt-file-corrupt": raises(RuntimeError, lambda: ShardedCheckpoint(checkpoint_dir({"rank0.pt": b"abc"}, {"rank0.pt": {"bytes": 4, "crc32": 0}})).verify("rank0.pt")),
    "ckpt-code-in-meta": raises(RuntimeError, lambda: checkpoint_with_code_in_meta().meta()),
    "ckpt-path-missing": raises(RuntimeError, lambda: latest_complete(checkpoint_dir().with_name("step=999.ckpt"))),
    "ckpt-not-a-checkpoint": raises(RuntimeError, lambda: latest_complete(Path(".").resolve())),
    "ckpt-interrupted-other-run": raises(RuntimeError, lambda: latest_complete(interrupted_save("other-run"))),
    "ckpt-interrupted-fallback": warns(lambda: latest_complete(interrupted_save("run-a"))),
    # data
    "data-token-file-missing": raises(FileNotFoundError, lambda: read_token_file("nope.bin")),
    "data-token-count": raises(ValueError, token_file_with_wrong_count),
    "data-token-meta-json": raises(ValueError, lambda: token_file_with_meta("{not json")),
    "data-token-meta-dtype": raises(ValueError, lambda: token_file_with_meta('{"dtype": "float32", "vocab_size": 256, "num_tokens": 2}')),
    "ckpt-manifest-json": raises(CheckpointError, lambda: read_manifest(checkpoint_dir_with_manifest("{truncated"))),
    "data-block-size": raises(ValueError, lambda: TokenWindows(np.arange(10), 0)),
    "data-too-few-tokens": raises(ValueError, lambda: TokenWindows(np.arange(4), 8)),
    "data-val-fraction": raises(ValueError, lambda: split_tokens(np.arange(10), 1.5)),
    "data-context-length": raises(ValueError, lambda: TextDataModule()._context_length()),
    "data-global-batch": raises(ValueError, lambda: per_replica_batch(3, devices=2)),
    "data-sampler-repeats": warns(lambda: on_train_start(ThreeDParallelStrategy(), sampler_loader(21, 2))),
    "data-prepare-input-missing": raises(FileNotFoundError, lambda: prepare_byte_tokens(["no/such/file.txt"], "out.bin")),
    "data-prepare-no-files": raises(ValueError, lambda: prepare_byte_tokens([empty_dir()], "out.bin")),
    # planner
    "plan-layout-key": raises(ValueError, lambda: parse_layout("tq=4")),
    "plan-layout-integer": raises(ValueError, lambda: parse_layout("tp=four")),
    "plan-layout-bool": raises(ValueError, lambda: parse_layout("sp=maybe")),
    "plan-layout-degrees": raises(ValueError, lambda: best_completion(Planner(problem()), {"tp": 2, "pp": 2})),
    "plan-layout-world": raises(ValueError, lambda: best_completion(Planner(problem()), {"dp": 2, "tp": 2, "pp": 1})),
    "plan-precision": raises(ValueError, lambda: problem(precision="fp8")),
    "plan-global-batch": raises(ValueError, lambda: problem(global_batch=0)),
    "plan-software": raises(ValueError, lambda: problem_from_config(None, software="deepspeed_2019")),  # type: ignore[arg-type]
    "plan-model-heads": raises(ValueError, lambda: ModelShape.from_config(dict(n_layer=2, n_embd=10, n_head=3, vocab_size=16, block_size=8))),
    "plan-zero-stage": raises(ValueError, lambda: zero_model_state_bytes(1e9, 4, 8)),
    "plan-cluster-running-only": raises(ValueError, lambda: load_cluster({"name": "local_gpu", "devices_per_node": -1})),
    "plan-cluster-launcher": raises(ValueError, lambda: load_cluster(cluster_dict(launcher="mpi"))),
    "plan-cluster-links": raises(ValueError, lambda: cluster(intra_node_gb_per_s=0.0).validate()),
    "plan-cluster-network": raises(ValueError, lambda: cluster(num_nodes=2).validate()),
    "plan-device": raises(ValueError, lambda: device(memory_gb=0.0).validate()),
    "plan-config-dir": raises(FileNotFoundError, lambda: compose_config([], empty_dir("conf"))),  # type: ignore[arg-type]
    # CLI
    "cli-unknown-command": exits(["frobnicate"]),
    "cli-plan-positional": exits(["plan", "bloom_176b"]),
    "cli-consolidate-dtype": exits(["consolidate", "a.ckpt", "out.pt", "--dtype", "fp8"]),
    "cli-consolidate-missing": exits(["consolidate", "missing.ckpt", "out.pt"]),
    "cli-consolidate-interrupted": lambda: exits(["consolidate", str(interrupted_save("run-a")), "out.pt"])(),
    "cli-fit-user-error": exits(["fit", "--trainer.accelerator=cpu", "--trainer.strategy=lightning_3d.ThreeDParallelStrategy", "--trainer.strategy.zero_stage=7"]),
}


# -- the table -------------------------------------------------------------------------------------------------
class Row(NamedTuple):
    id: str
    excerpt: str
    kind: Optional[str]
    fires_at: str
    test: str
    line: int


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def read_table(path: Path = TABLE) -> list[Row]:
    """The rows of the table in ``path``: lines ``| id | `excerpt` (Kind) | fires at | `test` |``.
    Header, separator and group rows (empty test cell) are skipped."""
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.startswith("|"):
            continue
        cells = _cells(line)
        if len(cells) != 4 or set(cells[0]) <= set("-: ") or cells[0] == "id" or not cells[3]:
            continue
        refusal = re.fullmatch(r"`([^`]+)`(?:\s*\(([^)]+)\))?", cells[1])
        assert refusal, f"{path.name}:{number}: the refusal cell must be `excerpt` (Kind), got {cells[1]!r}"
        rows.append(Row(cells[0].strip("`"), refusal[1], refusal[2], cells[2], cells[3].strip("`"), number))
    return rows


ROWS = read_table()
HERE = {r.id: r for r in ROWS if r.test.startswith(f"{THIS_FILE}::")}
ELSEWHERE = [r for r in ROWS if not r.test.startswith(f"{THIS_FILE}::")]


def test_the_table_has_at_least_40_rows_with_unique_ids():
    ids = [r.id for r in ROWS]
    assert len(ids) >= 40, f"docs/errors.md has {len(ids)} rows"
    assert len(set(ids)) == len(ids), sorted({i for i in ids if ids.count(i) > 1})
    assert all(re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", i) for i in ids), [i for i in ids if not re.fullmatch(r"[a-z0-9-]+", i)]


def test_every_row_says_when_it_fires():
    assert [(r.id, r.fires_at) for r in ROWS if r.fires_at not in FIRES_AT] == []


def test_registry_and_table_agree():
    assert sorted(set(REFUSALS) - set(HERE)) == [], "in REFUSALS but not in docs/errors.md (as test_refusal rows)"
    assert sorted(set(HERE) - set(REFUSALS)) == [], "in docs/errors.md as test_refusal rows but not in REFUSALS"
    wrong = [(r.id, r.test) for r in HERE.values() if r.test != f"{THIS_FILE}::test_refusal[{r.id}]"]
    assert wrong == [], "a test_refusal row must name its own id"


@pytest.mark.parametrize("refusal_id", list(REFUSALS))
def test_refusal(refusal_id, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    row = HERE.get(refusal_id)
    assert row is not None, f"{refusal_id} is not a row of docs/errors.md"
    observed = REFUSALS[refusal_id]()
    assert any(row.excerpt in message for _, message in observed), (
        f"docs/errors.md:{row.line} excerpt {row.excerpt!r} is not in the message(s) {[m for _, m in observed]}"
    )
    if row.kind is not None:
        kinds = [kinds for kinds, message in observed if row.excerpt in message]
        assert any(row.kind in k for k in kinds), f"docs/errors.md:{row.line} says {row.kind}, the refusal was {[k[0] for k in kinds]}"


def _test_functions(source: str) -> set[str]:
    tree = ast.parse(source)
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test")}


@pytest.mark.parametrize("row", ELSEWHERE, ids=[r.id for r in ELSEWHERE])
def test_rows_tested_elsewhere_name_a_real_test(row):
    """Rule: the named file defines the named test function (a parametrization ``[...]`` is
    stripped) and contains the row's excerpt verbatim, so a renamed test or message fails here."""
    path, sep, name = row.test.partition("::")
    assert sep and path.startswith("tests/test_") and path.endswith(".py"), f"docs/errors.md:{row.line}: {row.test!r}"
    source = (ROOT / path).read_text()
    function = name.split("[", 1)[0]
    assert function in _test_functions(source), f"docs/errors.md:{row.line}: {path} has no test {function}"
    assert row.excerpt in source, f"docs/errors.md:{row.line}: {path} does not contain the excerpt {row.excerpt!r}"
