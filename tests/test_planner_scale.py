"""The planner at scale: collectives costed by NCCL's own model, ZeRO-3 against the one published
run at scale (Narayanan et al. 2021, Table 2), the H100 calibration rows, and the time breakdown
`lightning-3d plan --format json` shows. Pure arithmetic: no processes."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from lightning_3d.planner import Planner, best_completion, rank, with_nodes
from lightning_3d.planner.collectives import (
    LINK_EFFICIENCY,
    NCCL_2_9,
    NCCL_2_30,
    Group,
    bus_bandwidth,
    collective_cost,
)
from lightning_3d.planner.published import H100, ZERO3_TABLE_2, problem, zero3_table_2
from lightning_3d.planner.search import SOFTWARE, ZERO3_VALIDATED_NODES, Layout

DGX_A100 = 200.0  # GB/s per device for a ring with all 8 GPUs of each node (8 x HDR adapters)


# -- NCCL's model ---------------------------------------------------------------------------------
def test_ring_latency_is_nccls_tuner_at_1536_ranks() -> None:
    """NVIDIA/nccl v2.9.9 tuning.cc, all-gather over 192 DGX A100 nodes: 1,535 steps of which 191
    leave a node. LL: 3.6 + 1344 x 0.47 x 1.8 + 191 x 2.7 = 1,656 us; Simple: 8.4 + 1344 x 3.4 +
    191 x 9.6 = 6,412 us."""
    group = Group(1536, 192, DGX_A100)
    tiny = collective_cost("all_gather", 1536 * 2, group, NCCL_2_9)
    assert (tiny.algorithm, tiny.protocol) == ("ring", "LL")
    assert tiny.latency == pytest.approx(1656.3e-6, rel=1e-3)
    big = collective_cost("all_gather", 40e9, group, NCCL_2_9)
    assert big.protocol == "Simple" and big.latency == pytest.approx(6412.0e-6, rel=1e-3)
    assert big.transfer == pytest.approx(40e9 * 1535 / 1536 / (DGX_A100 * 1e9 * LINK_EFFICIENCY), rel=1e-9)


def test_todays_nccl_charges_every_network_ring_step_its_host_overhead() -> None:
    """NCCL 2.30: intraLat = max(intraLat, netOverhead x 3 for Simple), 2 us on AMD hosts, 1 on
    Intel: Simple all-gather over 192 nodes = 8.4 + 1344 x 6 + 191 x 14 = 10,746 us on AMD, with
    Intel's 3 us below the NVLink hop's 3.4: 7,252 us."""
    amd = collective_cost("all_gather", 400e9, Group(1536, 192, DGX_A100, amd_host=True), NCCL_2_30)
    intel = collective_cost("all_gather", 400e9, Group(1536, 192, DGX_A100), NCCL_2_30)
    assert amd.protocol == intel.protocol == "Simple"
    assert (amd.latency, intel.latency) == (pytest.approx(10746.4e-6, rel=1e-4), pytest.approx(7252.0e-6, rel=1e-4))


def test_ll_bandwidth_follows_nccls_caps() -> None:
    """LL streams a third (one node) or a quarter of the bus in 2.9, capped at 22.5 GB/s on two
    Ampere nodes: a 64 MB all-gather across two nodes is never LL."""
    one_node = collective_cost("all_gather", 64e3, Group(8, 1, 300.0), NCCL_2_9)
    assert one_node.protocol == "LL"
    two_nodes = collective_cost("all_gather", 64e6, Group(16, 2, DGX_A100), NCCL_2_9)
    assert two_nodes.protocol != "LL"


def test_ring_latency_grows_with_ranks_and_a_tree_takes_small_all_reduces() -> None:
    small = [collective_cost("all_gather", 1e6, Group(8 * n, n, DGX_A100), NCCL_2_30).seconds for n in (2, 16, 128, 1024)]
    assert small == sorted(small) and small[-1] > 100 * small[0]  # linear in ranks: rings only
    reduce = collective_cost("all_reduce", 1e6, Group(8192, 1024, DGX_A100), NCCL_2_30)
    assert reduce.algorithm == "tree" and reduce.seconds < collective_cost("all_gather", 1e6, Group(8192, 1024, DGX_A100), NCCL_2_30).seconds / 10
    large = collective_cost("all_reduce", 8e9, Group(16, 2, DGX_A100), NCCL_2_30)
    assert large.algorithm == "ring"


def test_bus_bandwidth_rises_with_message_size_towards_the_link() -> None:
    """nccl-tests' busbw curve: latency-bound for small messages, the link's rate for large ones;
    at a fixed size it falls as the ring grows."""
    group = Group(64, 8, DGX_A100)
    curve = [bus_bandwidth("all_gather", 2**k, group, NCCL_2_30) for k in range(10, 34, 2)]
    assert curve == sorted(curve)
    assert curve[0] < 1.0 and curve[-1] == pytest.approx(DGX_A100 * LINK_EFFICIENCY, rel=0.05)
    by_ranks = [bus_bandwidth("all_gather", 64e6, Group(8 * n, n, DGX_A100), NCCL_2_30) for n in (2, 16, 128, 1024)]
    assert by_ranks == sorted(by_ranks, reverse=True)


def test_bad_collective_name_is_refused() -> None:
    with pytest.raises(ValueError, match="all_to_all"):
        collective_cost("all_to_all", 1e6, Group(8, 1, 300.0))


# -- ZeRO-3 at scale: Narayanan et al. 2021, Table 2 ------------------------------------------------
@pytest.fixture(scope="module")
def table_2() -> list[tuple]:
    out = []
    for run, (gpus, _, _, zero3, ptdp) in zip(zero3_table_2("gpt3_175b"), ZERO3_TABLE_2["gpt3_175b"]):
        zero3_problem = problem(run)
        estimate = best_completion(Planner(zero3_problem), run.layout)
        megatron = Planner(replace(zero3_problem, software=SOFTWARE["megatron_2021"]))
        best_3d = rank(megatron.search())[0]
        out.append((gpus, estimate, zero3, best_3d, ptdp))
    return out


def test_zero3_table_2_within_20_percent(table_2) -> None:  # type: ignore[no-untyped-def]
    """DeepSpeed ZeRO-3 on 384 / 768 / 1,536 A100s: 144 / 88 / 44 TFLOP/s per GPU measured. The
    step time stays flat from 768 to 1,536 GPUs: its gathers are bandwidth-bound."""
    for gpus, estimate, zero3, _, _ in table_2:
        assert estimate.fits, (gpus, estimate.why_not)
        assert estimate.tflops_per_device == pytest.approx(zero3, rel=0.20), (gpus, estimate.tflops_per_device)
    steps = [e.step_seconds for _, e, *_ in table_2]
    assert steps[1] == pytest.approx(steps[2], rel=0.1)


def test_best_3d_layout_beats_zero3_by_the_measured_ratio(table_2) -> None:  # type: ignore[no-untyped-def]
    """PTD-P over ZeRO-3: 1.06x, 1.69x and 3.2x measured; the best 3D layout the planner finds
    (Megatron-LM 2021's options) over its ZeRO-3 estimate, within 25% of each."""
    for gpus, estimate, zero3, best_3d, ptdp in table_2:
        predicted = best_3d.tflops_per_device / estimate.tflops_per_device
        assert best_3d.layout.zero_stage == 0 and best_3d.layout.tp * best_3d.layout.pp > 1
        assert predicted == pytest.approx(ptdp / zero3, rel=0.25), (gpus, best_3d.layout.short(), predicted)


def test_zero3_gathers_per_parameter_and_hide_behind_the_previous_module(table_2) -> None:  # type: ignore[no-untyped-def]
    """DeepSpeed 0.4: the 4 weight matrices of each of the 96 layers gathered twice (forward,
    recompute), all 12 tensors reduce-scattered once; more of it hides at micro-batch 4 than 1."""
    (_, at_384, *_), _, (_, at_1536, *_) = table_2
    calls = at_1536.comm["dp"]["calls"]
    gathers = sum(v["count"] for k, v in calls.items() if k.startswith("param_all_gather"))
    reduces = sum(v["count"] for k, v in calls.items() if k.startswith("grad_reduce_scatter"))
    assert (gathers, reduces) == (96 * 4 * 2, 96 * 12)
    hidden = [e.comm["dp"]["hidden_s"] / (e.comm["dp"]["hidden_s"] + e.comm["dp"]["exposed_s"]) for e in (at_384, at_1536)]
    assert hidden[0] > 2 * hidden[1]


def test_a_prefetching_stack_beyond_the_validated_scale_carries_a_caveat() -> None:
    run = zero3_table_2("gpt3_175b")[2]
    at_scale = replace(problem(run), software=SOFTWARE["lightning_3d"])
    ours = Planner(at_scale)
    estimate = best_completion(ours, run.layout)
    assert estimate.comm["dp"]["calls"]["layer_all_gather"]["count"] == 2 * 96
    assert estimate.caveats and "1/8" in estimate.caveats[0]
    small = Planner(replace(at_scale, cluster=with_nodes(at_scale.cluster, ZERO3_VALIDATED_NODES), global_batch=64))
    assert not best_completion(small, dict(dp=8 * ZERO3_VALIDATED_NODES, tp=1, pp=1, zero_stage=3)).caveats


# -- H100 calibration -----------------------------------------------------------------------------
@pytest.mark.parametrize("run", [pytest.param(r, id=r.name) for r in H100])
def test_h100_rows_within_15_percent(run) -> None:  # type: ignore[no-untyped-def]
    """NVIDIA's DGX H100 BF16 benchmark runs (NeMo 24.11/24.12), with the one H100 constant."""
    planner = Planner(problem(run))
    estimate = best_completion(planner, run.layout)
    assert planner.problem.cluster.device.model == "H100-SXM5-80GB"
    assert estimate.tflops_per_device == pytest.approx(run.reported(planner.problem.model), rel=0.15)


# -- the breakdown ----------------------------------------------------------------------------------
def test_json_breakdown_shows_each_term(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_3d.planner.cli import plan_main

    code = plan_main(["model=gpt3_175b", "cluster=selene_mtnlg", "--nodes", "192", "--global-batch", "1536",
                      "--software", "deepspeed_zero3_2021", "--layout", "tp=1,pp=1,dp=1536,zero=3,recompute=full,mb=1",
                      "--format", "json"])
    (row,) = json.loads(capsys.readouterr().out)
    assert code == 0
    dp = row["comm"]["dp"]
    assert {"collectives", "latency_s", "transfer_s", "hidden_s", "copy_s", "exposed_s", "calls"} <= set(dp)
    assert dp["hidden_s"] + dp["exposed_s"] == pytest.approx(dp["latency_s"] + dp["transfer_s"] + dp["copy_s"], abs=1e-3)
    assert row["time_seconds"]["dp_comm_exposed"] == pytest.approx(dp["exposed_s"], abs=1e-3)
    assert sum(row["time_seconds"].values()) == pytest.approx(row["step_seconds"], rel=1e-3)
    call = dp["calls"]["param_all_gather[0]"]
    assert call["algorithm"].startswith("ring/") and call["latency_s"] > 0


def test_zero_1_counts_buckets_and_hides_grads_behind_backward() -> None:
    run = H100[2]
    planner = Planner(problem(run))
    overlapped = planner.evaluate(Layout(**run.layout))
    dp = overlapped.comm["dp"]
    assert dp["calls"]["grad_reduce_scatter"]["count"] >= 2 and dp["hidden_s"] > 0
