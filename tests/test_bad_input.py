"""Bad input gets the right answer or a clear refusal (issue 14 items 1, 2 and 9): checkpoint paths
that do not exist, interrupted saves of another run, a checkpoint of another model, the CLI's
user errors, and precision values the strategy cannot run."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_3d import ThreeDParallelStrategy
from lightning_3d.apps import cli
from lightning_3d.checkpoint.sharded import FORMAT, MANIFEST, CheckpointError, latest_complete
from lightning_3d.testing.harness import run_on_ranks
from tests.helpers import quiet_trainer, result_of, run_checks, tiny_data, tiny_gpt


def _fake_checkpoint(path: Path, step: int, run_id: str) -> Path:
    path.mkdir(parents=True)
    (path / MANIFEST).write_text(json.dumps({"format": FORMAT, "step": step, "run_id": run_id, "pieces": [], "files": {}}))
    return path


# -- which checkpoint a path means ------------------------------------------------------------------------
def test_a_missing_path_is_an_error_even_with_checkpoints_beside_it(tmp_path):
    _fake_checkpoint(tmp_path / "step=2.ckpt", 2, "run-a")
    with pytest.raises(CheckpointError, match=r"step=999.ckpt does not exist\. Complete checkpoints in .*: step=2.ckpt"):
        latest_complete(tmp_path / "step=999.ckpt")


def test_an_interrupted_save_falls_back_to_the_newest_checkpoint_of_its_own_run(tmp_path):
    _fake_checkpoint(tmp_path / "step=2.ckpt", 2, "run-a")
    _fake_checkpoint(tmp_path / "step=3.ckpt", 3, "run-b")  # newer, but another run's
    (tmp_path / "step=4.ckpt.tmp-run-a.1234").mkdir()  # the save of step 4 began and never finished
    with pytest.warns(UserWarning, match="was interrupted"):
        assert latest_complete(tmp_path / "step=4.ckpt") == tmp_path / "step=2.ckpt"
    with pytest.raises(CheckpointError, match="its save was interrupted. The newest complete checkpoint of the same run is"):
        latest_complete(tmp_path / "step=4.ckpt", fallback=False)


def test_the_fallback_takes_the_newest_written_not_the_highest_step(tmp_path):
    """A run rolled back from step 1000 to 500 in the same directory continues from its new timeline."""
    for step, created in ((1000, 1.0), (550, 2.0)):
        path = _fake_checkpoint(tmp_path / f"step={step}.ckpt", step, "run-a")
        manifest = json.loads((path / MANIFEST).read_text())
        (path / MANIFEST).write_text(json.dumps({**manifest, "created": created}))
    (tmp_path / "step=650.ckpt.tmp-run-a.99").mkdir()
    with pytest.warns(UserWarning, match="was interrupted"):
        assert latest_complete(tmp_path / "step=650.ckpt") == tmp_path / "step=550.ckpt"


def test_a_save_that_crashed_between_its_renames_is_used_whole(tmp_path):
    _fake_checkpoint(tmp_path / "step=2.ckpt", 2, "run-a")
    staged = _fake_checkpoint(tmp_path / "last.ckpt.tmp-run-a.77", 4, "run-a")  # manifest written, not renamed
    manifest = json.loads((staged / MANIFEST).read_text())
    (staged / MANIFEST).write_text(json.dumps({**manifest, "created": 9e9}))
    with pytest.warns(UserWarning, match="was interrupted"):
        assert latest_complete(tmp_path / "last.ckpt") == staged


def test_an_interrupted_save_without_a_checkpoint_of_its_run_is_an_error(tmp_path):
    _fake_checkpoint(tmp_path / "step=3.ckpt", 3, "run-b")
    (tmp_path / "step=4.ckpt.tmp-run-a.1234").mkdir()
    with pytest.raises(CheckpointError, match="no complete checkpoint of the same run is beside it"):
        latest_complete(tmp_path / "step=4.ckpt")


def test_a_directory_that_is_not_a_checkpoint_is_named_as_such(tmp_path):
    (tmp_path / "notes").mkdir()
    with pytest.raises(CheckpointError, match="is not a complete lightning_3d sharded checkpoint"):
        latest_complete(tmp_path / "notes")


# -- the same, end to end, plus a checkpoint of another model ---------------------------------------------
def _fit(model: Any, root: str, steps: int, ckpt_path: Any = None, save: bool = False) -> L.Trainer:
    L.seed_everything(0)
    callbacks = [ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_top_k=-1, filename="{step}")] if save else []
    trainer = quiet_trainer(
        max_steps=steps, limit_val_batches=0, callbacks=callbacks, enable_checkpointing=save,
        strategy=ThreeDParallelStrategy(tensor_parallel=2),
    )
    trainer.fit(model, tiny_data(global_batch_size=4), ckpt_path=ckpt_path)
    return trainer


def _refusal(call: Any) -> str:
    try:
        call()
    except Exception as err:  # noqa: BLE001 - the test reads the message
        return f"{type(err).__name__}: {err}"
    return "no error"


def _unwritable_checkpoints(root: str) -> None:
    """A checkpoint directory no rank can create (its parent is a file: root writes anywhere else)."""
    blocker = Path(root) / "not-a-directory"
    blocker.touch()
    trainer = quiet_trainer(
        max_steps=2, limit_val_batches=0, enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=str(blocker / "ckpt"), every_n_train_steps=1)],
    )
    trainer.fit(tiny_gpt(), tiny_data(global_batch_size=4))


def _damaged_pieces(path: Path, copy: Path) -> str:
    """A manifest that lost one tensor-parallel rank's piece of a weight (issue 32: never refused)."""
    import shutil

    from lightning_3d.checkpoint.sharded import ShardedCheckpoint

    shutil.copytree(path, copy)
    manifest = json.loads((copy / MANIFEST).read_text())
    name = "model.blocks.0.mlp.fc.weight"
    manifest["pieces"] = [p for p in manifest["pieces"] if not (p["name"] == name and p["tp"].get("rank") == 1)]
    (copy / MANIFEST).write_text(json.dumps(manifest))
    return _refusal(lambda: ShardedCheckpoint(copy).dense("model", name))


