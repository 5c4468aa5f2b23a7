"""Sharded checkpoints: resharding across layouts, consolidation and export, crash safety,
corruption, keep-last-k, asynchronous save, and jobs that end (not hang) when a rank dies."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Optional

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_3d import ThreeDParallelStrategy
from lightning_3d.checkpoint.consolidate import consolidate, export_hf
from lightning_3d.checkpoint.sharded import CheckpointError, ShardedCheckpoint, latest_complete
from lightning_3d.models import GPT, GPTConfig
from lightning_3d.testing.harness import free_port, run_on_ranks
from tests.helpers import TINY_GPT, LossRecorder, quiet_trainer, result_of, run_checks, run_fault_worker, tiny_data, tiny_gpt
from tests.test_tensor_parallel_training import HFCausalLM

ROOT = Path(__file__).resolve().parents[1]
GPT4 = dict(n_layer=4)
SOURCE = dict(data_parallel=2, tensor_parallel=2, pipeline_parallel=2, zero_stage=1)


def train(tmp: str, steps: int, resume: Optional[str] = None, save_every: int = 0, kernel: bool = False, **strategy: Any) -> Any:
    L.seed_everything(0)
    recorder = LossRecorder()
    callbacks: list[L.Callback] = [recorder]
    if save_every:
        callbacks.append(ModelCheckpoint(dirpath=tmp, every_n_train_steps=save_every, save_top_k=-1, filename="{step}"))
    trainer = quiet_trainer(
        max_steps=steps, limit_val_batches=0, callbacks=callbacks, enable_checkpointing=bool(save_every),
        strategy=ThreeDParallelStrategy(**strategy),
    )
    trainer.fit(tiny_gpt(lr=3e-3, **GPT4), tiny_data(global_batch_size=8), ckpt_path=resume)
    if kernel:  # the Adam kernel each group ended with (a resume loads the saved groups over ZeRO's choice)
        return recorder.losses, [g.get("fused") for g in trainer.optimizers[0].param_groups]
    return recorder.losses


# -- resharding ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Any]:
    """Uninterrupted 9 steps on dp2 x tp2 x pp2 (ZeRO-1), checkpointing every 4."""
    tmp = str(tmp_path_factory.mktemp("sharded"))
    losses = run_on_ranks(train, 8, tmp, 9, save_every=4, timeout=600, **SOURCE)
    return {"dir": tmp, "losses": np.mean(losses, axis=0)}


@pytest.mark.parametrize(
    ("layout", "world"),
    [
        (SOURCE, 8),
        (dict(data_parallel=4, tensor_parallel=2), 8),
        (dict(data_parallel=2, tensor_parallel=1, pipeline_parallel=4), 8),
        (dict(data_parallel=8, zero_stage=3), 8),
        ({}, 1),
    ],
    ids=["same", "dp4-tp2", "dp2-pp4", "dp8-zero3", "one-process"],
)
def test_resume_under_another_layout(saved, layout, world):
    path = str(Path(saved["dir"]) / "step=4.ckpt")
    zero3 = layout.get("zero_stage") == 3
    resumed = run_on_ranks(train, world, saved["dir"], 9, resume=path, timeout=600, kernel=zero3, **layout)
    if zero3:  # saved under ZeRO-1 (groups with fused=None): stage 3 still steps on the fused kernel
        assert all(fused == [True, True] for _, fused in resumed), resumed
        resumed = [losses for losses, _ in resumed]
    np.testing.assert_allclose(np.mean(resumed, axis=0), saved["losses"][4:], rtol=1e-5)
    assert len(resumed[0]) == 5


def plain_eval(checkpoint_file: str) -> float:
    """A plain GPT (no Lightning) with consolidated weights, on the first validation batches."""
    state = torch.load(checkpoint_file, weights_only=True)
    model = GPT(GPTConfig(**{**TINY_GPT, **GPT4}))
    model.load_state_dict({k[len("model.") :]: v for k, v in state.items()})
    data = tiny_data(global_batch_size=8)
    data.block_size = TINY_GPT["block_size"]
    data.setup("validate")
    losses = []
    with torch.no_grad():
        for i in range(2):
            x, y = zip(*[data._val[j] for j in range(8 * i, 8 * i + 8)])
            losses.append(model.eval()(torch.stack(x), torch.stack(y)).item())
    return float(np.mean(losses))


def strategy_eval(path: str) -> float:
    L.seed_everything(0)
    trainer = quiet_trainer(limit_val_batches=2)
    return float(trainer.validate(tiny_gpt(**GPT4), tiny_data(global_batch_size=8), ckpt_path=path, verbose=False)[0]["val_loss"])


def test_consolidated_weights_load_into_a_plain_model(saved, tmp_path):
    path = str(Path(saved["dir"]) / "step=8.ckpt")
    out = consolidate(path, str(tmp_path / "weights.pt"), weights_only=True)
    assert out["tensors"] == len(GPT(GPTConfig(**{**TINY_GPT, **GPT4})).state_dict())
    reference = run_on_ranks(strategy_eval, 1, path, timeout=300)[0]
    assert plain_eval(out["out"]) == pytest.approx(reference, rel=1e-5)
    bf16 = consolidate(path, str(tmp_path / "weights.safetensors"), dtype="bf16", weights_only=True)
    assert bf16["bytes"] < 0.6 * out["bytes"]


def test_gpt_exports_as_hugging_face_gpt2(saved, tmp_path):
    import transformers

    path = str(Path(saved["dir"]) / "step=8.ckpt")
    export_hf(path, str(tmp_path / "hf"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    ours = GPT(GPTConfig(**{**TINY_GPT, **GPT4})).eval()
    state = torch.load(consolidate(path, str(tmp_path / "w.pt"), weights_only=True)["out"], weights_only=True)
    ours.load_state_dict({k[len("model.") :]: v for k, v in state.items()})
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=x).logits, ours(x), atol=1e-5, rtol=1e-5)


def train_llama_and_save(tmp: str) -> list[list[float]]:
    L.seed_everything(0)
    trainer = quiet_trainer(max_steps=3, limit_val_batches=0, strategy=ThreeDParallelStrategy(tensor_parallel=2))
    module = HFCausalLM("llama")
    trainer.fit(module, tiny_data(global_batch_size=8))
    trainer.save_checkpoint(str(Path(tmp) / "llama.ckpt"))
    if torch.distributed.get_rank() == 0:
        dense = type(module.model.config)(**module.model.config.to_dict())
        dense.save_pretrained(str(Path(tmp) / "config"))
    module.model.eval()
    with torch.no_grad():
        logits = module.model(input_ids=torch.arange(16).view(2, 8)).logits  # gathered over tp
    return logits.tolist()


def test_hf_llama_exports_and_loads_with_from_pretrained(tmp_path):
    import transformers

    trained = run_on_ranks(train_llama_and_save, 2, str(tmp_path), timeout=300)[0]
    export_hf(str(tmp_path / "llama.ckpt"), str(tmp_path / "hf"), hf_config=str(tmp_path / "config"))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.arange(16).view(2, 8)).logits
    torch.testing.assert_close(logits, torch.tensor(trained), atol=1e-5, rtol=1e-5)


# -- safety -------------------------------------------------------------------------------------------


def async_world(tmp: str) -> dict[str, Any]:
    return run_checks(
        {
            "full": lambda: train(tmp + "/sync", 8),
            "async": lambda: train(tmp + "/async", 8, save_every=2, async_checkpoint=True, keep_last_k=2),
            "resumed": lambda: train(tmp + "/async", 8, resume=tmp + "/async/step=6.ckpt"),
        }
    )


def test_async_save_and_keep_last_k(tmp_path):
    runs = run_on_ranks(async_world, 2, str(tmp_path), timeout=600)
    for r in runs:
        np.testing.assert_allclose(result_of(r, "async"), result_of(r, "full"), rtol=1e-6)  # training is unaffected
        np.testing.assert_allclose(result_of(r, "resumed"), result_of(r, "full")[6:], rtol=1e-6)
    kept = sorted(p.name for p in (tmp_path / "async").iterdir())
    assert kept == ["step=6.ckpt", "step=8.ckpt"]  # keep_last_k=2, the last one committed at the end of fit


def test_truncated_shard_is_reported_by_name(saved, tmp_path):
    import shutil

    copy = tmp_path / "copy.ckpt"
    shutil.copytree(Path(saved["dir"]) / "step=4.ckpt", copy)
    with open(copy / "rank5.pt", "r+b") as f:
        f.truncate(100)
    checkpoint = ShardedCheckpoint(copy)
    with pytest.raises(CheckpointError, match=r"rank5\.pt is corrupt or truncated"):
        for name in checkpoint.names("model"):
            checkpoint.dense("model", name)


def test_metadata_with_code_is_refused_by_default(tmp_path, saved):
    import shutil

    copy = tmp_path / "code.ckpt"
    shutil.copytree(Path(saved["dir"]) / "step=4.ckpt", copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    from lightning_3d.checkpoint.sharded import write_file

    manifest["files"]["meta.pt"] = write_file(copy / "meta.pt", {"hyper_parameters": {"x": Path("/etc")}})
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="weights_only=True protects against code"):
        ShardedCheckpoint(copy).meta()
    assert ShardedCheckpoint(copy, weights_only=False).meta()["hyper_parameters"]["x"] == Path("/etc")


# -- processes that die --------------------------------------------------------------------------------
def _launch(out: Path, mode: str, timeout: float) -> list[subprocess.Popen]:
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {
            **{k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_RESTART_COUNT",)},
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(rank), "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2", "NODE_RANK": "0", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(ROOT / "tests" / "scripts" / "fault_worker.py"), str(out), mode, str(timeout)],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )
        )
    return procs


def _wait(procs: list[subprocess.Popen], deadline: float) -> list[str]:
    errors = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a rank was still running past timeout + 30 s: the job hung")
        errors.append(err)
    return errors


TIMEOUT = 10.0


def test_a_rank_killed_mid_training_ends_the_job_naming_it(tmp_path):
    start = time.monotonic()
    procs = _launch(tmp_path, "kill_in_training", TIMEOUT)
    errors = _wait(procs, start + TIMEOUT + 30 + 20)  # + 20 s: starting two Python processes with torch
    assert procs[1].returncode == -signal.SIGKILL
    assert procs[0].returncode != 0
    assert "rank(s) [1] stopped responding" in errors[0] or "rank 1 has not responded" in errors[0], errors[0][-3000:]


def test_a_rank_killed_during_a_save_leaves_the_previous_checkpoint(tmp_path):
    start = time.monotonic()
    procs = _launch(tmp_path, "kill_in_save", TIMEOUT)
    _wait(procs, start + TIMEOUT + 30 + 20)
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "step=2.ckpt" / "manifest.json").is_file()
    (staged,) = [p for p in ckpt.iterdir() if ".tmp-" in p.name]  # the save that died (last.ckpt after step 2)
    interrupted = ckpt / staged.name.split(".tmp-")[0]
    assert not interrupted.exists()
    with pytest.warns(UserWarning, match="was interrupted"):
        fallback = latest_complete(interrupted)
    assert fallback.name == "step=2.ckpt"
    with pytest.raises(CheckpointError, match="does not exist"):  # a save that never began: no stand-in
        latest_complete(ckpt / "step=4.ckpt")
    checkpoint = ShardedCheckpoint(fallback)
    assert all(checkpoint.dense("model", n).isfinite().all() for n in checkpoint.names("model"))


def _losses(path: Path) -> dict[int, dict[int, float]]:
    by_attempt: dict[int, dict[int, float]] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        by_attempt.setdefault(record["attempt"], {})[record["step"]] = record["loss"]
    return by_attempt


def test_torchrun_restarts_and_resumes_from_the_last_checkpoint(tmp_path):
    def torchrun(out: Path, mode: str, restarts: int) -> subprocess.CompletedProcess:
        out.mkdir()
        cmd = [
            str(Path(sys.executable).parent / "torchrun"), "--nnodes=1", "--nproc-per-node=2", f"--max-restarts={restarts}",
            "--master-addr=127.0.0.1", f"--master-port={free_port()}",
            str(ROOT / "tests" / "scripts" / "fault_worker.py"), str(out), mode, str(TIMEOUT),
        ]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)

    (tmp_path / "plain").mkdir()  # the uninterrupted run (the reference) on harness ranks: no fresh processes
    run_on_ranks(run_fault_worker, 2, str(tmp_path / "plain"), "none", str(TIMEOUT), timeout=300)
    elastic = torchrun(tmp_path / "elastic", "elastic", 1)
    assert elastic.returncode == 0, elastic.stderr[-3000:]
    reference = _losses(tmp_path / "plain" / "rank0.jsonl")[0]
    attempts = _losses(tmp_path / "elastic" / "rank0.jsonl")
    assert set(attempts) == {0, 1} and max(attempts[0]) < 8  # the first attempt died, the second finished
    resumed = attempts[1]
    assert min(resumed) == 5  # resumed from the checkpoint written after step 4
    np.testing.assert_allclose([resumed[s] for s in sorted(resumed)], [reference[s] for s in sorted(resumed)], rtol=1e-6)


def test_a_layout_saved_before_context_parallel_is_the_same_layout_at_cp1():
    from lightning_3d.checkpoint.manager import is_same_layout

    now = {"dp": 2, "tp": 2, "pp": 1, "cp": 1, "ep": 1, "zero_stage": 1, "virtual_stages": 1}
    assert is_same_layout({k: v for k, v in now.items() if k not in ("cp", "ep")}, now)  # random streams are restored
    assert not is_same_layout({k: v for k, v in now.items() if k != "ep"}, {**now, "ep": 2})  # experts re-cut
    assert not is_same_layout({k: v for k, v in now.items() if k != "cp"}, {**now, "cp": 2, "dp": 1})
    assert not is_same_layout({**now, "dp": 4}, now)
