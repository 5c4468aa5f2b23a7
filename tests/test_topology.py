"""Rank layout arithmetic: no processes needed, so large worlds are cheap to check."""

import pytest

from lightning_3d.core.topology import Coordinates, ParallelDims


@pytest.mark.parametrize(
    ("dims", "rank", "expected"),
    [
        # 8 ranks, dp2 x tp2 x pp2: tp innermost, pp outermost.
        (ParallelDims(dp=2, tp=2, pp=2), 0, Coordinates(pp=0, dp=0, tp=0)),
        (ParallelDims(dp=2, tp=2, pp=2), 1, Coordinates(pp=0, dp=0, tp=1)),
        (ParallelDims(dp=2, tp=2, pp=2), 2, Coordinates(pp=0, dp=1, tp=0)),
        (ParallelDims(dp=2, tp=2, pp=2), 5, Coordinates(pp=1, dp=0, tp=1)),
        (ParallelDims(dp=2, tp=2, pp=2), 7, Coordinates(pp=1, dp=1, tp=1)),
        # 64 ranks: 8 nodes of 8, tp=8 (a node), pp=4, dp=2.
        (ParallelDims(dp=2, tp=8, pp=4), 0, Coordinates(0, 0, 0)),
        (ParallelDims(dp=2, tp=8, pp=4), 13, Coordinates(pp=0, dp=1, tp=5)),
        (ParallelDims(dp=2, tp=8, pp=4), 16, Coordinates(pp=1, dp=0, tp=0)),
        (ParallelDims(dp=2, tp=8, pp=4), 63, Coordinates(pp=3, dp=1, tp=7)),
        # 1024 ranks: tp=4, pp=16, dp=16.
        (ParallelDims(dp=16, tp=4, pp=16), 0, Coordinates(0, 0, 0)),
        (ParallelDims(dp=16, tp=4, pp=16), 67, Coordinates(pp=1, dp=0, tp=3)),
        (ParallelDims(dp=16, tp=4, pp=16), 1023, Coordinates(pp=15, dp=15, tp=3)),
        (ParallelDims(dp=16, tp=4, pp=16), 517, Coordinates(pp=8, dp=1, tp=1)),
        # 16 ranks dp2 x cp2 x tp2 x pp2: cp between dp and tp.
        (ParallelDims(dp=2, tp=2, pp=2, cp=2), 1, Coordinates(pp=0, dp=0, tp=1, cp=0)),
        (ParallelDims(dp=2, tp=2, pp=2, cp=2), 2, Coordinates(pp=0, dp=0, tp=0, cp=1)),
        (ParallelDims(dp=2, tp=2, pp=2, cp=2), 4, Coordinates(pp=0, dp=1, tp=0, cp=0)),
        (ParallelDims(dp=2, tp=2, pp=2, cp=2), 15, Coordinates(pp=1, dp=1, tp=1, cp=1)),
        # Llama 3 405B at 128K: tp8 x cp16 x pp16 x dp8 = 16,384 ranks.
        (ParallelDims(dp=8, tp=8, pp=16, cp=16), (1 * 16 + 3) * 8 + 5, Coordinates(pp=0, dp=1, tp=5, cp=3)),
    ],
)
def test_rank_to_coordinates(dims, rank, expected):
    assert dims.coordinates(rank) == expected
    assert dims.rank_of(expected) == rank


@pytest.mark.parametrize(
    "dims", [ParallelDims(2, 2, 2), ParallelDims(2, 8, 4), ParallelDims(16, 4, 16), ParallelDims(2, 2, 2, cp=4)]
)
def test_mapping_is_a_bijection_and_groups_partition_the_world(dims):
    world = dims.world_size
    coords = [dims.coordinates(r) for r in range(world)]
    assert len(set(coords)) == world
    for dim in ("pp", "dp", "cp", "tp"):
        groups = {tuple(dims.group_ranks(dim, r)) for r in range(world)}
        members = sorted(r for g in groups for r in g)
        assert members == list(range(world)), dim  # every rank in exactly one group of each kind
        size = {"pp": dims.pp, "dp": dims.dp, "cp": dims.cp, "tp": dims.tp}[dim]
        assert all(len(g) == size for g in groups)


