"""The planner: how fast it searches, and how its predictions compare with published runs.

``validation()`` evaluates every published layout (Narayanan et al. 2021 Table 1, BLOOM-176B,
MT-NLG 530B) with the software profile of its time, writes docs/img/planner_vs_published.png and
returns the rows that docs/planner.md quotes.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from lightning_3d.planner import SOFTWARE, ModelShape, Planner, Problem, best_completion, load_cluster, rank, with_nodes
from lightning_3d.recipe import compose_config

ROOT = Path(__file__).resolve().parents[1]
# (model, cluster, nodes, software, global batch, published layout, reported TFLOP/s per GPU, source)
PUBLISHED: list[tuple[str, str, Any, str, int, dict[str, int], float, str]] = [
    *[
        (f"megatron_gpt_{n}", "selene_mtnlg", g // 8, "megatron_2021", b, dict(dp=g // (t * p), tp=t, pp=p), tf, "Narayanan 2021 T1")
        for n, t, p, g, b, tf in [
            ("1p7b", 1, 1, 32, 512, 137), ("3p6b", 2, 1, 64, 512, 138), ("7p5b", 4, 1, 128, 512, 142),
            ("18p4b", 8, 1, 256, 1024, 135), ("39p1b", 8, 2, 512, 1536, 138), ("76p1b", 8, 4, 1024, 1792, 140),
            ("145p6b", 8, 8, 1536, 2304, 148), ("310p1b", 8, 16, 1920, 2160, 155), ("529p6b", 8, 35, 2520, 2520, 163),
            ("1t", 8, 64, 3072, 3072, 163),
        ]
    ],
    ("bloom_176b", "jean_zay_bloom", None, "megatron_deepspeed_2022", 2048, dict(dp=8, tp=4, pp=12, micro_batch_size=2, zero_stage=1), 150, "BLOOM 2022"),
    ("mt_nlg_530b", "selene_mtnlg", None, "megatron_deepspeed_2022", 1920, dict(dp=8, tp=8, pp=35, micro_batch_size=1), 126, "Smith 2022"),
]


def _problem(model: str, cluster: str, nodes: Any, software: str, batch: int) -> Problem:
    cfg = compose_config([f"model={model}", f"cluster={cluster}"])
    shape = ModelShape.from_config(OmegaConf.to_container(cfg.model))  # type: ignore[arg-type]
    return Problem(shape, with_nodes(load_cluster(cfg.cluster), nodes), batch, SOFTWARE[software])


def validation(plot: Path | None = ROOT / "docs" / "img" / "planner_vs_published.png") -> dict[str, Any]:
    rows = []
    for model, cluster, nodes, software, batch, fixed, reported, source in PUBLISHED:
        planner = Planner(_problem(model, cluster, nodes, software, batch))
        estimate = best_completion(planner, fixed)
        ranked_estimates = rank(planner.search())
        ranked = [e.layout.degrees for e in ranked_estimates]
        rows.append(
            {
                "model": model,
                "source": source,
                "layout": estimate.layout.short(),
                "reported_tflops": reported,
                "predicted_tflops": round(estimate.tflops_per_device, 1),
                "error": round(estimate.tflops_per_device / reported - 1, 3),
                "rank": ranked.index(estimate.layout.degrees) + 1 if estimate.fits else None,
                "of": len(ranked),
                "best": ranked_estimates[0].layout.short(),
            }
        )
    errors = [abs(r["error"]) for r in rows]
    if plot is not None:
        _plot(rows, plot)
    return {
        "case": "planner_validation",
        "rows": rows,
        "mean_abs_error": round(statistics.mean(errors), 3),
        "max_abs_error": round(max(errors), 3),
        "top5": sum(1 for r in rows if r["rank"] and r["rank"] <= 5),
        "runs": len(rows),
        "plot": str(plot) if plot else None,
    }


def _plot(rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6.5, 5))
    lo, hi = 110, 185
    ax.plot([lo, hi], [lo, hi], color="black", lw=1, label="exact")
    ax.fill_between([lo, hi], [lo * 0.85, hi * 0.85], [lo * 1.15, hi * 1.15], color="0.9", label="within 15%")
    for r in rows:
        color = "tab:blue" if r["source"].startswith("Narayanan") else "tab:orange"
        ax.scatter(r["reported_tflops"], r["predicted_tflops"], color=color)
        ax.annotate(r["model"].replace("megatron_gpt_", ""), (r["reported_tflops"], r["predicted_tflops"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("reported TFLOP/s per A100")
    ax.set_ylabel("planner's prediction (one calibration constant)")
    ax.set_title("Planner vs published runs (blue: Narayanan 2021 Table 1)")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def search_speed(repeats: int = 3) -> dict[str, Any]:
    """``lightning-3d plan`` end to end (process start, config, search, table) for 1024 and 4096
    H100s and Llama 3 70B/405B; the search alone is reported too."""
    out: dict[str, Any] = {"case": "planner_search_speed"}
    for nodes, model in ((128, "llama3_70b"), (512, "llama3_405b")):
        cmd = [sys.executable, "-m", "lightning_3d.cli", "plan", f"model={model}", "cluster=h100_80g_64nodes",
               "data.global_batch_size=1024", "trainer.precision=bf16-mixed", "--nodes", str(nodes), "--format", "json"]
        walls = []
        for _ in range(repeats):
            start = time.perf_counter()
            subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
            walls.append(time.perf_counter() - start)
        from lightning_3d.planner import plan, problem_from_config

        cfg = compose_config([f"model={model}", "cluster=h100_80g_64nodes", "data.global_batch_size=1024", "trainer.precision=bf16-mixed"])
        result = plan(problem_from_config(cfg, nodes=nodes))
        out[f"{nodes * 8}_gpus"] = {
            "model": model,
            "command_wall_s": round(statistics.median(walls), 2),
            "search_s": round(result.seconds, 2),
            "layouts": result.searched,
        }
    return out
