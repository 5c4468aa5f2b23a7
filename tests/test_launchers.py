"""Real launches in subprocesses: torchrun with 2 "nodes", the Hydra recipe, the LightningCLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from lightning_3d.testing.harness import free_port, run_on_ranks
from tests.helpers import STEPS, TINY_GPT, gpt_losses

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TIMEOUT = 300


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return env


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}"
    return proc


def test_torchrun_two_nodes_of_two(tmp_path):
    port = str(free_port())
    nodes = [
        subprocess.Popen(
            [
                str(BIN / "torchrun"),
                "--nnodes=2",
                "--nproc-per-node=2",
                f"--node-rank={node}",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                str(ROOT / "tests" / "scripts" / "torchrun_fit.py"),
                str(tmp_path),
            ],
            cwd=tmp_path,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=TIMEOUT)[0] for p in nodes]
    finally:
        for p in nodes:
            p.kill()
    assert all(p.returncode == 0 for p in nodes), "\n".join(o[-3000:] for o in outputs)

    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    # Layout: global rank = node * 2 + local rank; tp pairs are the two ranks of one node.
    for r, info in enumerate(ranks):
        assert info["rank"] == r and info["node"] == r // 2 and info["local_rank"] == r % 2
        assert info["tp_group"] == [2 * (r // 2), 2 * (r // 2) + 1]
        assert info["coords"] == [0, r // 2, r % 2, 0]  # (pp, dp, tp, cp)
    # Losses: dp=4 over two nodes equals one process on the same global batch.
    reference = run_on_ranks(gpt_losses, 1, timeout=TIMEOUT)[0]["losses"]
    ours = np.mean([info["losses"] for info in ranks], axis=0)
    assert len(ours) == STEPS
    np.testing.assert_allclose(ours, reference, rtol=1e-5)
    assert len({info["checksum"] for info in ranks}) == 1


@pytest.mark.parametrize(
    ("overrides", "layout"),
    [
        pytest.param(["parallel=dp", "cluster.devices_per_node=2"], {"dp": 2, "tp": 1, "pp": 1, "cp": 1, "zero_stage": 0}, marks=pytest.mark.slow),
        (
            ["parallel=dp", "cluster.devices_per_node=2", "parallel.tensor_parallel=2", "parallel.sequence_parallel=true"],
            {"dp": 1, "tp": 2, "pp": 1, "cp": 1, "zero_stage": 0},
        ),
        # the default (3D on 8 CPU processes; bloom_176b_tiny runs the same layout in `make test`) and
        # plain dp2 (the multirun test runs it) are in `make test-slow`
        pytest.param([], {"dp": 2, "tp": 2, "pp": 2, "cp": 1, "zero_stage": 1}, marks=pytest.mark.slow),
    ],
    ids=["dp2", "tp2-sp", "default-3d"],
)
def test_hydra_recipe_with_overrides(tmp_path, overrides, layout):
    run_dir = tmp_path / "run"
    proc = _run(
        [
            sys.executable,
            str(ROOT / "recipes" / "train.py"),
            *overrides,
            "trainer.max_steps=12",
            "trainer.val_check_interval=6",
            "trainer.limit_val_batches=2",
            "trainer.enable_progress_bar=false",
            "checkpoint_every=6",
            "data.max_bytes=200000",
            "optim.warmup_steps=2",
            "optim.lr=1e-2",
            *[f"model.{k}={v}" for k, v in TINY_GPT.items()],
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,
    )
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["world_size"] == layout["dp"] * layout["tp"] * layout["pp"] and summary["steps"] == 12
    assert summary["layout"] == layout
    assert summary["train_loss"] < 4.5 and summary["val_loss"] < 4.5  # ln(256) = 5.55 at the start
    assert summary["tokens_per_s"] > 0 and summary["peak_memory_mb"] > 0
    assert (Path(summary["checkpoint"]) / "manifest.json").is_file()  # a complete sharded checkpoint
    png = Path(summary["loss_curve"])
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((run_dir / "summary.json").read_text()) == summary


CLI_MODEL = [f"--model.config.{k}={v}" for k, v in TINY_GPT.items()]
CLI_COMMON = [
    "--trainer.accelerator=cpu",
    "--trainer.devices=2",
    "--trainer.max_steps=3",
    "--trainer.limit_val_batches=2",
    "--trainer.enable_progress_bar=false",
    "--data.max_bytes=100000",
    "--data.global_batch_size=4",
]


@pytest.mark.parametrize(
    "strategy_args",
    [
        # by name: `make test-slow` (test_cli_prepare_then_fit_on_the_token_file runs the same command on a
        # token file in `make test`, with these assertions); by class path, as flags and in YAML: `make
        # test-slow` (the subclass-mode test names the strategy by class path in `make test`)
        pytest.param(["--trainer.strategy=3d"], marks=pytest.mark.slow),
        pytest.param(["--trainer.strategy=lightning_3d.ThreeDParallelStrategy", "--trainer.strategy.data_parallel=2"], marks=pytest.mark.slow),
        pytest.param("yaml", marks=pytest.mark.slow),
    ],
    ids=["name", "class-flags", "yaml-class-path"],
)
def test_lightning_cli_fit(tmp_path, strategy_args):
    if strategy_args == "yaml":
        config = {
            "trainer": {
                "strategy": {
                    "class_path": "lightning_3d.ThreeDParallelStrategy",
                    "init_args": {"data_parallel": 2, "timeout": 120},
                }
            }
        }
        (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
        strategy_args = ["--config=run.yaml"]
    _run([str(BIN / "lightning-3d"), "fit", *strategy_args, *CLI_COMMON, *CLI_MODEL], cwd=tmp_path)
    _check_cli_run(tmp_path)


def _check_cli_run(work: Path) -> None:
    """LightningCLI saved the run's config with our strategy, and the checkpoint is a complete sharded one."""
    saved = yaml.safe_load((work / "lightning_logs" / "version_0" / "config.yaml").read_text())
    assert "3d" in str(saved["trainer"]["strategy"]) or "ThreeDParallelStrategy" in str(saved["trainer"]["strategy"])
    assert (work / "lightning_logs" / "version_0" / "checkpoints" / "epoch=0-step=3.ckpt" / "manifest.json").is_file()


