"""The stacks users would pick instead of us, on the same model, data, batch and precision (issue 36).

Each pair alternates our run (this environment) with the peer's (``.venv-peers``, which ``make
bench-peers`` builds and this environment never imports): the peer scripts in ``benchmarks/peers/``
use our GPT, data stream and optimizer recipe, so the losses can be compared step by step. Without
the peers' environment a case reports that it did not run and why.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import subprocess
from pathlib import Path
from typing import Any, Optional

from lightning_3d.testing.harness import run_on_ranks

ROOT = Path(__file__).resolve().parents[1]
PEERS_DIR = Path(__file__).resolve().parent / "peers"


def peer_python() -> Optional[Path]:
    """The peers' interpreter: ``$L3D_PEERS_PYTHON`` or ``.venv-peers/bin/python``; None when absent."""
    path = Path(os.environ.get("L3D_PEERS_PYTHON", ROOT / ".venv-peers" / "bin" / "python"))
    return path if path.exists() else None


def not_run(case: str) -> dict[str, Any]:
    return {"case": case, "not_run": "the peers' environment is missing: `make bench-peers` builds .venv-peers and runs this case"}


def run_peer(script: str, args: list[str], timeout: float = 1800) -> dict[str, Any]:
    """One peer run in its own environment; its last stdout line is the JSON summary."""
    python = peer_python()
    assert python is not None
    done = subprocess.run(
        [str(python), str(PEERS_DIR / script), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    if done.returncode:
        raise RuntimeError(f"{script} {' '.join(args)} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_ours(spec: str, world: int, steps: int, global_batch: int, dims: dict[str, Any]) -> dict[str, Any]:
    """Our Trainer run, summarized like a peer's (rank 0's timing, largest RSS, losses over replicas)."""
    from cases import fit_throughput

    return _peer_common().summarize(run_on_ranks(fit_throughput, world, spec, steps, global_batch, model_dims=dims, timeout=900))


@functools.lru_cache(maxsize=1)
def _peer_common() -> Any:
    """``benchmarks/peers/common.py``, the peer scripts' shared module, loaded once under its own name."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("peer_common", PEERS_DIR / "common.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compare(
    case: str, pairs: dict[str, tuple[str, int, str, list[str]]], steps: int, repeats: int, global_batch: int, dims: dict[str, Any]
) -> dict[str, Any]:
    """label -> (our strategy spec, ranks, peer script, peer arguments). For each label: medians of
    tokens/s and step time per side over ``repeats`` alternating runs, the larger peak RSS, the ratios
    ours / peer, and the largest loss difference over every step (and over the first five)."""
    if peer_python() is None:
        return not_run(case)
    common = ["--model", json.dumps(dims), "--steps", str(steps), "--global-batch", str(global_batch)]
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {label: {"ours": [], "peer": []} for label in pairs}
    for repeat in range(repeats):
        for label, (spec, world, script, args) in pairs.items():
            sides = {
                "ours": lambda: run_ours(spec, world, steps, global_batch, dims),
                "peer": lambda: run_peer(script, [*args, *common, "--world", str(world)]),
            }
            for side in (("ours", "peer") if repeat % 2 == 0 else ("peer", "ours")):  # who goes first alternates too
                runs[label][side].append(sides[side]())
    out: dict[str, Any] = {"case": case, "model": dims, "global_batch": global_batch, "steps": steps, "repeats": repeats}
    for label, sides in runs.items():
        summary = {
            side: {
                "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in rs), 1),
                "step_time_s": round(statistics.median(r["step_time_s"] for r in rs), 4),
                "peak_memory_mb": round(max(r["peak_memory_mb"] for r in rs), 1),
            }
            for side, rs in sides.items()
        }
        ours_losses, peer_losses = sides["ours"][0]["losses"], sides["peer"][0]["losses"]
        assert len(ours_losses) == len(peer_losses), f"{label}: {len(ours_losses)} losses against {len(peer_losses)}"
        diffs = [abs(a - b) for a, b in zip(ours_losses, peer_losses)]
        out[label] = {
            **summary,
            "tokens_per_s_ratio": round(summary["ours"]["tokens_per_s"] / summary["peer"]["tokens_per_s"], 3),
            "peak_memory_ratio": round(summary["ours"]["peak_memory_mb"] / summary["peer"]["peak_memory_mb"], 3),
            "loss_max_abs_diff": max(diffs),
            "loss_max_abs_diff_first5": max(diffs[:5]),
            "loss_abs_diff_by_step": [float(f"{d:.2g}") for d in diffs],
            "first_losses": {side: [round(x, 6) for x in rs[0]["losses"][:3]] for side, rs in sides.items()},
        }
    return out
