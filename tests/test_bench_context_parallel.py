"""benchmarks/context_parallel_cases.py stays registered in ``make bench`` and summarizes runs as
documented: speed is the median over repeats (rank 0's number, which covers the whole cp group),
memory the largest rank of any repeat. No ranks are started (the cases themselves take minutes)."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def test_cases_registered_and_summary() -> None:
    sys.path.insert(0, str(BENCH))
    try:
        import context_parallel_cases as cpc
        from cases import CASES
    finally:
        sys.path.remove(str(BENCH))
    assert {"cp2_vs_cp1", "cp_attention_kernels"} <= set(CASES)
    assert cpc.CP_GPT["dropout"] == 0.0 and cpc.CP_GPT["block_size"] % 4 == 0  # cp2 needs 2 x cp chunks

    def rank(tps: float, act: float) -> dict[str, float]:
        return dict(tokens_per_s=tps, step_time_s=2048 / tps, rss_peak_mb=500.0, rss_growth_mb=act * 2,
                    saved_activations_mb=act, model_state_mb=60.0, threads=1.0)

    runs = [[rank(100.0, 10.0), rank(100.0, 12.0)], [rank(300.0, 10.0), rank(300.0, 11.0)], [rank(200.0, 9.0), rank(200.0, 9.0)]]
    s = cpc._summary(runs)
    assert s["tokens_per_s"] == 200.0
    assert s["saved_activations_mb_per_rank"] == 12.0 and s["rss_growth_mb_per_rank"] == 24.0
    assert s["threads_per_rank"] == 1