def test_context_parallel_groups_are_strided_by_tp_and_share_a_node_when_cp_x_tp_fits():
    dims = ParallelDims(dp=2, tp=2, pp=1, cp=4)
    assert dims.group_ranks("cp", 5) == [1, 3, 5, 7]
    assert dims.group_ranks("dp", 5) == [5, 13]
    assert dims.group_ranks("tp", 5) == [4, 5]
    assert {r // 8 for r in dims.group_ranks("cp", 5)} == {0}  # cp x tp = 8 = one node of 8


def test_auto_data_parallel_leaves_room_for_context_parallel():
    assert ParallelDims(dp="auto", tp=2, pp=1, cp=2).resolve(16) == ParallelDims(dp=4, tp=2, pp=1, cp=2)
    with pytest.raises(ValueError, match=r"tensor_parallel=2 x pipeline_parallel=1 x context_parallel=3 = 6 does not divide"):
        ParallelDims(dp="auto", tp=2, pp=1, cp=3).resolve(16)


def test_groups_follow_the_layout():
    dims = ParallelDims(dp=2, tp=2, pp=2)
    assert dims.group_ranks("tp", 5) == [4, 5]
    assert dims.group_ranks("dp", 5) == [5, 7]
    assert dims.group_ranks("pp", 5) == [1, 5]


@pytest.mark.parametrize(("world", "per_node", "dims"), [(64, 8, ParallelDims(2, 8, 4)), (1024, 8, ParallelDims(16, 4, 16))])
def test_tensor_parallel_groups_stay_inside_a_node(world, per_node, dims):
    dims.check_nodes(per_node)
    for rank in range(world):
        nodes = {r // per_node for r in dims.group_ranks("tp", rank)}
        assert len(nodes) == 1


def test_auto_data_parallel_fills_the_world():
    assert ParallelDims(dp="auto", tp=2, pp=2).resolve(16) == ParallelDims(dp=4, tp=2, pp=2)
    assert ParallelDims().resolve(3) == ParallelDims(dp=3, tp=1, pp=1)


@pytest.mark.parametrize(
    ("kwargs", "world", "message"),
    [
        (dict(dp=3, tp=1, pp=1), 2, "data_parallel=3 x tensor_parallel=1 x pipeline_parallel=1 = 3, but the world size is 2"),
        (dict(dp="auto", tp=4, pp=1), 6, "tensor_parallel=4 x pipeline_parallel=1 = 4 does not divide the world size 6"),
    ],
)
def test_mismatched_world_is_refused_with_the_numbers(kwargs, world, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims(**kwargs).resolve(world)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(dp=0), "data_parallel=0 is invalid"),
        (dict(tp=-2), "tensor_parallel=-2 is invalid"),
        (dict(pp=1.5), "pipeline_parallel=1.5 is invalid"),
        (dict(dp="many"), "data_parallel='many' is invalid"),
    ],
)
def test_non_positive_degrees_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims(**kwargs)


def test_tensor_parallel_spanning_nodes_is_refused():
    with pytest.raises(ValueError, match="tensor_parallel=4 does not divide the 2 processes per node"):
        ParallelDims(dp=1, tp=4, pp=1).check_nodes(2)


def _gloo_threads() -> int:
    """Threads gloo's process groups hold in this process (two run loops and a TCP loop per group)."""
    import os

    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # a thread that ended meanwhile
            pass
    return sum(name.startswith(("pt_gloo", "gloo_tcp")) for name in names)


