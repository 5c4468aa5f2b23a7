"""Pipeline parallelism: schedules on paper (no processes), then the runtime through the Trainer:
layout invariance up to dp2 x tp2 x pp2, weight updates, shapes that change, checkpoints, errors."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_3d import ParallelConfig, ThreeDParallelStrategy
from lightning_3d.data import TokenWindows, stdlib_bytes
from lightning_3d.models import GPTConfig, GPTModule
from lightning_3d.pipeline.partition import partition
from lightning_3d.pipeline.plan import Action, Post, Wait, communication_plan, is_compute
from lightning_3d.pipeline.runtime import PipelineConfig, default_micro_batches, pipeline_model, pipeline_runtime_of
from lightning_3d.pipeline.schedules import build_plan, build_schedule, theoretical_bubble
from lightning_3d.pipeline.schedules import simulate_named
from lightning_3d.pipeline.sequences import HeadOutput, LayerSequence
from lightning_3d.pipeline.simulator import CommDeadlock, PlanError, ScheduleDeadlock, check_plan, check_schedule, simulate
from lightning_3d.testing.harness import RankError, run_on_ranks
from tests.helpers import TINY_GPT, LossRecorder, host_reads_logged, quiet_trainer, result_of, run_checks, tiny_data, tiny_gpt
from tests.test_tensor_parallel_training import HFCausalLM

STEPS = 5  # optimizer steps of the parity runs (docs/testing.md: at least 3)
GPT4 = dict(n_layer=4)  # four blocks: enough for pp=4 and for pp=2 x 2 virtual stages (pp=4 in a V takes 8)


# -- schedules on paper -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m"), [(2, 2), (2, 8), (4, 4), (4, 16), (8, 8)])
def test_bubble_matches_theory(name, p, m):
    sim = simulate_named(name, p, m, forward_time=1.0, backward_time=2.0)
    assert sim.bubble == pytest.approx((p - 1) / (m + p - 1))
    assert theoretical_bubble(name, p, m) == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize(("p", "m", "v"), [(2, 4, 2), (4, 8, 2), (4, 8, 4), (2, 2, 3)])
def test_interleaving_divides_the_bubble(p, m, v):
    sim = simulate_named("interleaved_1f1b", p, m, v, forward_time=1.0 / v, backward_time=2.0 / v)
    fill = (p - 1) / v
    assert sim.bubble == pytest.approx(fill / (m + fill))
    assert sim.bubble < simulate_named("1f1b", p, m).bubble


@pytest.mark.parametrize(("p", "m"), [(2, 8), (4, 8), (4, 3)])
def test_activations_alive_on_the_first_stage(p, m):
    assert simulate_named("1f1b", p, m).max_in_flight[0] == min(p, m)
    assert simulate_named("gpipe", p, m).max_in_flight[0] == m


def test_every_schedule_is_deadlock_free():
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 3), ("zb_h1", 1), ("zb_v", 2), ("dualpipe_v", 2)):
        for p in (1, 2, 3, 4):
            for m in (p, 2 * p, 3 * p):
                simulate(build_schedule(name, p, m, v))
                simulate(build_schedule(name, p, m, v, forward_only=True))


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 16])
def test_zb_h1_splits_every_backward_and_beats_1f1b_at_its_memory(p, m):
    """Every micro-batch's backward runs as I then W on each rank; the bubble (F = I = W, a backward
    twice a forward) is never above 1F1B's, and no stage holds more micro-batches than 1F1B's first."""
    schedule = build_schedule("zb_h1", p, m)
    for actions in schedule:
        kinds = [(a.kind, a.micro) for a in actions if a.kind in ("F", "I", "W", "B")]
        assert sorted(kinds) == sorted((k, i) for k in "FIW" for i in range(m))
        for i in range(m):
            assert kinds.index(("F", i)) < kinds.index(("I", i)) < kinds.index(("W", i))
    zb, one = simulate(schedule), simulate_named("1f1b", p, m)
    assert zb.bubble <= one.bubble + 1e-12
    assert max(zb.max_in_flight) <= max(one.max_in_flight) == min(p, m)
    if m >= p and m % p == 0:  # (p-1) idle units of 3m + p - 1: the paper's ZB-H1, at p = 2 ...
        paper = theoretical_bubble("zb_h1", p, m)
        assert zb.bubble == pytest.approx(paper) if p == 2 else zb.bubble <= paper + 0.05  # ... within 0.05 beyond


@pytest.mark.parametrize("name", ["zb_v", "dualpipe_v"])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 7, 8, 16, 17])
def test_v_schedules_beat_zb_h1s_bubble_at_1f1bs_memory(name, p, m):
    """The V (rank r holds pieces r and 2p-1-r): every micro-batch passes each of a rank's two chunks
    forward once and backward once (as B, or as I then W); at F = I = W per half-size chunk the bubble
    is (p-1)/(6m+p-1) once m >= 2p-1 (ZB-H1: (p-1)/(3m+p-1)), and at most 1F1B's; activations in flight are
    1F1B's (2p half-size chunks: p whole micro-batches) for zb_v and one chunk more for dualpipe_v
    (DualPipeV's p+1). dualpipe_v with fewer than 2p micro-batches (a ragged batch) runs ZB-V's order."""
    schedule = build_schedule(name, p, m, 2)
    for actions in schedule:
        computes = [(a.kind, a.micro, a.chunk) for a in actions if a.kind in ("F", "B", "I", "W")]
        assert len(computes) == len(set(computes))
        for i in range(m):
            for c in (0, 1):
                split = ("I", i, c) in computes
                assert ("F", i, c) in computes and split == (("W", i, c) in computes) != (("B", i, c) in computes)
                end = computes.index(("W", i, c) if split else ("B", i, c))
                assert computes.index(("F", i, c)) < end and (not split or computes.index(("I", i, c)) < end)
    sim = simulate(schedule, forward_time=0.5, backward_time=1.0)  # a chunk is half a stage
    one = simulate_named("1f1b", p, m)
    assert sim.bubble <= one.bubble + 1e-12
    assert sim.bubble == pytest.approx(theoretical_bubble(name, p, m, 2))
    if m >= 2 * p - 1:
        assert sim.bubble == pytest.approx((p - 1) / (6 * m + p - 1))
        assert sim.bubble <= theoretical_bubble("zb_h1", p, m)  # the same p-1 idle units over twice the work
    extra = 1 if name == "dualpipe_v" and m >= 2 * p else 0
    assert max(sim.max_in_flight) <= 2 * min(p, m) + extra


@pytest.mark.parametrize("name", ["zb_v", "dualpipe_v"])
def test_v_orders_are_torchs(name):
    """Our ZB-V and DualPipeV orders, written from the papers' phases, are the very orders torch 2.13's
    ScheduleZBVZeroBubble and ScheduleDualPipeV compute (an overlapped F+B pair flattened to its F then
    its B) on every rank, p 2-6, every m up to 24 (ZB-V below 2p-1 too, where torch leaves out the
    missing micro-batches as we do)."""
    from types import SimpleNamespace

    from lightning_3d.pipeline.schedules import _compute_order
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV, ScheduleZBVZeroBubble

    kinds = {"FORWARD": "F", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W", "FULL_BACKWARD": "B"}
    cls = ScheduleZBVZeroBubble if name == "zb_v" else ScheduleDualPipeV

    def torchs(p: int, m: int, rank: int) -> list[tuple[str, int, int]]:
        state = SimpleNamespace(pp_group_size=p, _n_microbatches=m, num_stages=2 * p)
        actions = [a for a in cls._calculate_single_rank_operations(state, rank) if a is not None]
        flat = [b for a in actions for b in (a.sub_actions or (a,))]
        return [(kinds[b.computation_type.name], b.microbatch_index, 0 if b.stage_index == rank else 1) for b in flat]

    cases = [(p, m) for p in range(2, 7) for m in range(1, 25) if name == "zb_v" or m >= 2 * p]
    for p, m in cases:
        for rank in range(p):
            assert _compute_order(name, p, m, 2, rank) == torchs(p, m, rank), (p, m, rank)


def test_v_placement_puts_the_first_and_last_piece_on_rank_zero():
    from lightning_3d.pipeline.plan import piece_of, place

    for p in (1, 2, 3, 8):
        assert [piece_of(p, r, 1, True) for r in range(p)] == list(range(2 * p - 1, p - 1, -1))
        assert place(p, 0, True) == (0, 0) and place(p, 2 * p - 1, True) == (0, 1)
        assert all(place(p, piece_of(p, r, c, v), v) == (r, c) for r in range(p) for c in (0, 1) for v in (True, False))


def test_simulator_detects_a_deadlock():
    schedule = build_schedule("1f1b", 2, 2)
    # rank 0 waits for micro-batch 0's gradient before sending its activation: nobody can move
    schedule[0] = [Action("RECV_GRAD", 0, 0), *[a for a in schedule[0] if a != Action("RECV_GRAD", 0, 0)]]
    with pytest.raises(ScheduleDeadlock, match="deadlocks"):
        simulate(schedule)


# -- point to point under NCCL semantics (docs/pipeline.md) ------------------------------------------------------
SCHEDULE_VS = {"gpipe": [1], "1f1b": [1], "interleaved_1f1b": [1, 2, 3, 4], "zb_h1": [1], "zb_v": [2], "dualpipe_v": [2]}
ALL_MICRO_BATCHES = range(1, 20)
# `make test`: every p and v, the micro-batch counts that are below, at, above and far above 2p
# (the warm-up/steady/cool-down boundaries); `make test-slow`: every m up to 19
SOME_MICRO_BATCHES = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 19)


def _check_every_plan(name: str, micro_batches: Iterable[int]) -> int:
    """Every plan the runtime can post for p 1..6, each v and the given m (ragged ones included),
    training and evaluation, finishes under the strict model with one queue per peer and with one
    queue per rank, with a shape header on no activation and on every one; receives are waited
    before the compute that uses them and every item by the end of the step (check_plan raises
    otherwise). Returns the number of schedules checked."""
    cases = [(p, v, m, f) for p in range(1, 7) for v in SCHEDULE_VS[name] for m in micro_batches for f in (False, True)]
    for p, v, m, forward_only in cases:
        plan = communication_plan(build_schedule(name, p, m, v, forward_only))  # (what build_plan returns, unchecked)
        for fifo in ("peer", "rank"):
            for headers in ("none", "all"):
                check_plan(plan, fifo, headers)
    return len(cases)


@pytest.mark.parametrize("name", list(SCHEDULE_VS))
def test_communication_plans_run_under_nccl_semantics(name):
    assert _check_every_plan(name, SOME_MICRO_BATCHES) == 6 * len(SCHEDULE_VS[name]) * len(SOME_MICRO_BATCHES) * 2


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCHEDULE_VS))
def test_communication_plans_at_every_micro_batch_count(name):
    assert _check_every_plan(name, ALL_MICRO_BATCHES) == 6 * len(SCHEDULE_VS[name]) * len(ALL_MICRO_BATCHES) * 2


@pytest.mark.parametrize(("p", "v", "m", "new"), [(2, 2, 4, {0, 2}), (4, 2, 6, {0, 3}), (3, 1, 5, {0, 4}), (2, 3, 3, {1})])
def test_headers_in_the_middle_of_a_step(p, v, m, new):
    """A ragged batch's micro-batches change shape mid-step: headers for some micro-batches only."""
    for name in ("1f1b", "interleaved_1f1b") if v == 1 else ("interleaved_1f1b",):
        plan = build_plan(name, p, m, v)
        for fifo in ("peer", "rank"):
            check_plan(plan, fifo, new)


def old_posting_order(schedule: list[list[Action]]) -> list[list[Any]]:
    """What the runtime posted before: every send its own batch, left in flight to the end of the step;
    every receive a blocking dist.recv (an unbatched item, waited at once)."""
    plans = []
    for actions in schedule:
        plan: list[Any] = []
        sends: list[int] = []
        posted = 0
        for action in actions:
            if is_compute(action):
                plan.append(action)
            elif action.kind.startswith("SEND"):
                plan.append(Post((action,)))
                sends.append(posted)
                posted += 1
            else:
                plan += [Post((action,), batched=False), Wait((posted,))]
                posted += 1
        plans.append(plan + [Wait(tuple(sends))])
    return plans


@pytest.mark.parametrize("m", [2, 4])
def test_simulator_finds_the_deadlock_of_the_old_posting_order(m):
    """1F1B at p=2: rank 0 posts send(act1), then recv(grad0); rank 1 posts send(grad0), then
    recv(act1). Gloo buffers the sends; under NCCL both sends wait for receives queued behind them."""
    schedule = build_schedule("1f1b", 2, m)
    simulate(schedule)  # fine where sends are buffered and matched by tag
    old = old_posting_order(schedule)
    for fifo in ("peer", "rank"):
        with pytest.raises(CommDeadlock, match="deadlocks under NCCL semantics") as err:
            check_plan(old, fifo)
        assert "SEND_ACT1 to rank 1" in err.value.stuck[0] and "SEND_GRAD0 to rank 0" in err.value.stuck[1]
    check_schedule(schedule)  # the plan the runtime posts now


def test_simulator_refuses_mismatched_and_unwaited_messages():
    schedule = build_schedule("1f1b", 2, 2)
    plan = communication_plan(schedule)
    swapped = [list(steps) for steps in plan]
    i = next(k for k, s in enumerate(swapped[1]) if isinstance(s, Post))
    j = next(k for k, s in enumerate(swapped[1]) if isinstance(s, Post) and k > i)
    swapped[1][i], swapped[1][j] = swapped[1][j], swapped[1][i]  # rank 1 receives act1 where act0 is sent
    with pytest.raises(PlanError, match="matches the k-th receive"):
        check_plan(swapped)
    unwaited = [[s for s in steps if not isinstance(s, Wait)] for steps in plan]
    with pytest.raises(PlanError, match="before waiting for its receive"):
        check_plan(unwaited)


@pytest.mark.parametrize(
    ("name", "v"), [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4), ("zb_v", 2), ("dualpipe_v", 2)]
)
@pytest.mark.parametrize(("p", "m"), [(2, 8), (4, 16), (4, 8)])
def test_posting_keeps_the_theoretical_bubble(name, v, p, m):
    """Round-matched batches with receives posted ahead cost no pipeline time (compute-bound timing)."""
    sim = check_schedule(build_schedule(name, p, m, v), forward_time=1.0 / v, backward_time=2.0 / v)
    assert sim.bubble == pytest.approx(theoretical_bubble(name, p, m, v))


