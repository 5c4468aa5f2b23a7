"""The strategy's keywords: registration, validation before any process starts, clear refusals."""

from __future__ import annotations

import dataclasses
import inspect
from datetime import timedelta

import lightning as L
import pytest
from lightning.pytorch.strategies import StrategyRegistry

import lightning_3d
from lightning_3d import ParallelConfig, ThreeDParallelStrategy
from lightning_3d.core.config import KEYWORDS

STRATEGY_KEYWORDS = [
    "data_parallel",
    "tensor_parallel",
    "pipeline_parallel",
    "zero_stage",
    "sequence_parallel",
    "pipeline_schedule",
    "micro_batches",
    "virtual_stages",
    "activation_checkpointing",
    "offload_optimizer",
    "offload_params",
    "nvme_path",
    "timeout",
]


def test_registered_as_3d():
    assert "3d" in StrategyRegistry
    assert isinstance(StrategyRegistry.get("3d"), ThreeDParallelStrategy)
    trainer = L.Trainer(strategy="3d", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, ThreeDParallelStrategy)
    assert trainer.strategy.is_distributed


# `import lightning_3d` before Lightning: the package loads nothing heavy, and the name is registered by
# the import hook once Lightning is imported (the test process above has the other order)
_IMPORT_ORDER = """
import importlib.util
import sys
import lightning_3d
assert "lightning" not in sys.modules and "torch" not in sys.modules, sorted(m for m in sys.modules if m.split(".")[0] in ("lightning", "torch"))
assert importlib.util.find_spec("lightning") is not None  # an availability check imports nothing: the hook stays
import lightning as L
from lightning.pytorch.strategies import StrategyRegistry
assert "3d" in StrategyRegistry
trainer = L.Trainer(strategy="3d", accelerator="cpu", devices=1, logger=False)
assert type(trainer.strategy) is lightning_3d.ThreeDParallelStrategy, type(trainer.strategy)
try:
    L.Trainer(strategy="3d", accelerator="cpu", devices=1, logger=False, precision="transformer-engine")
except ValueError as err:
    assert "precision='transformer-engine' is not supported by ThreeDParallelStrategy" in str(err), err
else:
    raise AssertionError("transformer-engine was not refused")
from lightning_3d.apps.cli import main
"""


def test_registered_when_lightning_is_imported_after_the_package():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _IMPORT_ORDER], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_version_and_plan_do_not_import_lightning(capsys):
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from lightning_3d.apps.cli import main\n"
        "assert main(['--version']) == 0\n"
        "assert main(['plan', 'model=bloom_176b', 'cluster=jean_zay_bloom', '--top', '1']) == 0\n"
        "assert 'lightning' not in sys.modules, 'plan imported Lightning'\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "lightning-3d" in proc.stdout


def test_constructor_has_every_documented_keyword():
    params = inspect.signature(ThreeDParallelStrategy).parameters
    assert all(k in params for k in STRATEGY_KEYWORDS)
    # every keyword but Lightning's own plugins goes to ParallelConfig whole, through its one mapping
    lightning = {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin"}
    assert set(params) - lightning == set(KEYWORDS)
    config = ThreeDParallelStrategy(tensor_parallel=2, pipeline_schedule="zbv", bucket_size_mb=1, keep_last_k=2).config
    assert (config.layout.tensor_parallel, config.pipeline.schedule, config.pipeline.virtual_stages) == (2, "zb_v", 2)
    assert (config.sharding.bucket_bytes, config.checkpoint.keep_last_k) == (2**20, 2)
    assert ParallelConfig(**config.keywords()) == config and config.replace(zero_stage=1).sharding.zero_stage == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.layout.tensor_parallel = 4  # type: ignore[misc]
    with pytest.raises(TypeError, match="unknown keyword"):
        ParallelConfig(tensor_paralel=2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(data_parallel=0), "data_parallel=0 is invalid"),
        (dict(tensor_parallel=-1), "tensor_parallel=-1 is invalid"),
        (dict(pipeline_parallel=0), "pipeline_parallel=0 is invalid"),
        (dict(zero_stage=4), "zero_stage=4 is invalid"),
        (dict(pipeline_schedule="zigzag"), "pipeline_schedule='zigzag' is not supported"),
        (dict(micro_batches=0), "micro_batches=0 is invalid"),
        (dict(virtual_stages=0), "virtual_stages=0 is invalid"),
        (dict(virtual_stages=2, pipeline_schedule="1f1b"), "virtual_stages=2 needs pipeline_schedule='interleaved_1f1b'"),
        (dict(activation_checkpointing="sometimes"), "activation_checkpointing='sometimes' is not supported"),
        (dict(offload_optimizer="gpu"), "offload_optimizer='gpu' is not supported"),
        (dict(zero_stage=1, offload_optimizer="nvme"), "needs nvme_path"),
        (dict(zero_stage=1, offload_params="cpu"), "offload_params='cpu' shards parameters and so needs zero_stage=3"),
        (dict(offload_optimizer="cpu"), "needs zero_stage >= 1"),
        (dict(timeout=-5), "timeout=-5 is invalid"),
        (dict(bucket_size_mb=0), "bucket_size_mb=0 is invalid"),
        (dict(sequence_parallel="yes"), "sequence_parallel='yes' is invalid"),
    ],
)
def test_bad_values_raise_value_error_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ThreeDParallelStrategy(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "feature"),
    [
        (dict(zero_stage=3, sequence_parallel=True, tensor_parallel=2), "sequence parallelism under ZeRO-3"),
        (dict(zero_stage=3, pipeline_parallel=2), "ZeRO-3 under pipeline parallelism"),
        (dict(zero_stage=3, offload_params="nvme", nvme_path="/tmp"), "NVMe offload of ZeRO-3 parameters"),
    ],
)
def test_unsupported_combinations_are_refused_by_name(kwargs, feature):
    with pytest.raises(NotImplementedError, match=feature):
        ThreeDParallelStrategy(**kwargs)


def test_layout_that_does_not_fit_the_world_fails_at_trainer_construction():
    with pytest.raises(ValueError, match="data_parallel=3 .* = 3, but the world size is 2"):
        L.Trainer(strategy=ThreeDParallelStrategy(data_parallel=3), accelerator="cpu", devices=2, logger=False)


def test_auto_data_parallel_resolves_at_trainer_construction():
    trainer = L.Trainer(strategy=ThreeDParallelStrategy(), accelerator="cpu", devices=3, num_nodes=2, logger=False)
    assert trainer.strategy.parallel_dims == lightning_3d.ParallelDims(dp=6, tp=1, pp=1)


def test_sequence_parallel_without_tensor_parallel_is_a_warning_not_an_error():
    with pytest.warns(UserWarning, match="sequence_parallel=True has no effect with tensor_parallel=1"):
        config = ParallelConfig(sequence_parallel=True)
    assert config.layout.sequence_parallel is False


def test_normalized_values():
    config = ParallelConfig(activation_checkpointing=None, offload_optimizer=False, timeout=timedelta(minutes=2))
    assert config.recompute.mode == "none"
    assert config.sharding.offload_optimizer == "none"
    assert config.runtime.timeout == timedelta(seconds=120)
    assert ParallelConfig(pipeline_schedule="Interleaved").pipeline.schedule == "interleaved_1f1b"
    assert ParallelConfig(timeout=90).to_dict()["timeout"] == 90.0