def _one_call_load(path: Path) -> dict[str, Any]:
    """Issue 32: MyModule.load_from_checkpoint(sharded_dir) raised IsADirectoryError; lightning_3d's
    one call loads it in a plain process (here each rank alone, as a user's notebook would)."""
    import lightning_3d
    from lightning_3d.checkpoint.consolidate import dense_state_dict
    from lightning_3d.checkpoint.sharded import ShardedCheckpoint
    from lightning_3d.models import GPTModule

    try:
        GPTModule.load_from_checkpoint(str(path))
        lightning = "no error"
    except IsADirectoryError as err:
        lightning = f"IsADirectoryError: {err}"
    module = lightning_3d.load_from_checkpoint(GPTModule, path)
    dense = dense_state_dict(ShardedCheckpoint(path))
    loaded = module.state_dict()
    return {
        "lightning": lightning,
        "equal": sorted(loaded) == sorted(dense) and all(torch.equal(loaded[k], dense[k]) for k in dense),
        "n_layer": module.config.n_layer,
    }


def _resume_world(root: str) -> dict[str, Any]:
    ckpt = Path(root)
    return run_checks({
        "train": lambda: _fit(tiny_gpt(), root, 2, save=True) and sorted(p.name for p in ckpt.iterdir()),
        "one_call_load": lambda: _one_call_load(ckpt / "step=2.ckpt"),
        "damaged_pieces": lambda: _damaged_pieces(ckpt / "step=2.ckpt", Path(root) / f"damaged{dist.get_rank()}"),
        "mistyped": lambda: _refusal(lambda: _fit(tiny_gpt(), root, 4, ckpt_path=str(ckpt / "step=999.ckpt"))),
        "other_model": lambda: _refusal(lambda: _fit(tiny_gpt(n_embd=64), root, 4, ckpt_path=str(ckpt / "step=2.ckpt"))),
        # tensors that happen to fit: another head count (the same shapes), fewer layers (a subset of the keys)
        "other_heads": lambda: _refusal(lambda: _fit(tiny_gpt(n_head=2), root, 4, ckpt_path=str(ckpt / "step=2.ckpt"))),
        "fewer_layers": lambda: _refusal(lambda: _fit(tiny_gpt(n_layer=1), root, 4, ckpt_path=str(ckpt / "step=2.ckpt"))),
        "unwritable": lambda: _refusal(lambda: _unwritable_checkpoints(root)),
        # (was a ZeroDivisionError at step 1)
        "accumulate_zero": lambda: _refusal(lambda: quiet_trainer(max_steps=1, accumulate_grad_batches=0).fit(tiny_gpt(), tiny_data())),
        "resumed": lambda: _fit(tiny_gpt(), root, 4, ckpt_path=str(ckpt / "step=2.ckpt"), save=True) and [
            json.loads((ckpt / name / MANIFEST).read_text())["run_id"] for name in ("step=2.ckpt", "step=4.ckpt")
        ],
    })


@pytest.fixture(scope="module")
def resume_world() -> dict[str, Any]:
    return run_on_ranks(_resume_world, 2, tempfile.mkdtemp(prefix="l3d-bad-input-"), timeout=300)[0]


def test_fit_with_a_mistyped_ckpt_path_refuses_instead_of_resuming_a_sibling(resume_world):
    assert result_of(resume_world, "train") == ["step=2.ckpt"]
    message = result_of(resume_world, "mistyped")
    assert message.startswith("CheckpointError: checkpoint ") and "step=999.ckpt does not exist" in message, message


