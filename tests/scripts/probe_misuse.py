"""The issue-32 probe: 40 cases of misuse and faults tried as a user would, outside the suite.

    .venv/bin/python tests/scripts/probe_misuse.py > probe.jsonl

Each case prints one JSON line: what was tried, what came back (the exception's type and first line,
or a command's exit status and its last stderr line). The verdicts are read by a person and recorded
in docs/testing.md ("Probe of misuse and faults"); this script only gathers the evidence.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
PY = str(ROOT / ".venv" / "bin" / "python")
CLI = str(ROOT / ".venv" / "bin" / "lightning-3d")
TMP = Path(tempfile.mkdtemp(prefix="l3d-probe-"))


def call(fn: Callable[[], Any]) -> dict[str, Any]:
    try:
        fn()
        return {"outcome": "no error"}
    except BaseException as err:  # noqa: BLE001 - the probe records whatever happens
        first = (str(err).strip().splitlines() or [""])[0]
        return {"outcome": f"{type(err).__name__}: {first}", "traceback_lines": len(traceback.format_exc().splitlines())}


def run(argv: list[str], timeout: int = 240, **env: str) -> dict[str, Any]:
    environ = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    environ.update(PYTHONPATH=str(ROOT), **env)
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=TMP, env=environ)
    except subprocess.TimeoutExpired:
        return {"outcome": f"HANG: no exit within {timeout} s"}
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip() and not line.startswith(("[rank", "GPU", "TPU", "💡"))]
    return {"outcome": f"exit {proc.returncode}", "last": lines[-1][:400] if lines else "", "stderr_lines": len(lines)}


def recipe(*overrides: str) -> dict[str, Any]:
    return run([PY, str(ROOT / "recipes" / "train.py"), *overrides, f"hydra.run.dir={TMP / 'run'}", "trainer.max_steps=2"])


def strategy(**kwargs: Any) -> Callable[[], Any]:
    from lightning_3d import ThreeDParallelStrategy

    return lambda: ThreeDParallelStrategy(**kwargs)


def trainer(devices: int = 2, **kwargs: Any) -> Callable[[], Any]:
    import lightning as L

    from lightning_3d import ThreeDParallelStrategy

    return lambda: L.Trainer(strategy=ThreeDParallelStrategy(**kwargs), accelerator="cpu", devices=devices, logger=False)


def hf_dir(kind: str) -> Path:
    from tests.hf_families import make_family_checkpoint

    return make_family_checkpoint(kind, TMP / "hf")


def a_checkpoint() -> Path:
    """A real sharded checkpoint (2 steps of the tiny GPT on one CPU rank), for the commands that read one."""
    path = TMP / "trained.ckpt"
    if not path.exists():
        script = (
            "import lightning as L, sys\n"
            "from lightning_3d import ThreeDParallelStrategy\n"
            "from tests.helpers import tiny_data, tiny_gpt\n"
            "t = L.Trainer(strategy=ThreeDParallelStrategy(), accelerator='cpu', devices=1, max_steps=2, logger=False,"
            " enable_checkpointing=False, enable_progress_bar=False, limit_val_batches=0)\n"
            "t.fit(tiny_gpt(), tiny_data(global_batch_size=2)); t.save_checkpoint(sys.argv[1])\n"
        )
        result = run([PY, "-c", script, str(path)])
        assert path.exists(), result
    return path


def cases() -> dict[str, Callable[[], dict[str, Any]]]:
    from lightning_3d import from_pretrained, load_from_checkpoint
    from lightning_3d.models import GPTModule

    empty = TMP / "empty_dir"
    empty.mkdir(exist_ok=True)
    a_file = TMP / "a_file.txt"
    a_file.write_text("x")
    return {
        # construction: the strategy's keywords
        "tp2 x pp2 on 2 devices": lambda: call(trainer(devices=2, tensor_parallel=2, pipeline_parallel=2)),
        "pipeline_schedule typo 'zbv'": lambda: call(strategy(pipeline_parallel=2, pipeline_schedule="zbv")),
        "zero_stage as the string '3'": lambda: call(strategy(zero_stage="3")),
        "micro_batches=0": lambda: call(strategy(pipeline_parallel=2, micro_batches=0)),
        "offload_optimizer='gpu'": lambda: call(strategy(zero_stage=2, offload_optimizer="gpu")),
        "activation_checkpointing='partial'": lambda: call(strategy(activation_checkpointing="partial")),
        "checkpoint_every_n_layers=0": lambda: call(strategy(activation_checkpointing="full", checkpoint_every_n_layers=0)),
        "keep_last_k=0": lambda: call(strategy(keep_last_k=0)),
        "checkpoint_format='dcp'": lambda: call(strategy(checkpoint_format="dcp")),
        "timeout='10s'": lambda: call(strategy(timeout="10s")),
        "bucket_size_mb=-1": lambda: call(strategy(bucket_size_mb=-1)),
        "replica_check_every=2.5": lambda: call(strategy(replica_check_every=2.5)),
        "context_parallel_mode='ulysses'": lambda: call(strategy(context_parallel=2, context_parallel_mode="ulysses")),
        "offload_params='cpu' at zero_stage=2": lambda: call(strategy(zero_stage=2, offload_params="cpu")),
        "Trainer(precision='64-true')": lambda: call(lambda: __import__("lightning").Trainer(strategy="3d", accelerator="cpu", devices=1, precision="64-true")),
        # the model and data objects
        "GPTModule(warmup_steps=-3)": lambda: call(lambda: GPTModule(warmup_steps=-3)),
        "GPTModule(betas=(0.9,))": lambda: call(lambda: GPTModule(betas=(0.9,))),
        "TextDataModule(global_batch_size=2.5)": lambda: call(lambda: __import__("lightning_3d.data", fromlist=["x"]).TextDataModule(global_batch_size=2.5)),
        # pretrained weights
        "from_pretrained(an empty directory)": lambda: call(lambda: from_pretrained(empty)),
        "from_pretrained(dtype='int8')": lambda: call(lambda: from_pretrained(hf_dir("llama"), dtype="int8")),
        "from_pretrained(config without weights)": lambda: call(_config_only),
        "load_from_checkpoint(a path that does not exist)": lambda: call(lambda: load_from_checkpoint(GPTModule, TMP / "nope.ckpt")),
        "load_from_checkpoint(an empty directory)": lambda: call(lambda: load_from_checkpoint(GPTModule, empty)),
        # the command line
        "lightning-3d export of a missing checkpoint": lambda: run([CLI, "export", str(TMP / "missing.ckpt"), str(TMP / "out")]),
        "lightning-3d export into a file": lambda: run([CLI, "export", str(a_checkpoint()), str(a_file)]),
        "lightning-3d consolidate to .safetensors without --weights-only": lambda: run([CLI, "consolidate", str(a_checkpoint()), str(TMP / "w.safetensors")]),
        "lightning-3d prepare with no inputs": lambda: run([CLI, "prepare", str(TMP / "o.bin")]),
        "lightning-3d plan cluster=nope": lambda: run([CLI, "plan", "cluster=nope"]),
        "lightning-3d dry-run tp=3 for 4 heads": lambda: run([CLI, "dry-run", "parallel.tensor_parallel=3", "cluster.devices_per_node=3"]),
        "lightning-3d fit --trainer.strategy.zero_stage=9": lambda: run([CLI, "fit", "--trainer.accelerator=cpu", "--trainer.strategy=lightning_3d.ThreeDParallelStrategy", "--trainer.strategy.zero_stage=9"]),
        "lightning-3d frobnicate": lambda: run([CLI, "frobnicate"]),
        # recipes
        "recipe parallel.tensor_parallel=3 (4 heads)": lambda: recipe("parallel=dp", "cluster.devices_per_node=3", "parallel.tensor_parallel=3"),
        "recipe data.source=/nonexistent.bin": lambda: recipe("parallel=dp", "cluster.devices_per_node=1", "data.source=/nonexistent.bin"),
        "recipe model.init_from=/nonexistent": lambda: recipe("parallel=dp", "cluster.devices_per_node=1", "model.init_from=/nonexistent"),
        "recipe trainer.max_steps=-5": lambda: run([PY, str(ROOT / "recipes" / "train.py"), "parallel=dp", "cluster.devices_per_node=1", "trainer.max_steps=-5", f"hydra.run.dir={TMP / 'run2'}"]),
        "recipe optim.lr=-1e-3": lambda: recipe("parallel=dp", "cluster.devices_per_node=1", "optim.lr=-1e-3"),
        "recipe data.global_batch_size=3 at dp2": lambda: recipe("parallel=dp", "cluster.devices_per_node=2", "data.global_batch_size=3"),
        "recipe ckpt_path=/not/there": lambda: recipe("parallel=dp", "cluster.devices_per_node=1", "ckpt_path=/not/there"),
        # Hugging Face layouts
        "OPT at tensor_parallel=2": lambda: call(_opt_tp2),
        "Llama at pipeline_parallel=5 (4 layers)": lambda: call(_llama_pp5),
    }


def _config_only() -> None:
    from lightning_3d import from_pretrained

    path = hf_dir("qwen2")
    directory = TMP / "config_only"
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text((path / "config.json").read_text())
    from_pretrained(directory)


def _plan_check(kind: str, **layout: Any) -> None:
    import transformers

    from lightning_3d.core.config import ParallelConfig
    from lightning_3d.models.adapters import adapter_for, models_in
    from tests.hf_families import hf_family_config

    model = transformers.AutoModelForCausalLM.from_config(hf_family_config(kind))
    ParallelConfig(**layout).check_models(models_in(model))
    if layout.get("tensor_parallel", 1) > 1:
        adapter_for(model).tp_plan(model)


def _opt_tp2() -> None:
    _plan_check("opt", tensor_parallel=2)


def _llama_pp5() -> None:
    _plan_check("llama", pipeline_parallel=5)


def main() -> None:
    for name, case in cases().items():
        print(json.dumps({"case": name, **case()}), flush=True)


if __name__ == "__main__":
    main()
