"""The multi-rank harness itself: results in rank order, tracebacks named, hangs and deaths cut off."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from lightning_3d.core.topology import ParallelDims, Topology
from lightning_3d.testing.harness import RankError, run_on_ranks


def rank_info() -> dict:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return {"rank": dist.get_rank(), "sum": float(t), "threads": torch.get_num_threads()}


def raise_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise KeyError("boom on purpose")
    dist.barrier()  # rank 0 would wait forever: the harness must not


def hang() -> None:
    time.sleep(600)


def die_on_rank_zero() -> None:
    if dist.get_rank() == 0:
        os._exit(3)
    time.sleep(600)


def mesh_layout() -> dict:
    topo = Topology.build(ParallelDims(dp=2, tp=2, pp=2))
    return {
        "coords": tuple(topo.coords),
        "tp": dist.get_process_group_ranks(topo.tp_group),
        "dp": dist.get_process_group_ranks(topo.dp_group),
        "pp": dist.get_process_group_ranks(topo.pp_group),
        "first": topo.is_first_stage,
        "last": topo.is_last_stage,
        "node": int(os.environ["NODE_RANK"]),
    }


def test_results_come_back_in_rank_order():
    results = run_on_ranks(rank_info, 3, timeout=60)
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert all(r["sum"] == 3.0 and r["threads"] == 1 for r in results)


def test_failing_rank_is_named_with_its_traceback():
    with pytest.raises(RankError, match=r"rank 1 raised:(.|\n)*KeyError: 'boom on purpose'"):
        run_on_ranks(raise_on_rank_one, 2, timeout=60)


def test_hang_is_cut_off_at_the_timeout():
    start = time.monotonic()
    with pytest.raises(RankError, match=r"ranks \[0, 1\] did not finish within the 3 s timeout"):
        run_on_ranks(hang, 2, timeout=3)
    assert time.monotonic() - start < 20


def test_dead_rank_is_reported():
    with pytest.raises(RankError, match="rank 0 died with exit code 3"):
        run_on_ranks(die_on_rank_zero, 2, timeout=60)


def group_without_rank_zero_after_it_returned() -> float:
    """Rank 0 returns at once; the others then make a group through the store that rank 0 hosts."""
    if dist.get_rank() == 0:
        return 0.0
    time.sleep(1.0)
    group = dist.new_group([1, 2], use_local_synchronization=True)
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    return float(t)


def test_a_rank_that_finishes_first_keeps_the_store_for_the_others():
    assert run_on_ranks(group_without_rank_zero_after_it_returned, 3, timeout=60) == [0.0, 2.0, 2.0]


def test_device_mesh_matches_the_layout_arithmetic():
    """8 ranks as 4 simulated nodes of 2: tp groups are node-local, and the mesh agrees with ParallelDims."""
    dims = ParallelDims(dp=2, tp=2, pp=2)
    results = run_on_ranks(mesh_layout, 8, nodes=4, timeout=120)
    for rank, r in enumerate(results):
        assert r["coords"] == tuple(dims.coordinates(rank))
        for dim in ("tp", "dp", "pp"):
            assert r[dim] == dims.group_ranks(dim, rank)
        assert len({results[peer]["node"] for peer in r["tp"]}) == 1
        assert r["first"] == (r["coords"][0] == 0) and r["last"] == (r["coords"][0] == 1)


def test_make_test_deals_every_test_file_to_exactly_one_shard_longest_first():
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))
    from run_shards import deal, test_files

    files = test_files()
    seconds = {"tests/a.py": 9.0, "tests/b.py": 5.0, "tests/c.py": 4.0, "tests/d.py": 1.0}
    assert deal(list(seconds), seconds, 2) == [["tests/a.py", "tests/d.py"], ["tests/b.py", "tests/c.py"]]
    dealt = deal(files, {}, 2)
    assert sorted(f for shard in dealt for f in shard) == files and "tests/test_harness.py" in files
    assert abs(len(dealt[0]) - len(dealt[1])) <= 1  # unknown files count alike


def test_the_shards_recorded_seconds_sum_every_shards_junit_per_file(tmp_path, monkeypatch):
    import json
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))
    import run_shards

    for k, cases in enumerate([[("tests.test_a", 2.5), ("tests.test_a", 1.0)], [("tests.test_b", 4.0)]]):
        rows = "".join(f'<testcase classname="{c}" name="t{i}" time="{t}"/>' for i, (c, t) in enumerate(cases))
        (tmp_path / f"shard{k}.xml").write_text(f"<testsuites><testsuite>{rows}</testsuite></testsuites>")
    monkeypatch.setattr(run_shards, "TABLE", tmp_path / "seconds.json")
    run_shards.main(["--record", str(tmp_path / "shard0.xml"), str(tmp_path / "shard1.xml")])
    assert json.loads((tmp_path / "seconds.json").read_text()) == {"tests/test_a.py": 3.5, "tests/test_b.py": 4.0}