# -- large activations on real ranks --------------------------------------------------------------------------
WIDE = dict(micro_batch=2, seq=1024, hidden=1024)  # 2M fp32 = 8 MiB per micro-batch activation


class Elementwise(torch.nn.Module):
    """A cheap layer on wide activations: tanh(x * (1 + a) + b)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(0.1 * torch.randn(hidden))
        self.b = torch.nn.Parameter(0.1 * torch.randn(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * (1 + self.a) + self.b)


class WideToy(torch.nn.Module):
    """embed -> blocks -> head, squared error against targets: activations far larger than socket buffers."""

    def __init__(self, layers: int = 8, hidden: int = WIDE["hidden"]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = Elementwise(hidden)
        self.blocks = torch.nn.ModuleList(Elementwise(hidden) for _ in range(layers))
        self.head = Elementwise(hidden)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        for layer in (self.embed, *self.blocks, self.head):
            x = layer(x)
        return ((x - targets) ** 2).mean()

    def pipeline_sequence(self) -> LayerSequence:
        return LayerSequence(
            blocks=self.blocks,
            blocks_name="blocks",
            embed_modules=("embed",),
            head_modules=("head",),
            inputs=lambda args, kwargs: {"x": args[0], "targets": args[1]},
            embed=lambda batch: self.embed(batch["x"]),
            block=lambda layer, x, batch: layer(x),
            head=lambda x, batch: HeadOutput(loss=((self.head(x) - batch["targets"]) ** 2).mean()),
            target_count=lambda batch: batch["targets"].numel(),
            output=lambda loss, logits: loss,
        )


def wide_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A step of 4 micro-batches; 6 samples in 4 (the last two micro-batches are smaller: the first two
    reuse the shape the receivers know, the others send a header mid-step); 3 samples (3 micro-batches:
    for the interleaved schedule a short last group, its warm-up found by the search)."""
    g = torch.Generator().manual_seed(1)
    shape = (WIDE["seq"], WIDE["hidden"])
    return [(torch.randn(n, *shape, generator=g), torch.randn(n, *shape, generator=g)) for n in (4 * WIDE["micro_batch"], 6, 3)]


