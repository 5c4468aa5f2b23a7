"""A small training job for fault tests, started by hand (env vars), by torchrun, or by Lightning.

    fault_worker.py OUT MODE [TIMEOUT] [DEVICES]
    MODE: none | kill_in_training | kill_in_save | elastic
          | freeze_in_training   rank $FAULT_RANK (default: the last) stops itself (SIGSTOP) at step 3
          | raise_in_training    rank $FAULT_RANK (default: every rank) raises ValueError at step 3
          | slow                 every step sleeps 0.5 s, until killed (for a test that kills rank 0 from outside)
          | sigterm              12 steps of 0.4 s (a test sends SIGTERM part-way); exit 143 when interrupted
          | resume               the same 12-step run resumed from $RESUME_FROM
          | full12               the same 12-step run, uninterrupted (the reference)
          | elastic_node         12 steps at a global batch of 24 (0.4 s each in the first attempt, for a test that
                                 kills a node's agent), resumed from the last checkpoint at whatever size restarts
          | full12_24            the same 12 steps at a global batch of 24, uninterrupted (the reference)
          | slurm                the sigterm run (0.4 s steps in the first attempt only) as one rank of a SLURM job (SLURM_* variables set by the test, no
                                 launcher), with ckpt_path="last" (a requeued job resumes from the signal's checkpoint)
    $COMPILE, when set, is the strategy's compile= (a torch.compile backend, e.g. aot_eager).

With RANK in the environment the process is one rank of a job started by hand, by torchrun or by
the test harness (tests.helpers.run_fault_worker: a reference run without fresh processes); without
it, it is rank 0 and Lightning's launcher starts DEVICES - 1 more (start_method="popen").
Every rank appends {"attempt", "step", "loss"} lines to OUT/rank<r>.jsonl and, for the tests that
look for leftover processes, writes its pid to OUT/pid<r>.
"""

import faulthandler
import json
import os
import signal
import sys
import time
from pathlib import Path

STARTED = time.time()  # the process's start, before Lightning's import (the elastic test's phase timings)

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_3d import ThreeDParallelStrategy
import lightning_3d.checkpoint.manager as manager
from lightning_3d.resilience.preemption import EXIT_CODE, TrainingInterrupted
from tests.helpers import quiet_trainer, tiny_data, tiny_gpt

out, mode = Path(sys.argv[1]), sys.argv[2]
timeout = float(sys.argv[3]) if len(sys.argv) > 3 else 20.0
devices = int(sys.argv[4]) if len(sys.argv) > 4 else None
launched_by_hand = "RANK" in os.environ
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", os.environ.get("SLURM_RESTART_COUNT", "0")))
fault_rank = int(os.environ["FAULT_RANK"]) if "FAULT_RANK" in os.environ else None
if mode != "slurm":  # (SLURM's requeue signal is SIGUSR1)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a failing test asks each live rank where it is


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class Record(L.Callback):
    def on_train_start(self, trainer, module):  # noqa: ANN001 - after set-up and any checkpoint load
        (out / f"pid{trainer.global_rank}").write_text(str(os.getpid()))
        with open(out / f"events{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps({"attempt": attempt, "started": STARTED, "train_start": time.time(), "world": trainer.world_size}) + "\n")

    def on_train_batch_start(self, trainer, module, batch, i):  # noqa: ANN001
        step, rank = trainer.global_step, trainer.global_rank
        if rank == 1 and step == 3 and mode == "kill_in_training":
            die()
        if rank == 1 and step == 5 and mode == "elastic" and attempt == 0:
            die()
        if step == 3 and mode == "freeze_in_training" and rank == (trainer.world_size - 1 if fault_rank is None else fault_rank):
            os.kill(os.getpid(), signal.SIGSTOP)
        if step == 3 and mode == "raise_in_training" and fault_rank in (None, rank):
            raise ValueError(f"a bug in the training step (step {step})")
        if mode == "slow":
            time.sleep(0.5)
        if mode == "sigterm" or (mode in ("slurm", "elastic_node") and attempt == 0):  # (a resumed attempt runs at full speed)
            time.sleep(0.4)

    def on_train_batch_end(self, trainer, module, outputs, batch, i):  # noqa: ANN001
        with open(out / f"rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps({"attempt": attempt, "step": trainer.global_step, "loss": float(outputs["loss"]), "time": time.time()}) + "\n")


if mode == "kill_in_save" and os.environ.get("RANK") == "1":  # die half-way through writing the second checkpoint
    original, calls = manager.write_rank_shard, []

    def write_then_die(tmp, shard):  # noqa: ANN001
        calls.append(1)
        if len(calls) == 2:
            (tmp / "rank1.pt").write_bytes(b"\x00" * 1000)  # a partial file
            die()
        return original(tmp, shard)

    manager.write_rank_shard = write_then_die

L.seed_everything(0)
checkpoint = ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=2, save_top_k=-1, filename="{step}", save_last=True)
trainer = quiet_trainer(
    max_steps=10**6 if mode == "slow" else 12 if mode in ("sigterm", "resume", "full12", "elastic_node", "full12_24", "slurm") else 8,
    limit_val_batches=0,
    enable_checkpointing=mode != "slow",  # (slow runs until killed: no pile of checkpoints)
    callbacks=[Record()] + ([] if mode == "slow" else [checkpoint]),
    strategy=ThreeDParallelStrategy(timeout=timeout, compile=os.environ.get("COMPILE") or False),  # COMPILE: a backend
    **({} if launched_by_hand and not devices else {"devices": devices or 2, "num_nodes": 1}),
)
# a job's DEVICES sets its batch (2 a rank), also when a test's harness runs it as a reference
batch = 24 if mode in ("elastic_node", "full12_24") else 2 * devices if devices else 8 if launched_by_hand else 4
resume_from = "last" if mode in ("elastic", "elastic_node", "slurm") else os.environ.get("RESUME_FROM") if mode == "resume" else None
try:
    trainer.fit(tiny_gpt(lr=3e-3), tiny_data(global_batch_size=batch), ckpt_path=resume_from)
except TrainingInterrupted as interrupted:  # what a script does to exit as a scheduler expects
    print(interrupted, flush=True)
    sys.exit(EXIT_CODE)
