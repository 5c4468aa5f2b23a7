"""A 2-rank training job for fault tests, started by hand (env vars) or by torchrun.

    fault_worker.py OUT MODE [TIMEOUT]
    MODE: none | kill_in_training | kill_in_save | elastic

Every rank appends {"attempt", "step", "loss"} lines to OUT/rank<r>.jsonl.
"""

import json
import os
import signal
import sys
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_3d.checkpoint.manager as manager
from lightning_3d import ThreeDParallelStrategy
from tests.helpers import quiet_trainer, tiny_data, tiny_gpt

out, mode = Path(sys.argv[1]), sys.argv[2]
timeout = float(sys.argv[3]) if len(sys.argv) > 3 else 20.0
rank = int(os.environ["RANK"])
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class Record(L.Callback):
    def on_train_batch_start(self, trainer, module, batch, i):  # noqa: ANN001
        step = trainer.global_step
        if rank == 1 and step == 3 and mode == "kill_in_training":
            die()
        if rank == 1 and step == 5 and mode == "elastic" and attempt == 0:
            die()

    def on_train_batch_end(self, trainer, module, outputs, batch, i):  # noqa: ANN001
        with open(out / f"rank{rank}.jsonl", "a") as f:
            f.write(json.dumps({"attempt": attempt, "step": trainer.global_step, "loss": float(outputs["loss"])}) + "\n")


if mode == "kill_in_save" and rank == 1:  # die half-way through writing the second checkpoint
    original, calls = manager.write_rank_shard, []

    def write_then_die(tmp, shard):  # noqa: ANN001
        calls.append(1)
        if len(calls) == 2:
            (tmp / f"rank{rank}.pt").write_bytes(b"\x00" * 1000)  # a partial file
            die()
        return original(tmp, shard)

    manager.write_rank_shard = write_then_die

L.seed_everything(0)
checkpoint = ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=2, save_top_k=-1, filename="{step}", save_last=True)
trainer = quiet_trainer(
    max_steps=8,
    limit_val_batches=0,
    enable_checkpointing=True,
    callbacks=[Record(), checkpoint],
    strategy=ThreeDParallelStrategy(timeout=timeout),
)
trainer.fit(tiny_gpt(lr=3e-3), tiny_data(global_batch_size=8), ckpt_path="last" if mode == "elastic" else None)