def wide_steps(model: torch.nn.Module, train: bool = True) -> list[dict[str, Any]]:
    """Loss and gradients of each batch (only the parameters this rank holds); evaluation: the first batch."""
    out = []
    for x, y in wide_batches() if train else wide_batches()[:1]:
        if not train:
            model.eval()
            with torch.no_grad():
                out.append({"loss": float(model(x, y))})
            model.train()
            continue
        loss = model(x, y)
        loss.backward()
        grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}  # (numpy: plain pickles)
        out.append({"loss": float(loss.detach()), "grads": grads})
        model.zero_grad(set_to_none=True)
    return out


def wide_world(schedules: list[tuple[str, int]]) -> dict[str, Any]:
    from lightning_3d.core.topology import ParallelDims, Topology

    topology = Topology.build(ParallelDims(dp=1, tp=1, pp=torch.distributed.get_world_size()))
    results = {}
    for name, v in schedules:
        model = WideToy()
        config = PipelineConfig(schedule=name, virtual_stages=v, micro_batches=4)
        pipeline_model(model, model.pipeline_sequence(), topology, config)
        results[f"{name}_v{v}"] = {"train": wide_steps(model), "eval": wide_steps(model, train=False)}
    return results


@pytest.fixture(scope="module")
def wide_reference() -> dict[str, Any]:
    model = WideToy()
    return {"train": wide_steps(model), "eval": wide_steps(model, train=False)}