def _fits_in_one_world() -> dict:
    from lightning_3d import ThreeDParallelStrategy
    from lightning_3d.core.topology import Topology
    from tests.helpers import quiet_trainer, tiny_data, tiny_gpt

    first = Topology.build(ParallelDims(dp=1, tp=2))
    threads = [_gloo_threads()]
    for _ in range(2):  # the path of a sweep: a new Trainer and strategy per fit, same layout
        trainer = quiet_trainer(strategy=ThreeDParallelStrategy(tensor_parallel=2), max_steps=1)
        trainer.fit(tiny_gpt(), tiny_data())
        threads.append(_gloo_threads())
    other = Topology.build(ParallelDims(dp=2))
    threads.append(_gloo_threads())
    same = Topology.build(ParallelDims(dp=1, tp=2)) is first and Topology.build(ParallelDims(dp=2)) is other
    kept = first.tp_group is Topology.build(ParallelDims(tp=2)).tp_group
    # a fit that fails at step 2 (caught, as a sweep would; a failing fit may leave a receive posted or
    # a collective entered): the next fit of that layout, on every rank, gets new groups and still trains
    failing = tiny_gpt()
    step = failing.training_step

    def fails_at_step_2(batch, batch_idx):  # noqa: ANN001, ANN202
        if batch_idx == 1:
            raise RuntimeError("a user error at step 2")
        return step(batch, batch_idx)

    failing.training_step = fails_at_step_2
    try:
        quiet_trainer(strategy=ThreeDParallelStrategy(tensor_parallel=2), max_steps=3).fit(failing, tiny_data())
    except RuntimeError:
        pass
    trainer = quiet_trainer(strategy=ThreeDParallelStrategy(tensor_parallel=2), max_steps=2)
    trainer.fit(tiny_gpt(), tiny_data())
    renewed = trainer.strategy.topology is not first and Topology.build(ParallelDims(dp=2)) is not other
    return {"same": same, "tp group kept": kept, "renewed after a failure": renewed, "threads": threads}


def test_fits_of_one_layout_in_one_process_reuse_its_process_groups():
    """Issue 33's full matrix: every fit built a new mesh, so 25 eight-rank fits left 244 gloo groups
    and 735 threads in each rank, most of them polling. A layout's groups are now built once per
    process; another layout adds its own once, and a failed fit's groups are not used again."""
    from lightning_3d.testing.harness import run_on_ranks

    for result in run_on_ranks(_fits_in_one_world, 2, timeout=300):
        assert result["same"] and result["tp group kept"] and result["renewed after a failure"], result
        first, after_fit, after_second_fit, after_other = result["threads"]
        assert after_fit == after_second_fit, result["threads"]  # (the first fit may add groups its layout makes lazily)
        assert after_other > after_second_fit, result["threads"]  # a new layout does make groups (the count sees them)


def _embedding_groups_on_a_reused_layout() -> dict:
    import torch.distributed as dist

    from lightning_3d.core.topology import Topology

    counts = []
    for _ in range(2):  # two fits of pp=3: the middle stage is in no embedding group
        Topology.build(ParallelDims(dp=1, pp=3)).embedding_group()
        seen: list = [None] * dist.get_world_size()
        dist.all_gather_object(seen, dist.distributed_c10d._world.group_count)
        counts.append(seen)
    return {"counts": counts}


def test_a_rank_outside_every_embedding_group_makes_none_again_on_a_reused_layout():
    """The middle stage of pp=3 holds no tied embedding, so its embedding group is None; read as "not
    made yet", the second fit made the groups again on that rank alone, torch numbered every later group
    differently there, and the next new layout's set-up hung (the four-rank pipeline world at 900 s)."""
    from lightning_3d.testing.harness import run_on_ranks

    for result in run_on_ranks(_embedding_groups_on_a_reused_layout, 3, timeout=120):
        for seen in result["counts"]:
            assert len(set(seen)) == 1, result  # every rank has made as many groups