def test_a_checkpoint_of_another_model_is_refused_naming_the_configuration(resume_world):
    message = result_of(resume_world, "other_model")
    assert message.startswith("ValueError: checkpoint "), message
    assert "was saved from a different model: its configuration differs: " in message, message
    assert "n_embd=32 in the checkpoint, 64 here" in message and "differ in shape" in message, message
    assert len(message) < 1200  # one message, not a list of shard shapes


def test_a_checkpoint_whose_tensors_happen_to_fit_another_model_is_refused(resume_world):
    """Issue 32: before, another n_head (same tensor shapes) or fewer layers (the extra keys dropped)
    resumed and trained on, exit 0."""
    heads = result_of(resume_world, "other_heads")
    assert heads.startswith("ValueError: checkpoint ") and "was saved from a different model: " in heads, heads
    assert "GPTConfig.n_head=4 in the checkpoint, 2 here" in heads, heads
    layers = result_of(resume_world, "fewer_layers")
    assert "GPTConfig.n_layer=2 in the checkpoint, 1 here" in layers, layers
    assert "tensor(s) in the checkpoint but not in the model: model.blocks.1." in layers and "strict_loading = False" in layers, layers


def test_a_manifest_missing_a_pieces_of_a_weight_is_refused_naming_it(resume_world):
    message = result_of(resume_world, "damaged_pieces")
    assert message.startswith("CheckpointError:") and "pieces of 'model.blocks.0.mlp.fc.weight' are missing (tensor-parallel ranks [1])" in message, message


def test_a_sharded_checkpoint_loads_in_one_call(resume_world):
    result = result_of(resume_world, "one_call_load")
    assert result["lightning"].startswith("IsADirectoryError")  # Lightning's classmethod reads one file
    assert result["equal"] and result["n_layer"] == 2


def test_a_checkpoint_directory_that_cannot_be_written_is_refused_before_step_1(resume_world):
    message = result_of(resume_world, "unwritable")
    assert message.startswith("PermissionError: ModelCheckpoint(dirpath=") and "cannot be written (" in message, message
    assert "would fail at the first save" in message


def test_accumulate_grad_batches_zero_is_refused_by_name(resume_world):
    message = result_of(resume_world, "accumulate_zero")
    assert message.startswith("ValueError: Trainer(accumulate_grad_batches=0) is invalid"), message


def test_a_resumed_run_keeps_its_run_id_for_later_saves(resume_world):
    first, later = result_of(resume_world, "resumed")
    assert first and first == later