@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.slow), 4])  # (4 ranks: every hop of each plan)
def test_large_activations_on_real_ranks(world, wide_reference):
    """1F1B, interleaved 1F1B, ZB-H1, ZB-V and DualPipeV with 8 MiB activations (sends cannot hide in socket buffers),
    shapes that change mid-step and a ragged micro-batch count (see wide_batches): the same losses and
    gradients as one process. Under strict mode (NCCL's matching and rendezvous on gloo) this is the
    no-hang check."""
    schedules = [("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zb_v", 2), ("dualpipe_v", 2)]
    ranks = run_on_ranks(wide_world, world, schedules, timeout=300)
    for name, v in schedules:
        key = f"{name}_v{v}"
        seen: set[str] = set()
        for r in ranks:  # the loss is visible on every rank; each rank holds some of the gradients
            run = r[key]
            for step, ref in zip(run["train"], wide_reference["train"]):
                assert step["loss"] == pytest.approx(ref["loss"], rel=1e-5), key
                for n, g in step["grads"].items():
                    np.testing.assert_allclose(g, ref["grads"][n], rtol=1e-4, atol=1e-8, err_msg=f"{key} {n}")
                    seen.add(n)
            assert [s["loss"] for s in run["eval"]] == pytest.approx([s["loss"] for s in wide_reference["eval"]], rel=1e-5)
        assert seen == set(wide_reference["train"][0]["grads"]), key  # every parameter lives on some stage


def test_large_activations_on_plain_gloo(wide_reference):
    """The same five schedules without strict mode: gloo returns one work per operation, and the runtime
    then waits only for a batch's receives, leaving its sends in flight until the end of the step (their
    8 MiB buffers are still being read by the peer). Same losses and gradients as one process."""
    schedules = [("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zb_v", 2), ("dualpipe_v", 2)]
    ranks = run_on_ranks(wide_world, 2, schedules, timeout=300, strict=False)
    for name, v in schedules:
        key = f"{name}_v{v}"
        for r in ranks:
            for step, ref in zip(r[key]["train"], wide_reference["train"]):
                assert step["loss"] == pytest.approx(ref["loss"], rel=1e-5), key
                for n, g in step["grads"].items():
                    np.testing.assert_allclose(g, ref["grads"][n], rtol=1e-4, atol=1e-8, err_msg=f"{key} {n}")


def host_reads_world(schedules: list[tuple[str, int]]) -> dict[str, list[str]]:
    from lightning_3d.core.topology import ParallelDims, Topology

    topology = Topology.build(ParallelDims(dp=2, tp=1, pp=2))
    out = {}
    for name, v in schedules:
        model = WideToy(hidden=64)
        pipeline_model(model, model.pipeline_sequence(), topology, PipelineConfig(schedule=name, virtual_stages=v, micro_batches=4))
        g = torch.Generator().manual_seed(topology.dp_rank)
        x, y = torch.randn(8, 16, 64, generator=g), torch.randn(8, 16, 64, generator=g)
        model(x, y).backward()  # the first step describes activation shapes to the next stage (read once)
        first = pipeline_runtime_of(model).last_step.new_buffers
        log: list[str] = []
        with host_reads_logged(log):
            model(x, y).backward()
        out[f"{name}_v{v}"] = {"reads": log, "buffers": (first, pipeline_runtime_of(model).last_step.new_buffers)}
    return out


def test_a_training_step_never_reads_a_tensor_on_the_host_nor_allocates_receive_buffers():
    """After the first step, a pipeline step (dp2 x pp2: the data-parallel loss factor, P2P, the
    zero-bubble halves, the deferred gradients' scaling) never reads a tensor's value on the host, so
    on a GPU nothing in the schedule waits for the device. (WideToy counts its targets from shapes; a
    model that counts unmasked targets reads one count per micro-batch, before the schedule.) Its
    receives land in buffers the first step allocated: fewer than one per message (a buffer is reused
    once its micro-batch's backward is done), none new after that."""
    schedules = [("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zb_v", 2), ("dualpipe_v", 2)]
    for rank in run_on_ranks(host_reads_world, 4, schedules, timeout=240):
        for n, v in schedules:
            run = rank[f"{n}_v{v}"]
            assert run["reads"] == [], n
            first, second = run["buffers"]
            assert 0 < first < 2 * 4 * v and second == 0, (n, first, second)  # 4 micro-batches, act + grad per chunk


def test_each_micro_batch_runs_forward_and_backward_once_per_chunk():
    for rank_actions in build_schedule("interleaved_1f1b", 2, 4, 2):
        computes = [(a.kind, a.micro, a.chunk) for a in rank_actions if a.kind in ("F", "B")]
        assert sorted(computes) == sorted((k, i, c) for k in "FB" for i in range(4) for c in range(2))


def test_partitioning():
    assert partition(7, 3) == [(0, 3), (3, 5), (5, 7)]  # uneven: the first pieces take the remainder
    assert partition(6, 3, [2, 3]) == [(0, 2), (2, 3), (3, 6)]
    # heavy embedding and head: the middle pieces take more blocks
    assert partition(6, 3, "parameters", [3, 1, 1, 1, 1, 1, 1, 3]) == [(0, 1), (1, 5), (5, 6)]
    with pytest.raises(ValueError, match="need at least 4 layers, but the model has 2"):
        partition(2, 4)
    with pytest.raises(ValueError, match="must be 2 increasing block indices"):
        partition(6, 3, [3, 2])


def test_default_micro_batches_divide_the_batch():
    assert default_micro_batches(8, 2, "1f1b") == 2
    assert default_micro_batches(12, 4, "1f1b") == 4
    assert default_micro_batches(9, 2, "1f1b") == 3
    assert default_micro_batches(12, 4, "interleaved_1f1b") == 4
    assert default_micro_batches(3, 4, "1f1b") == 3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(pipeline_parallel=2, pipeline_schedule="interleaved_1f1b", virtual_stages=2, micro_batches=3), "multiple of pipeline_parallel"),
        (dict(pipeline_parallel=4, pipeline_schedule="interleaved_1f1b", virtual_stages=2, micro_batches=2), "multiple of pipeline_parallel"),
        (dict(pipeline_parallel=2, virtual_stages=2), "needs pipeline_schedule='interleaved_1f1b'"),
    ],
)
def test_bad_pipeline_configuration_fails_before_processes_start(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**kwargs)


def test_zero3_with_pipeline_is_refused_with_the_alternative():
    with pytest.raises(NotImplementedError, match="use zero_stage=1 or 2"):
        ThreeDParallelStrategy(pipeline_parallel=2, zero_stage=3)


