"""benchmarks/pipeline_cases.py stays registered in ``make bench`` and summarizes as documented:
idle fraction = mean over ranks, median over repeats; the schedule simulated at the ranks' mean
per-kind costs; dualpipe_v left out below 2p micro-batches. The smoke runs take tiny steps; no
timing is asserted."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lightning_3d.pipeline.schedules import theoretical_bubble

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _import_bench() -> tuple:
    sys.path.insert(0, str(BENCH))
    try:
        import pipeline_cases
        from cases import CASES
    finally:
        sys.path.remove(str(BENCH))
    return pipeline_cases, CASES


def _cells_on_rank(*args):
    """Rank processes import this module, not benchmarks/ (not on their path)."""
    return _import_bench()[0]._bubble_cells(*args)


@pytest.fixture(scope="module")
def pc():
    pipeline_cases, CASES = _import_bench()
    assert {"pipeline_bubbles", "pp2_zbv_vs_torch_pipelining", "pp2_1f1b_vs_torch_pipelining"} <= set(CASES)
    assert "pp2_bubbles" not in CASES
    return pipeline_cases


def test_grid_and_summary(pc) -> None:
    assert pc.BUBBLE_GPT["n_layer"] == 8  # pp=4 x 2 chunks: one block per piece
    grid4 = pc._bubble_grid(4)
    assert ("dualpipe_v", 2, 4) not in grid4 and ("dualpipe_v", 2, 8) in grid4 and len(grid4) == 17
    assert len(pc._bubble_grid(2)) == 18

    def rank(idle: float, f: float, b: float) -> dict:
        return {"idle_fraction": idle, "wall_s": 1.0, "costs": {"F": f, "B": b}, "step_s": 0.1 + idle}

    repeats = [[rank(0.2, 1.0, 2.0), rank(0.4, 1.0, 2.0)], [rank(0.1, 1.0, 2.0), rank(0.1, 1.0, 2.0)], [rank(0.5, 1.0, 2.0), rank(0.5, 1.0, 2.0)]]
    cell = pc.summarize_cell("1f1b", 1, 2, 8, repeats)
    assert cell["measured"] == 0.3  # means over ranks 0.3, 0.1, 0.5: median 0.3
    assert cell["theory"] == round(theoretical_bubble("1f1b", 2, 8), 4)
    assert cell["sim_at_costs"] == cell["sim_at_rank_costs"] == cell["theory"]  # B = 2F is the unit model, on each rank
    slow_head = [[rank(0.2, 1.0, 2.0), rank(0.2, 2.0, 4.0)]]  # the last stage twice as slow: the first waits on it
    assert pc.summarize_cell("1f1b", 1, 2, 8, slow_head)["sim_at_rank_costs"] > pc.summarize_cell("1f1b", 1, 2, 8, slow_head)["sim_at_costs"]
    assert cell["minus_theory"] == round(0.3 - cell["theory"], 4)
    assert cell["step_s"] == 0.5
    # a rank without a kind does not drag its mean down (zb_h1's first piece runs no I on one rank... or W)
    assert pc._mean_costs([{"costs": {"F": 1.0, "I": 2.0}}, {"costs": {"F": 3.0}}]) == {"F": 2.0, "I": 2.0}
    table = pc.format_bubbles({"cells": [cell]})
    assert "| 2 | 8 | 1f1b | 0.300 |" in table


def _zbv_on_rank(side: str, steps: int) -> dict:
    pc = _import_bench()[0]
    return pc.ours(steps, "zb_v", 2, pc.ZBV_MICRO, pc.ZBV_GPT) if side == "ours" else pc.torch_zbv(steps)


def test_zbv_comparison_equal_work(pc) -> None:
    """Ours and torch's ZB-V compute the same losses on the first two steps (same init and data)."""
    from lightning_3d.testing.harness import run_on_ranks

    ours = run_on_ranks(_zbv_on_rank, 2, "ours", 4, timeout=300)[0]["losses"]
    theirs = run_on_ranks(_zbv_on_rank, 2, "torch", 4, timeout=300)[0]["losses"]
    assert len(ours) == len(theirs) == 2
    assert ours == pytest.approx(theirs, abs=1e-5)


def test_bubbles_smoke(pc) -> None:
    """Every schedule at pp=2, m=4, one measured step after one warm-up."""
    out = pc.bubbles(6, 1, pps=(2,), ms=(4,), warmup=1, rank_fn=_cells_on_rank)
    assert [c["schedule"] for c in out["cells"]] == [n for n, _ in pc.BUBBLE_SCHEDULES]
    for c in out["cells"]:
        assert 0.0 <= c["measured"] < 1.0 and 0.0 <= c["sim_at_costs"] < 1.0 and c["step_s"] > 0
    assert set(out["cells"][3]["costs_ms"]) == {"F", "I", "W"}  # zb_h1 splits its backwards


def test_the_planner_table_measures_each_layout_its_row_names():
    """Issue 37's predicted-vs-measured rows are completed by the planner: a row that leaves an option
    out gets the best one, and "tp=2" was completed with sequence parallelism, so the table's tp2 row
    had measured tp2 + SP twice. Every row now runs its own layout."""
    sys.path.insert(0, str(BENCH))
    try:
        import planner_cases
    finally:
        sys.path.remove(str(BENCH))
    cfg = planner_cases.compose_config(["cluster=local_cpu", "model=gpt_tiny", "data.global_batch_size=16", "trainer.precision=32-true"])
    runs = {}
    for text, problem, estimate in planner_cases.planned_layouts(cfg):
        kwargs = estimate.layout.strategy_kwargs(problem.global_batch, estimate.split_points)
        runs[text] = (repr(sorted(kwargs.items())), estimate.layout.micro_batches(problem.global_batch))
        for option, key in (("sp=", "sequence_parallel"), ("zero=", "zero_stage")):
            if option in text:
                named = text.split(option)[1].split(",")[0]
                assert str(kwargs[key]).lower() == named.lower(), (text, kwargs)
    assert len(set(runs.values())) == len(runs), "two rows run the same layout"