# -- the command line -------------------------------------------------------------------------------------
def test_consolidate_of_a_mistyped_path_exits_2_with_one_line(tmp_path, capsys):
    _fake_checkpoint(tmp_path / "step=2.ckpt", 2, "run-a")
    code = cli.main(["consolidate", str(tmp_path / "step=9.ckpt"), str(tmp_path / "out.pt")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("lightning-3d consolidate: error: checkpoint ") and "does not exist" in err, err
    assert "Traceback" not in err and not (tmp_path / "out.pt").exists()


def test_a_cli_user_error_is_one_line_but_an_internal_error_keeps_its_traceback(tmp_path, capsys, monkeypatch):
    code = cli.main(["plan", "--layout", "tp=two"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "tp='two'" in err and "Traceback" not in err, err

    import lightning_3d.checkpoint.consolidate as consolidate

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("an internal bug")

    monkeypatch.setattr(consolidate, "consolidate", broken)
    with pytest.raises(RuntimeError, match="an internal bug"):
        cli.main(["consolidate", str(tmp_path), str(tmp_path / "out.pt")])


# -- precision values the strategy cannot run -------------------------------------------------------------
@pytest.mark.parametrize("precision", ["transformer-engine", "transformer-engine-float16", "16-true", "64-true"])
def test_unsupported_precision_is_refused_by_the_strategy_not_by_an_import_error(precision):
    with pytest.raises(ValueError, match=rf"precision='{precision}' is not supported by ThreeDParallelStrategy; use '32-true'"):
        L.Trainer(strategy=ThreeDParallelStrategy(), accelerator="cpu", devices=2, precision=precision, logger=False)


def test_a_recipes_ckpt_path_last_finds_the_run_it_means(tmp_path):
    """Issue 32: Hydra gives each run a new outputs/<date>/<time>, so ckpt_path=last looked in an empty
    directory and started from step 0 (exit 0). It means the newest complete checkpoint of this run, else
    of an earlier run of the same command (its overrides); a run with other overrides (a sweep's other
    job, another experiment) is never taken (found in review); nothing is an error saying where it looked."""
    from lightning_3d.apps.recipe import resolve_ckpt_path

    def run(name: str, *overrides: str) -> Path:
        directory = outputs / name
        (directory / ".hydra").mkdir(parents=True)
        (directory / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
        return directory

    outputs = tmp_path / "outputs"
    new_run = run("2026-12-02/09-00-00", "parallel=dp", "ckpt_path=last")
    assert resolve_ckpt_path("some/path.ckpt", new_run) == "some/path.ckpt" and resolve_ckpt_path(None, new_run) is None
    with pytest.raises(ValueError, match=r"ckpt_path=last: no complete checkpoint in this run's .* nor in an earlier run of the same command"):
        resolve_ckpt_path("last", new_run)
    older = _fake_checkpoint(run("2026-12-01/10-00-00", "parallel=dp") / "checkpoints" / "step000004.ckpt", 4, "run-a")
    newer = _fake_checkpoint(run("2026-12-01/11-00-00", "parallel=dp") / "checkpoints" / "step000002.ckpt", 2, "run-b")
    other = _fake_checkpoint(run("2026-12-01/12-00-00", "parallel=dp", "seed=2") / "checkpoints" / "step000009.ckpt", 9, "run-x")
    os.utime(older / MANIFEST, (1, 1)), os.utime(older, (1, 1))
    assert resolve_ckpt_path("last", new_run) == str(newer)  # the newest written of the same command, not the highest step
    only_other = run("2026-12-02/10-00-00", "parallel=dp", "seed=3")
    with pytest.raises(ValueError, match=r"checkpoints of other runs \(other overrides, not taken\): .*step000009"):
        resolve_ckpt_path("last", only_other)
    own = _fake_checkpoint(new_run / "checkpoints" / "step000001.ckpt", 1, "run-c")
    os.utime(own, (2, 2))
    assert resolve_ckpt_path("last", new_run) == str(own) and other.exists()  # this run's own checkpoint first


def test_a_mistyped_override_is_one_line_and_exit_2_everywhere(capsys, tmp_path):
    """Issue 32: `plan` / `dry-run` with an unknown option or key printed Hydra's 60-line traceback and
    exited 1, suggesting `+key` (which appends the typo); recipes the same through Hydra."""
    import subprocess
    import sys

    from tests.test_launchers import ROOT

    for argv, expected in (
        (["plan", "recipe=llama3_70bb"], "recipe=llama3_70bb: there is no such recipe config; Did you mean recipe=llama3_70b?"),
        (["dry-run", "parallel.zero_stge=1"], "parallel.zero_stge: the config has no such key"),
    ):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expected in err[0], err
    assert "Did you mean parallel.zero_stage?" in err[0] and "a typo would then be trained on in silence" in err[0]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "train.py"), "model.n_layerz=3"], capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr[-2000:]
    assert "recipes/train.py: error: model.n_layerz: the config has no such key" in proc.stderr and "Did you mean model.n_layer?" in proc.stderr
    proc = subprocess.run(  # a value refused inside the run: the same one line, not Hydra's "Error executing job"
        [sys.executable, str(ROOT / "recipes" / "train.py"), "data.global_batch_size=0", f"hydra.run.dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "recipes/train.py: error: global_batch_size=0 is invalid: it must be a positive whole number" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "Error executing job" not in proc.stderr


def test_num_nodes_larger_than_the_nodes_started_says_which_ranks_never_joined(tmp_path):
    """Issue 32: num_nodes=2 with one node printed a C++ frame dump at the rendezvous timeout."""
    import subprocess
    import sys

    from tests.test_launchers import ROOT

    script = (
        "import lightning as L\n"
        "from lightning_3d import ThreeDParallelStrategy\n"
        "from tests.helpers import tiny_data, tiny_gpt\n"
        "t = L.Trainer(strategy=ThreeDParallelStrategy(timeout=5, health_check=False), accelerator='cpu', devices=1, num_nodes=2,"
        " max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)\n"
        "t.fit(tiny_gpt(), tiny_data(global_batch_size=2))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)})
    assert proc.returncode != 0
    assert "the job did not form within timeout=5 s (" in proc.stderr and "it expects 2 ranks (num_nodes=2 x devices=1)" in proc.stderr, proc.stderr[-3000:]
    assert "Start the same command on every node" in proc.stderr and "frame #" not in proc.stderr


def test_a_strategy_argument_refused_under_the_cli_is_our_sentence_alone(capsys):
    """jsonargparse wrapped the strategy's own refusal in its Union bookkeeping (a 1,500-character line)."""
    argv = ["fit", "--trainer.accelerator=cpu", "--trainer.strategy=lightning_3d.ThreeDParallelStrategy", "--trainer.strategy.zero_stage=9"]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "lightning-3d fit: error: zero_stage=9 is invalid: choose 0, 1, 2 or 3."