# -- the runtime through the Trainer ---------------------------------------------------------------------
def gpt_run(steps: int = STEPS, layers: int = 4, accumulate: int = 1, **strategy: Any) -> dict[str, Any]:
    L.seed_everything(0)
    recorder = LossRecorder()
    trainer = quiet_trainer(
        max_steps=steps, limit_val_batches=0, callbacks=[recorder], gradient_clip_val=0.5,
        accumulate_grad_batches=accumulate, strategy=ThreeDParallelStrategy(**strategy),
    )
    model = tiny_gpt(lr=3e-3, n_layer=layers)
    trainer.fit(model, tiny_data(global_batch_size=8))
    stats = [
        {"max_in_flight": s.max_in_flight, "idle": s.idle_fraction, "m": s.micro_batches}
        for r in getattr(trainer.strategy, "pipelines", []) for s in r.history
    ]
    return {"losses": recorder.losses, "stats": stats}


def llama_run(layers: int = 2, **strategy: Any) -> list[float]:
    L.seed_everything(0)
    recorder = LossRecorder()
    trainer = quiet_trainer(
        max_steps=STEPS, limit_val_batches=0, callbacks=[recorder], gradient_clip_val=0.5,
        strategy=ThreeDParallelStrategy(**strategy),
    )
    trainer.fit(HFCausalLM("llama", layers), tiny_data(global_batch_size=8))
    return recorder.losses


