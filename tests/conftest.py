"""Every multi-rank test runs under NCCL's rules (lightning_3d/testing/strict_comm.py): the harness's worlds,
and ranks that Lightning or torchrun launch (they inherit the variable and the strategy reads it). ZeRO
1-2 step in rounds there, as on a GPU."""

import os

os.environ.setdefault("LIGHTNING_3D_STRICT_COMM", "1")
# ZeRO 1-2 step in rounds on CPU ranks too: the path GPUs take by default (ZeroOptimizer.step_rounds)
os.environ.setdefault("LIGHTNING_3D_ZERO_ROUNDS_ON_CPU", "1")

import pytest


@pytest.fixture(scope="session", autouse=True)
def trainer_scratch_under_basetemp(tmp_path_factory: pytest.TempPathFactory) -> None:
    """tests.helpers.quiet_trainer's scratch directories go under this session's base temp (and its
    worlds' and subprocesses' too: they inherit the variable), which pytest removes, not loose in /tmp."""
    os.environ["LIGHTNING_3D_TEST_TMP"] = str(tmp_path_factory.mktemp("trainers"))
