"""SIGTERM from a scheduler (issue 32): a checkpoint at the signal's step, then a non-zero exit that says
"interrupted", never a hang; the checkpoint resumes exactly.

Before, SIGTERM to rank 0 ended both ranks with exit 0 and no checkpoint at the signal, and SIGTERM to
every rank hung 2 runs of 3 (Lightning's handler broadcasts from inside the signal handler). Jobs run
under Lightning's popen launcher (tests/scripts/fault_worker.py), 12 steps of 0.4 s each.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from lightning_3d.checkpoint.sharded import MANIFEST, read_manifest
from lightning_3d.resilience.preemption import EXIT_CODE
from lightning_3d.testing.harness import run_on_ranks
from tests.test_faults import Job

START_S = 90.0  # processes import torch and Lightning on 2 busy cores
STOP_S = 30.0  # from the signal to every rank gone: within a stated grace (SLURM's KillWait default is 30 s)


def _losses(out: Path, rank: int = 0) -> dict[int, float]:
    lines = [json.loads(line) for line in (out / f"rank{rank}.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in lines}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, float]:
    """The same 12 steps without a signal (the reference), on harness ranks: no fresh processes."""
    from tests.helpers import run_fault_worker
    from tests.test_faults import COLLECTIVE_S

    out = tmp_path_factory.mktemp("uninterrupted")
    run_on_ranks(run_fault_worker, 2, str(out), "full12", str(COLLECTIVE_S), "2", timeout=300)
    return _losses(out)


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("preemption")
    jobs = {"rank0": Job(root / "rank0", "sigterm", 2), "every": Job(root / "every", "sigterm", 2)}
    try:
        for name, job in (("rank0", jobs["rank0"]), ("every", jobs["every"])):
            job.wait_for(lambda job=job: job.steps(0) >= 3 and job.steps(1) >= 3, START_S, f"{name}: training did not reach step 3")
            ranks = [0] if name == "rank0" else [0, 1]
            for rank in ranks:
                os.kill(job.pid(rank), signal.SIGTERM)
            job.signalled = time.monotonic()  # type: ignore[attr-defined]
        for name, job in jobs.items():
            job.rank0.wait(timeout=START_S + 60)
            job.wait_for(lambda job=job: not job.alive(), STOP_S, f"{name}: a rank outlived rank 0", job.describe)
            job.ended = time.monotonic()  # type: ignore[attr-defined]
        yield root, jobs
    finally:
        for job in jobs.values():
            job.kill()


def _assert_interrupted_at_a_step(job: Job) -> int:
    """The job exited saying "interrupted", within STOP_S of the signal, with one complete checkpoint
    within two steps of it and no traceback; its step."""
    assert job.rank0.returncode == EXIT_CODE, job.output()[-4000:]
    assert job.ended - job.signalled < STOP_S
    said = [line for line in job.output().splitlines() if "training interrupted by" in line]
    assert said and "is complete. Resume with trainer.fit(..., ckpt_path=" in said[0], job.output()[-4000:]
    assert any("training interrupted by signal SIGTERM at step" in line for line in said)  # rank 0 got it
    saved = sorted((job.out / "ckpt").glob("last-interrupted-step*.ckpt"))
    assert len(saved) == 1 and (saved[0] / MANIFEST).is_file(), sorted(p.name for p in (job.out / "ckpt").iterdir())
    step = int(saved[0].name[len("last-interrupted-step"):].split(".")[0])
    assert 3 <= step < 12 and step <= max(_losses(job.out)) + 2  # within two steps of the signal
    assert "Traceback" not in job.output() and "failed" not in " ".join(job.lines())
    return step


def _resume_matches(root: Path, job: Job, full: dict[int, float], **env: str) -> None:
    """A fresh job resumed from ``job``'s interrupted checkpoint gives ``full``'s losses after it."""
    saved = next((job.out / "ckpt").glob("last-interrupted-step*.ckpt"))
    step = int(saved.name[len("last-interrupted-step"):].split(".")[0])
    resumed = Job(root / f"resumed-{job.out.name}", "resume", 2, RESUME_FROM=str(saved), **env)
    try:
        assert resumed.rank0.wait(timeout=START_S + 60) == 0, resumed.output()[-4000:]
    finally:
        resumed.kill()
    after = _losses(resumed.out)
    assert sorted(after) == list(range(step + 1, 13))
    np.testing.assert_allclose([after[s] for s in sorted(after)], [full[s] for s in sorted(after)], rtol=1e-5)


@pytest.mark.parametrize("name", ["rank0", "every"])
def test_sigterm_writes_a_checkpoint_at_the_step_and_exits_saying_interrupted(interrupted, name):
    _, jobs = interrupted
    _assert_interrupted_at_a_step(jobs[name])


def test_the_interrupted_checkpoint_resumes_exactly(interrupted, uninterrupted):
    root, jobs = interrupted
    _resume_matches(root, jobs["every"], uninterrupted)


@pytest.mark.slow
def test_sigterm_to_a_compiled_run_checkpoints_and_resumes_exactly(tmp_path, uninterrupted):
    """The same with every block under torch.compile (aot_eager: dynamo's frames and graphs, without
    inductor's C++ build): the checkpoint written at the signal loads into a fresh compiled job, which
    continues with the uninterrupted (eager) run's losses. (The signal
    lands mostly in the steps' 0.4 s sleep in a callback, as a scheduler's lands anywhere in a step.)"""
    job = Job(tmp_path / "compiled", "sigterm", 2, COMPILE="aot_eager")
    try:
        job.wait_for(lambda: job.steps(0) >= 3 and job.steps(1) >= 3, START_S + 60, "compiled: training did not reach step 3")
        for rank in (0, 1):
            os.kill(job.pid(rank), signal.SIGTERM)
        job.signalled = time.monotonic()  # type: ignore[attr-defined]
        job.rank0.wait(timeout=START_S + 60)
        job.wait_for(lambda: not job.alive(), STOP_S, "compiled: a rank outlived rank 0", job.describe)
        job.ended = time.monotonic()  # type: ignore[attr-defined]
    finally:
        job.kill()
    _assert_interrupted_at_a_step(job)
    _resume_matches(tmp_path, job, uninterrupted, COMPILE="aot_eager")  # aot_eager's losses are eager's (test_compile)


# -- SLURM requeue (issue 35) -------------------------------------------------------------------------------------
JOB_ID = "4242"


class SlurmJob:
    """Two ranks of a SLURM job started as ``srun`` would start them (``SLURM_*`` per task, no launcher),
    with an ``scontrol`` on the PATH that only records what it is asked (``scontrol.log``)."""

    def __init__(self, out: Path, restart: int = 0) -> None:
        from lightning_3d.testing.harness import free_port
        from tests.test_faults import COLLECTIVE_S, HEARTBEAT_S, ROOT, WORKER

        out.mkdir(exist_ok=True)
        tools = out.parent / "bin"
        tools.mkdir(exist_ok=True)
        (tools / "scontrol").write_text('#!/bin/sh\necho "$@" >> "$SCONTROL_LOG"\n')
        (tools / "scontrol").chmod(0o755)
        self.out, self.scontrol = out, out.parent / "scontrol.log"
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_PORT")}
        env.update(
            PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", LIGHTNING_3D_HEARTBEAT_TIMEOUT=str(HEARTBEAT_S), MASTER_PORT=str(free_port()),
            PATH=f"{tools}:{env.get('PATH', '')}", SCONTROL_LOG=str(self.scontrol), SLURM_JOB_ID=JOB_ID, SLURM_JOB_NAME="train",
            SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2", SLURM_NNODES="1", SLURM_NODEID="0", SLURM_NODELIST="127.0.0.1",
            SLURM_RESTART_COUNT=str(restart),
        )
        self.logs = [out / f"output{restart}-rank{r}.txt" for r in range(2)]
        self.procs = []
        for rank, log in enumerate(self.logs):
            with open(log, "w") as f:
                self.procs.append(subprocess.Popen(
                    [sys.executable, str(WORKER), str(out), "slurm", str(COLLECTIVE_S), "2"],
                    env={**env, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)},
                    stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                ))

    def steps(self, rank: int, attempt: int) -> dict[int, float]:
        path = self.out / f"rank{rank}.jsonl"
        lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        return {r["step"]: r["loss"] for r in lines if r["attempt"] == attempt}

    def output(self) -> str:
        return "\n".join(log.read_text() for log in self.logs)

    def wait(self, limit: float) -> list[int]:
        deadline = time.monotonic() + limit
        return [p.wait(timeout=max(deadline - time.monotonic(), 1.0)) for p in self.procs]

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


@pytest.fixture(scope="module")
def requeued(tmp_path_factory):
    """A SLURM job gets its requeue signal (SIGUSR1, ``--signal=USR1@90``) on one rank after step 3; the
    requeued job is the same command again, with SLURM_RESTART_COUNT=1."""
    root = tmp_path_factory.mktemp("slurm")
    first = SlurmJob(root / "job")
    try:
        deadline = time.monotonic() + START_S
        while not (len(first.steps(0, 0)) >= 3 and len(first.steps(1, 0)) >= 3):
            assert time.monotonic() < deadline and all(p.poll() is None for p in first.procs), first.output()[-4000:]
            time.sleep(0.2)
        os.kill(first.procs[1].pid, signal.SIGUSR1)  # (one rank: every rank stops, rank 0 requeues)
        signalled = time.monotonic()
        codes = first.wait(STOP_S)
        stopped = time.monotonic() - signalled
    finally:
        first.kill()
    second = SlurmJob(root / "job", restart=1)
    try:
        resumed = second.wait(START_S + 60)
    finally:
        second.kill()
    return dict(first=first, codes=codes, stopped=stopped, second=second, resumed=resumed)


def test_slurm_requeue_signal_writes_a_checkpoint_and_requeues_the_job(requeued):
    """Lightning's own handler saves inside the signal handler, on the ranks that got it (a collective
    save on one rank hangs); here every rank stops at the same step, writes the signal's checkpoint, and
    rank 0 runs ``scontrol requeue JOB`` once, before any rank exits."""
    first = requeued["first"]
    assert requeued["codes"] == [EXIT_CODE, EXIT_CODE], first.output()[-4000:]
    assert requeued["stopped"] < STOP_S
    saved = sorted((first.out / "ckpt").glob("last-interrupted-step*.ckpt"))
    assert len(saved) == 1 and (saved[0] / MANIFEST).is_file(), first.output()[-4000:]
    assert first.scontrol.read_text().splitlines() == [f"requeue {JOB_ID}"]
    said = [line for line in first.output().splitlines() if "(SLURM requeue) at step" in line]
    assert len(said) == 2 and all(f"SLURM job {JOB_ID} is requeued" in line for line in said), first.output()[-4000:]
    assert "Traceback" not in first.output()


def test_the_requeued_job_resumes_from_it_with_its_command_unchanged(requeued, uninterrupted):
    """The same command, ckpt_path="last": Lightning takes the newest last* checkpoint, the signal's, and
    the steps after it are the uninterrupted run's."""
    second = requeued["second"]
    assert requeued["resumed"] == [0, 0], second.output()[-4000:]
    before, after = second.steps(0, 0), second.steps(0, 1)
    step = int(read_manifest(next((second.out / "ckpt").glob("last-interrupted-step*.ckpt")))["step"])
    assert 3 <= step <= max(before) + 1 and sorted(after) == list(range(step + 1, 13))  # (within a step of the signal)
    full = uninterrupted
    np.testing.assert_allclose([after[s] for s in sorted(after)], [full[s] for s in sorted(after)], rtol=1e-5)