class PaddedSFT(HFCausalLM):
    """Supervised fine-tuning batches: rows padded on the right (mask 0, label -100) and on the left
    (explicit ``position_ids`` counting from the first token), prompts masked out of the loss."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        input_ids, _ = batch
        b, t = input_ids.shape
        lengths = torch.tensor([t - (3 * i + batch_idx) % (t // 2) for i in range(b)])  # distinct padding per row
        cols = torch.arange(t).unsqueeze(0)
        left = (torch.arange(b) % 2 == 1).unsqueeze(1)
        mask = torch.where(left, cols >= t - lengths.unsqueeze(1), cols < lengths.unsqueeze(1)).long()
        position_ids = (mask.cumsum(1) - 1).clamp(min=0)
        labels = input_ids.masked_fill(mask == 0, -100)
        labels[:, : t // 4] = -100  # the prompt
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, labels=labels)
        return out.loss


def sft_run(kind: str, **strategy: Any) -> list[float]:
    L.seed_everything(0)
    recorder = LossRecorder()
    trainer = quiet_trainer(
        max_steps=3, limit_val_batches=0, callbacks=[recorder], strategy=ThreeDParallelStrategy(**strategy)
    )
    trainer.fit(PaddedSFT(kind), tiny_data(global_batch_size=8))
    return recorder.losses


def one_step_weights(**strategy: Any) -> dict[str, Any]:
    """Dense weights before and after one optimizer step (gathered over every stage)."""
    L.seed_everything(0)
    # the consolidated format's lightning_module_state_dict() gathers dense weights from every stage
    trainer = quiet_trainer(
        max_steps=1, limit_val_batches=0, strategy=ThreeDParallelStrategy(checkpoint_format="consolidated", **strategy)
    )
    model = tiny_gpt(lr=3e-3, **GPT4)
    before: dict[str, torch.Tensor] = {}

    class Snapshot(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            before.update({k: v.clone() for k, v in trainer.strategy.lightning_module_state_dict().items()})

    trainer.callbacks.append(Snapshot())
    trainer.fit(model, tiny_data(global_batch_size=8))
    after = trainer.strategy.lightning_module_state_dict()
    return {"delta": {k: (after[k] - before[k]).double().norm().item() for k in sorted(before)}}


class UnevenGPT(GPTModule):
    """Batches whose sizes change: 8, 8, then 4 in training; 3 in validation; and predict."""

    def __init__(self) -> None:
        super().__init__(GPTConfig(**{**TINY_GPT, **GPT4}), lr=3e-3, warmup_steps=2)
        tokens = stdlib_bytes(50_000)
        self.train_set = TokenWindows(tokens[: 20 * 32 + 1], 32)
        self.val_set = TokenWindows(tokens[30_000:30_000 + 6 * 32 + 1], 32)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=8)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=3)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=3)


def uneven(**strategy: Any) -> dict[str, Any]:
    L.seed_everything(0)
    recorder = LossRecorder()
    trainer = quiet_trainer(max_epochs=1, callbacks=[recorder], strategy=ThreeDParallelStrategy(**strategy))
    model = UnevenGPT()
    trainer.fit(model)
    val = trainer.validate(model, verbose=False)[0]["val_loss"]
    predicted = trainer.predict(model)
    return {"losses": recorder.losses, "val": float(val), "predicted": [p.tolist() for p in predicted]}


def resume(tmp: str, **strategy: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(max_steps=8, limit_val_batches=0, enable_checkpointing=True)
    L.seed_everything(0)
    full = LossRecorder()
    checkpoint = ModelCheckpoint(dirpath=tmp, every_n_train_steps=4, save_top_k=-1, filename="pp-{step}")
    quiet_trainer(callbacks=[full, checkpoint], strategy=ThreeDParallelStrategy(**strategy), **kwargs).fit(
        tiny_gpt(lr=3e-3, **GPT4), tiny_data()
    )
    L.seed_everything(0)
    resumed = LossRecorder()
    path = str(Path(tmp) / "pp-step=4.ckpt")
    quiet_trainer(callbacks=[resumed], strategy=ThreeDParallelStrategy(**strategy), **kwargs).fit(
        tiny_gpt(lr=3e-3, **GPT4), tiny_data(), ckpt_path=path
    )
    return {"full": full.losses, "resumed": resumed.losses, "path": path}


def load_in_one_process(path: str) -> dict[str, Any]:
    """No strategy: consolidate the sharded checkpoint, then load it like any Lightning checkpoint."""
    from lightning_3d.checkpoint.consolidate import consolidate

    out = consolidate(path, path + ".consolidated.ckpt")["out"]
    module = GPTModule.load_from_checkpoint(out, weights_only=True)
    return {"keys": len(module.state_dict())}


def too_deep() -> str:
    try:
        quiet_trainer(max_steps=1, strategy=ThreeDParallelStrategy(pipeline_parallel=2)).fit(tiny_gpt(n_layer=1), tiny_data())
    except ValueError as err:
        return str(err)
    return "no error"


def pp2_world(tmp: str) -> dict[str, Any]:
    return run_checks(
        {
            "1f1b": lambda: gpt_run(pipeline_parallel=2),
            "gpipe": lambda: gpt_run(pipeline_parallel=2, pipeline_schedule="gpipe", micro_batches=4),
            "interleaved": lambda: gpt_run(pipeline_parallel=2, pipeline_schedule="interleaved_1f1b", virtual_stages=2),
            "1f1b_m4": lambda: gpt_run(steps=2, pipeline_parallel=2, micro_batches=4),
            "zero2": lambda: gpt_run(pipeline_parallel=2, zero_stage=2),
            "llama": lambda: llama_run(pipeline_parallel=2),
            "llama_zb_h1": lambda: llama_run(pipeline_parallel=2, pipeline_schedule="zb_h1"),
            "zb_v": lambda: gpt_run(pipeline_parallel=2, pipeline_schedule="zb_v"),
            "dualpipe_v": lambda: gpt_run(pipeline_parallel=2, pipeline_schedule="dualpipe_v"),
            "llama_zb_v": lambda: llama_run(layers=4, pipeline_parallel=2, pipeline_schedule="zb_v"),
            "sft_llama": lambda: sft_run("llama", pipeline_parallel=2, micro_batches=4),
            "sft_gpt2": lambda: sft_run("gpt2", pipeline_parallel=2, micro_batches=4),
            "weights": lambda: one_step_weights(pipeline_parallel=2),
            "uneven": lambda: uneven(pipeline_parallel=2),
            "resume": lambda: resume(tmp, pipeline_parallel=2, zero_stage=1),
            "too_deep": too_deep,
        }
    )


def four_rank_world(names: frozenset[str]) -> dict[str, Any]:
    """The runs in ``names`` (``make test`` and ``make test-slow`` each start their own world)."""
    runs = {
            "pp4": lambda: gpt_run(pipeline_parallel=4),
            "dp2pp2": lambda: gpt_run(pipeline_parallel=2, data_parallel=2),
            "tp2pp2": lambda: gpt_run(pipeline_parallel=2, tensor_parallel=2),
            "tp2pp2_sp": lambda: gpt_run(pipeline_parallel=2, tensor_parallel=2, sequence_parallel=True),
            "pp4_zb_h1": lambda: gpt_run(pipeline_parallel=4, pipeline_schedule="zb_h1", micro_batches=8),
            "tp2pp2_zb_h1_zero1": lambda: gpt_run(pipeline_parallel=2, tensor_parallel=2, pipeline_schedule="zb_h1", zero_stage=1),
            "pp4_zb_v": lambda: gpt_run(layers=8, pipeline_parallel=4, pipeline_schedule="zb_v", micro_batches=8),
            "pp4_dualpipe_v_acc2": lambda: gpt_run(layers=8, accumulate=2, pipeline_parallel=4, pipeline_schedule="dualpipe_v"),
            "tp2pp2_zb_v_zero1_acc2": lambda: gpt_run(
                accumulate=2, pipeline_parallel=2, tensor_parallel=2, pipeline_schedule="zb_v", zero_stage=1
            ),
            "tp2pp2_dualpipe_v_zero1_acc2": lambda: gpt_run(
                accumulate=2, pipeline_parallel=2, tensor_parallel=2, pipeline_schedule="dualpipe_v", zero_stage=1
            ),
            "llama_dp2pp2": lambda: llama_run(pipeline_parallel=2, data_parallel=2),
            "llama_tp2pp2": lambda: llama_run(pipeline_parallel=2, tensor_parallel=2),
    }
    return run_checks({name: run for name, run in runs.items() if name in names})


def eight_rank_world() -> dict[str, Any]:
    layout = dict(data_parallel=2, tensor_parallel=2, pipeline_parallel=2, zero_stage=1)
    return run_checks({"gpt": lambda: gpt_run(**layout), "llama": lambda: llama_run(**layout)})


def reference_world() -> dict[str, Any]:
    return run_checks(
        {
            "gpt": lambda: gpt_run(),
            "gpt8": lambda: gpt_run(layers=8),
            "gpt_acc2": lambda: gpt_run(accumulate=2),
            "gpt8_acc2": lambda: gpt_run(layers=8, accumulate=2),
            "llama": lambda: llama_run(),
            "llama4": lambda: llama_run(layers=4),
            "sft_llama": lambda: sft_run("llama"),
            "sft_gpt2": lambda: sft_run("gpt2"),
            "weights": lambda: one_step_weights(),
            "uneven": lambda: uneven(),
        }
    )


@pytest.fixture(scope="module")
def pp2(tmp_path_factory) -> list[dict[str, Any]]:
    return run_on_ranks(pp2_world, 2, str(tmp_path_factory.mktemp("pp2")), timeout=900)


# `make test` runs pp4 under every schedule family and tp2 x pp2 with sequence parallelism and with a V;
# `make test-slow` the rest (dp2 x pp2 and tp2 x pp2 are also composition-matrix layouts)
FOUR = ["pp4", "tp2pp2_sp", "pp4_zb_h1", "pp4_zb_v", "pp4_dualpipe_v_acc2", "tp2pp2_zb_v_zero1_acc2"]
FOUR_SLOW = ["dp2pp2", "tp2pp2", "tp2pp2_zb_h1_zero1", "tp2pp2_dualpipe_v_zero1_acc2"]


@pytest.fixture(scope="module")
def four() -> list[dict[str, Any]]:
    return run_on_ranks(four_rank_world, 4, frozenset([*FOUR, "llama_dp2pp2", "llama_tp2pp2"]), timeout=900)


@pytest.fixture(scope="module")
def four_slow() -> list[dict[str, Any]]:
    return run_on_ranks(four_rank_world, 4, frozenset(FOUR_SLOW), timeout=900)


@pytest.fixture(scope="module")
def eight() -> list[dict[str, Any]]:
    return run_on_ranks(eight_rank_world, 8, timeout=900)


@pytest.fixture(scope="module")
def single() -> dict[str, Any]:
    return run_on_ranks(reference_world, 1, timeout=600)[0]


def _mean(values: list[list[float]]) -> np.ndarray:
    return np.mean(np.array(values), axis=0)  # dp replicas share the batch evenly; tp/pp peers agree


# (ZB-H1 at pp2, with recompute, accumulation, ZeRO, precisions ...: the composition matrix's pp2-zb cells)
@pytest.mark.parametrize("name", ["1f1b", "gpipe", "interleaved", "zero2", "zb_v", "dualpipe_v"])
def test_pp2_gpt_matches_one_process(pp2, single, name):
    reference = result_of(single, "gpt")["losses"]
    for r in pp2:  # the loss is visible on every pipeline rank
        np.testing.assert_allclose(result_of(r, name)["losses"], reference, rtol=1e-5)
    assert len(reference) == STEPS


def _check_four(ranks: list[dict[str, Any]], single: dict[str, Any], name: str) -> None:
    """(The V schedules: pp4 on an 8-layer GPT, and with gradient accumulation against one process's.)"""
    eight = name.startswith("pp4_") and "_v" in name
    reference = result_of(single, ("gpt8" if eight else "gpt") + ("_acc2" if name.endswith("_acc2") else ""))["losses"]
    np.testing.assert_allclose(_mean([result_of(r, name)["losses"] for r in ranks]), reference, rtol=1e-5)


@pytest.mark.parametrize("name", FOUR)
def test_four_rank_layouts_match_one_process(four, single, name):
    _check_four(four, single, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", FOUR_SLOW)
def test_more_four_rank_layouts_match_one_process(four_slow, single, name):
    _check_four(four_slow, single, name)


def test_dp2_tp2_pp2_zero1_on_eight_ranks(eight, single):
    np.testing.assert_allclose(_mean([result_of(r, "gpt")["losses"] for r in eight]), result_of(single, "gpt")["losses"], rtol=1e-5)
    np.testing.assert_allclose(_mean([result_of(r, "llama") for r in eight]), result_of(single, "llama"), rtol=1e-5)


def test_hf_llama_pipelines(pp2, four, single):
    reference = result_of(single, "llama")
    np.testing.assert_allclose(_mean([result_of(r, "llama") for r in pp2]), reference, rtol=1e-5)
    np.testing.assert_allclose(_mean([result_of(r, "llama_zb_h1") for r in pp2]), reference, rtol=1e-5)
    np.testing.assert_allclose(_mean([result_of(r, "llama_zb_v") for r in pp2]), result_of(single, "llama4"), rtol=1e-5)
    for name in ("llama_dp2pp2", "llama_tp2pp2"):
        np.testing.assert_allclose(_mean([result_of(r, name) for r in four]), reference, rtol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_padded_sft_batches_pipeline_like_one_process(pp2, single, kind):
    reference = result_of(single, f"sft_{kind}")
    assert len(reference) == 3 and all(np.isfinite(reference))
    for r in pp2:
        np.testing.assert_allclose(result_of(r, f"sft_{kind}"), reference, rtol=1e-5)


def test_automatic_optimization_really_updates_the_weights(pp2, single):
    reference = result_of(single, "weights")["delta"]
    ours = result_of(pp2[0], "weights")["delta"]
    assert ours.keys() == reference.keys()
    moved = [k for k, v in reference.items() if v > 0]
    assert len(moved) > 0.9 * len(reference)  # a real step moves (almost) every tensor
    for k in reference:  # (abs: key biases get ~1e-10 gradients, their Adam steps are rounding noise)
        assert ours[k] == pytest.approx(reference[k], rel=1e-4, abs=1e-5), k


def test_activation_memory_per_schedule(pp2):
    """Counted at run time: micro-batch outputs (with their autograd graphs) alive on each stage."""
    for rank, r in enumerate(pp2):
        one_f_one_b = result_of(r, "1f1b_m4")["stats"]
        gpipe = result_of(r, "gpipe")["stats"]
        assert one_f_one_b[0]["m"] == 4 and gpipe[0]["m"] == 4
        assert max(s["max_in_flight"] for s in one_f_one_b) == (2 if rank == 0 else 1)
        assert max(s["max_in_flight"] for s in gpipe) == 4
        assert all(0.0 <= s["idle"] < 1.0 for s in gpipe)


def test_changing_and_uneven_batch_shapes(pp2, single):
    reference = result_of(single, "uneven")
    for r in pp2:
        run = result_of(r, "uneven")
        assert len(run["losses"]) == 3  # 8 + 8 + 4 samples
        np.testing.assert_allclose(run["losses"], reference["losses"], rtol=1e-5)
        assert run["val"] == pytest.approx(reference["val"], rel=1e-5)
        assert run["predicted"] == reference["predicted"]


def test_pipeline_checkpoints_resume_and_load_without_the_strategy(pp2):
    run = result_of(pp2[0], "resume")
    np.testing.assert_allclose(run["resumed"], run["full"][4:], rtol=1e-6)
    loaded = run_on_ranks(load_in_one_process, 1, run["path"], timeout=120)[0]
    dense = tiny_gpt(**GPT4)
    dense.configure_model()
    assert loaded["keys"] == len(dense.state_dict())  # every stage's layers are in the file


def test_too_few_layers_for_the_stages(pp2):
    assert "need at least 2 layers, but the model has 1" in result_of(pp2[0], "too_deep")


class IgnoresInput(torch.nn.Module):
    """A block whose output does not depend on its input: the stage before it gets no gradient from
    autograd, but the schedule still owes it one (zeros)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(hidden, generator=torch.Generator().manual_seed(3)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w.expand_as(x) * 1.0


class ShapeShifter(torch.nn.Module):
    """A block whose output dtype changes between calls with the same input shape."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(()))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return (x * self.w).double() if self.calls > 1 else x * self.w


def _edge_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randn(4, 3, 8, generator=g), torch.randn(4, 3, 8, generator=g)


def _edge_model(block: torch.nn.Module) -> WideToy:
    model = WideToy(layers=2, hidden=8)
    model.blocks[1] = block
    return model


def _edge_world(kind: str) -> Any:
    from lightning_3d.core.topology import ParallelDims, Topology

    topology = Topology.build(ParallelDims(dp=1, tp=1, pp=2))
    model = _edge_model(IgnoresInput(8) if kind == "ignores" else ShapeShifter())
    if kind == "shifts":
        model.blocks[0], model.blocks[1] = model.blocks[1], model.blocks[0]  # the changing block sends
    pipeline_model(model, model.pipeline_sequence(), topology, PipelineConfig(schedule="1f1b", micro_batches=2))
    x, y = _edge_batch()
    loss = model(x, y)
    loss.backward()
    return {"loss": float(loss), "grads": {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}}


def test_a_stage_whose_input_gets_no_gradient_sends_zeros():
    ranks = run_on_ranks(_edge_world, 2, "ignores", timeout=120)
    model = _edge_model(IgnoresInput(8))
    x, y = _edge_batch()
    loss = model(x, y)
    loss.backward()
    assert ranks[0]["loss"] == pytest.approx(float(loss.detach()), rel=1e-6)
    for n, p in model.named_parameters():
        if p.grad is not None:
            mine = next(r["grads"][n] for r in ranks if n in r["grads"])
            np.testing.assert_allclose(mine, p.grad.numpy(), rtol=1e-5, atol=1e-7, err_msg=n)


def test_an_activation_dtype_that_changes_for_the_same_inputs_is_refused():
    with pytest.raises(RankError, match="an earlier one with the same input shapes was"):
        run_on_ranks(_edge_world, 2, "shifts", timeout=60)


def test_an_optimizer_with_nothing_on_a_stage_is_explained():
    """configure_optimizers runs on the cut model: a middle stage (or a V's) may hold no parameter of a
    group, which torch refuses as an empty list; the strategy says why and what to write instead."""
    from types import SimpleNamespace

    def refuse(trainer: Any) -> None:
        torch.optim.SGD([], lr=0.1)

    stage = SimpleNamespace(
        setup_optimizers=refuse, config=SimpleNamespace(layout=SimpleNamespace(pipeline_parallel=2)), topology=SimpleNamespace(pp_rank=1)
    )
    with pytest.raises(ValueError, match=r"pipeline rank 1 of 2: .* Pass parameters as groups"):
        ThreeDParallelStrategy._setup_optimizers_on_this_stage(stage, None)  # type: ignore[arg-type]
    torch.optim.SGD([{"params": []}], lr=0.1)  # what it suggests: accepted


# -- zb_h1 at measured costs ------------------------------------------------------------------------------
@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m", [1, 3, 4, 8, 13])
@pytest.mark.parametrize("skew", [(1.0, 1.3, 0.7), (1.0, 0.0, 2.0), (2.0, 1.0, 1.0)])
def test_zb_h1_at_measured_costs_is_never_slower_there_and_keeps_the_gradient_order(p, m, skew):
    """The cost-aware order: at the costs it was planned for it finishes no later than the unit-time
    order; it still splits every backward, holds at most p micro-batches, passes the NCCL-semantics
    check (build_plan runs it), and runs each rank's I's and W's in micro-batch order (gradients summed
    in the same order: the same bits under any costs)."""
    costs = tuple(tuple(c * (1 + 0.25 * r) for c in skew) for r in range(p))  # later stages slower
    timed = [dict(zip("FIW", c)) for c in costs]
    unit, measured = build_schedule("zb_h1", p, m), build_schedule("zb_h1", p, m, costs=costs)
    assert simulate(measured, costs=timed).makespan <= simulate(unit, costs=timed).makespan + 1e-9
    assert max(simulate(measured).max_in_flight) <= p
    build_plan("zb_h1", p, m, costs=costs)
    for actions in measured:
        for kind in ("F", "I", "W"):
            assert [a.micro for a in actions if a.kind == kind] == list(range(m))


def replan_world(replan_after: int, forced: Any) -> dict[str, Any]:
    """pp2 GPT under zb_h1 for 5 steps: losses and gradients, the agreed costs, the orders run."""
    from lightning_3d.core.topology import ParallelDims, Topology
    from lightning_3d.models.adapters.gpt import gpt_sequence

    topology = Topology.build(ParallelDims(dp=1, tp=1, pp=2))
    module = tiny_gpt(**GPT4)
    module.configure_model()
    model = module.model
    runtime = pipeline_model(model, gpt_sequence(model), topology, PipelineConfig(schedule="zb_h1", micro_batches=4, replan_after=replan_after))
    if forced is not None:
        runtime.costs = tuple(tuple(r) for r in forced)
    g = torch.Generator().manual_seed(5)
    out: dict[str, Any] = {"losses": [], "grads": [], "orders": []}
    for _ in range(5):
        x = torch.randint(0, TINY_GPT["vocab_size"], (8, TINY_GPT["block_size"]), generator=g)
        loss = model(x, x)
        loss.backward()
        out["losses"].append(float(loss))
        out["grads"].append({n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None})
        out["orders"].append([repr(s) for s in runtime._plan(4, True) if getattr(s, "kind", "") in ("F", "I", "W")])
        model.zero_grad(set_to_none=True)
    out["costs"] = runtime.costs
    return out


def test_zb_h1_replans_at_agreed_costs_with_the_same_bits():
    """After ``replan_after`` calls the ranks agree on one cost table (max over ranks of each stage's
    mean F, I, W) and replan; a different order (forced costs with a slow W on the last stage) gives
    bit-identical losses and gradients to the unit-time order."""
    unit = run_on_ranks(replan_world, 2, 0, None, timeout=300)
    replanned = run_on_ranks(replan_world, 2, 2, None, timeout=300)
    forced = run_on_ranks(replan_world, 2, 0, ((1.0, 0.1, 0.1), (1.0, 0.1, 5.0)), timeout=300)
    assert unit[0]["costs"] is None
    assert replanned[0]["costs"] is not None and replanned[0]["costs"] == replanned[1]["costs"]
    assert all(c > 0 for row in replanned[0]["costs"] for c in row)
    assert any(forced[r]["orders"][0] != unit[r]["orders"][0] for r in range(2))  # the forced costs change the order
    for run in (replanned, forced):
        for r in range(2):
            assert run[r]["losses"] == unit[r]["losses"]
            for a, b in zip(run[r]["grads"], unit[r]["grads"]):
                assert a.keys() == b.keys()
                for n in a:
                    np.testing.assert_array_equal(a[n], b[n], err_msg=n)