def test_cli_prepare_then_fit_on_the_token_file(tmp_path):
    corpus = tmp_path / "texts"
    corpus.mkdir()
    (corpus / "a.txt").write_text("hello lightning 3d " * 4000)
    proc = _run([str(BIN / "lightning-3d"), "prepare", "data/corpus.bin", str(corpus)], cwd=tmp_path)
    meta = json.loads(proc.stdout.strip().splitlines()[-1])
    assert meta["num_tokens"] == len("hello lightning 3d ") * 4000 and meta["dtype"] == "uint16"
    _run(
        [str(BIN / "lightning-3d"), "fit", "--trainer.strategy=3d", "--data.source=data/corpus.bin", *CLI_COMMON, *CLI_MODEL],
        cwd=tmp_path,
    )
    _check_cli_run(tmp_path)


def test_lightning_cli_fit_trains_the_users_classes(tmp_path):
    """``--model``/``--data`` name the user's own LightningModule and DataModule (LightningCLI subclass
    mode) and they train under the 3D strategy at tensor_parallel=2; without them GPTModule stays the
    default (the tests above)."""
    _run(
        [
            str(BIN / "lightning-3d"), "fit",
            "--model", "tests.cli_user_classes.MyLanguageModel", f"--model.marker_dir={tmp_path}",
            "--data", "tests.cli_user_classes.MyTokenData", "--data.batch_size=2",
            "--trainer.strategy=lightning_3d.ThreeDParallelStrategy", "--trainer.strategy.tensor_parallel=2",
            "--trainer.devices=2", "--trainer.accelerator=cpu", "--trainer.max_steps=2",
            "--trainer.enable_progress_bar=false", "--trainer.enable_checkpointing=false", "--trainer.logger=false",
        ],
        cwd=tmp_path,
    )
    ffn_rows = 4 * 32 // 2  # hidden 32, ffn 4x, split over tp=2
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}.txt").read_text().split() == [
            "MyLanguageModel", "MyTokenData", "steps=2", f"fc_rows={ffn_rows}"
        ]


def test_lightning_cli_fit_of_a_module_with_its_own_loaders_needs_no_data(tmp_path):
    """Issue 32: without ``--data`` a user's module with its own ``train_dataloader`` trained on
    TextDataModule, which failed after spawning ("TextDataModule(block_size=None) needs ..."); LightningCLI's
    convention is the module's own loaders."""
    _run(
        [
            str(BIN / "lightning-3d"), "fit",
            "--model", "tests.cli_user_classes.MyLanguageModelWithData", f"--model.marker_dir={tmp_path}",
            "--trainer.devices=2", "--trainer.accelerator=cpu", "--trainer.max_steps=2", "--trainer.strategy=3d",
            "--trainer.enable_progress_bar=false", "--trainer.enable_checkpointing=false", "--trainer.logger=false",
        ],
        cwd=tmp_path,
    )
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}.txt").read_text().split()[:3] == ["MyLanguageModelWithData", "NoneType", "steps=2"]


def test_hydra_multirun_with_several_ranks_per_job_writes_under_the_sweep_dir(tmp_path):
    """``-m`` with 2 jobs x 2 local ranks: each job's ranks run that job alone (not the whole sweep) and
    write its outputs under ``hydra.sweep.dir/<job>``; nothing lands in ``hydra.run.dir``."""
    sweep_dir, run_dir = tmp_path / "sweep", tmp_path / "run"
    proc = _run(
        [
            sys.executable, str(ROOT / "recipes" / "train.py"), "-m",
            "parallel=dp", "cluster.devices_per_node=2", "seed=1,2",
            "trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
            "trainer.enable_progress_bar=false", "data.max_bytes=100000",
            *[f"model.{k}={v}" for k, v in TINY_GPT.items()],
            f"hydra.sweep.dir={sweep_dir}", f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,
    )
    summaries = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(summaries) == 2, proc.stdout  # one per job, from its rank 0
    for job, summary in enumerate(summaries):
        out = sweep_dir / str(job)
        assert json.loads((out / "summary.json").read_text()) == summary
        assert summary["world_size"] == 2 and summary["steps"] == 2
        assert Path(summary["checkpoint"]).parent == out / "checkpoints" and (out / "checkpoints" / "last.ckpt" / "manifest.json").is_file()
        assert (out / "train_ddp_process_1.log").is_file()  # the job's other rank ran there too
    assert sorted(p.name for p in sweep_dir.iterdir()) == ["0", "1", "multirun.yaml"]
    assert not run_dir.exists(), sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
