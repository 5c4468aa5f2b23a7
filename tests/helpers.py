"""Shared pieces for tests: tiny models, quiet Trainers, loss recording, per-check isolation."""

from __future__ import annotations

import os
import tempfile
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable

import lightning as L
import torch

from lightning_3d.data import TextDataModule
from lightning_3d.models import GPTConfig, GPTModule

TINY_GPT = dict(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=32)


def world_shape() -> tuple[int, int]:
    """(devices per node, nodes) of this world: the harness's process group, or torchrun's variables."""
    if torch.distributed.is_initialized():
        # Not $WORLD_SIZE: Lightning's environment deletes it at teardown.
        return torch.distributed.get_world_size(), 1
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return per_node, int(os.environ.get("WORLD_SIZE", per_node)) // per_node


def tiny_gpt(lr: float = 1e-2, **overrides: Any) -> GPTModule:
    return GPTModule(GPTConfig(**{**TINY_GPT, **overrides}), lr=lr, warmup_steps=2)


def tiny_data(global_batch_size: int = 8, **overrides: Any) -> TextDataModule:
    kwargs = dict(block_size=TINY_GPT["block_size"], global_batch_size=global_batch_size, max_bytes=200_000)
    return TextDataModule(**{**kwargs, **overrides})


def quiet_trainer(**kwargs: Any) -> L.Trainer:
    """A Trainer for tests: CPU, all ranks of this world, no files unless asked for."""
    defaults = dict(
        strategy="3d",
        accelerator="cpu",
        devices=world_shape()[0],
        num_nodes=world_shape()[1],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    defaults.update(kwargs)
    if "default_root_dir" not in defaults:  # Lightning's default checkpoint callback writes there (else the cwd)
        # under the session's base temp (tests/conftest.py), which pytest removes: each fit used to leave a directory in /tmp
        defaults["default_root_dir"] = tempfile.mkdtemp(prefix="l3d-trainer-", dir=os.environ.get("LIGHTNING_3D_TEST_TMP"))
    return L.Trainer(**defaults)


class LossRecorder(L.Callback):
    """Collects this rank's training loss of every batch (before any cross-rank reduction)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, i: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))


def param_checksum(module: torch.nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in module.parameters()))


def run_checks(checks: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Run several checks in one world; a failing check is reported as a traceback, not a dead world.

    Every rank runs every check in the same order, so collectives still line up after a failure
    on all ranks; a failure on one rank only would desynchronize the world, which the harness's
    timeout then reports.
    """
    results: dict[str, Any] = {}
    for name, check in checks.items():
        try:
            results[name] = check()
        except Exception:  # noqa: BLE001
            results[name] = {"error": traceback.format_exc()}
    return results


def refusal_message(call: Callable[[], Any]) -> str:
    """What ``call`` was refused with (a ``ValueError``, or a ``NotImplementedError``: refused before
    step 1 all the same), or ``"not refused"``."""
    try:
        call()
    except (ValueError, NotImplementedError) as err:
        return str(err)
    return "not refused"


def result_of(results: dict[str, Any], name: str) -> Any:
    """The check's value, or a test failure showing the rank's traceback."""
    import pytest

    value = results[name]
    if isinstance(value, dict) and "error" in value:
        pytest.fail(f"check {name!r} raised on a rank:\n{value['error']}")
    return value


STEPS = 5  # optimizer steps of the parity runs (docs/testing.md: at least 3)


def gpt_losses() -> dict[str, Any]:
    """Per-rank losses of STEPS steps of the tiny GPT at a global batch of 8 (the parity workload)."""
    L.seed_everything(0)
    recorder = LossRecorder()
    model = tiny_gpt()
    trainer = quiet_trainer(max_steps=STEPS, limit_val_batches=0, callbacks=[recorder], gradient_clip_val=1.0)
    trainer.fit(model, tiny_data(global_batch_size=8))
    return {"losses": recorder.losses, "checksum": param_checksum(model)}


def run_fault_worker(*argv: str) -> None:
    """tests/scripts/fault_worker.py with ``argv`` as one rank of a harness world (``run_on_ranks``): the
    uninterrupted reference of a fault test, trained the same way without a launcher's fresh processes
    (each pays ~5 CPU-s of imports)."""
    import runpy
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent / "scripts" / "fault_worker.py"
    sys.argv = [str(script), *argv]
    runpy.run_path(str(script), run_name="__main__")


@contextmanager
def host_reads_logged(log: list[str]) -> Iterator[None]:
    """Record every read of a tensor's value by the host (each one a device sync on a GPU)."""
    names = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def logged(name: str) -> Callable[..., Any]:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            log.append(name + " at " + "".join(traceback.format_stack(limit=4)[:-1]))
            return saved[name](self, *args, **kwargs)

        return read

    for name in names:
        setattr(torch.Tensor, name, logged(name))
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
