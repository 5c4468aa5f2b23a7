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
import time

import numpy as np
import pytest

from lightning_3d.checkpoint.sharded import MANIFEST
from lightning_3d.resilience.preemption import EXIT_CODE
from tests.test_faults import Job

START_S = 90.0  # processes import torch and Lightning on 2 busy cores
STOP_S = 30.0  # from the signal to every rank gone: within a stated grace (SLURM's KillWait default is 30 s)


def _losses(job: Job, rank: int = 0) -> dict[int, float]:
    lines = [json.loads(line) for line in (job.out / f"rank{rank}.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in lines}


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("preemption")
    jobs = {"rank0": Job(root / "rank0", "sigterm", 2), "every": Job(root / "every", "sigterm", 2), "full": Job(root / "full", "full12", 2)}
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


@pytest.mark.parametrize("name", ["rank0", "every"])
def test_sigterm_writes_a_checkpoint_at_the_step_and_exits_saying_interrupted(interrupted, name):
    _, jobs = interrupted
    job = jobs[name]
    assert job.rank0.returncode == EXIT_CODE, job.output()[-4000:]
    assert job.ended - job.signalled < STOP_S
    said = [line for line in job.output().splitlines() if "training interrupted by" in line]
    assert said and "is complete. Resume with trainer.fit(..., ckpt_path=" in said[0], job.output()[-4000:]
    assert any("training interrupted by signal SIGTERM at step" in line for line in said)  # rank 0 got it
    saved = sorted((job.out / "ckpt").glob("interrupted-step*.ckpt"))
    assert len(saved) == 1 and (saved[0] / MANIFEST).is_file(), sorted(p.name for p in (job.out / "ckpt").iterdir())
    step = int(saved[0].name[len("interrupted-step"):].split(".")[0])
    assert 3 <= step < 12 and step <= max(_losses(job)) + 2  # within two steps of the signal
    assert "Traceback" not in job.output() and "failed" not in " ".join(job.lines())


def test_the_interrupted_checkpoint_resumes_exactly(interrupted):
    root, jobs = interrupted
    saved = next((jobs["every"].out / "ckpt").glob("interrupted-step*.ckpt"))
    step = int(saved.name[len("interrupted-step"):].split(".")[0])
    resumed = Job(root / "resumed", "resume", 2, RESUME_FROM=str(saved))
    try:
        assert resumed.rank0.wait(timeout=START_S + 60) == 0, resumed.output()[-4000:]
    finally:
        resumed.kill()
    full, after = _losses(jobs["full"]), _losses(resumed)
    assert sorted(after) == list(range(step + 1, 13))
    np.testing.assert_allclose([after[s] for s in sorted(after)], [full[s] for s in sorted(after)], rtol=1e-5)
