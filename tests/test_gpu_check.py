"""benchmarks/gpu_check.py keeps working without a GPU: its CPU dry run trains every case, the losses
agree, and what it prints is well-formed JSON; its verdict fails a run that failed or disagreed.

The dry run's cases share one process here (``--in-process``: starting Lightning costs ~5 s a
process on 2 cores); one more run goes through the per-case child processes the GPU mode uses.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def _module() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


gpu_check = _module()


def _run(*flags: str, timeout: float = 120) -> tuple[int, list[dict[str, Any]], str]:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu-dry-run", *flags],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT,
    )
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]  # strict: every {-line parses
    return proc.returncode, lines, proc.stdout + "\n--- stderr ---\n" + proc.stderr[-3000:]


def _case(**fields: Any) -> dict[str, Any]:
    return {"ok": True, "losses": [6.0, 5.5, 5.0], **fields}


def test_cpu_dry_run_trains_every_case_and_losses_agree() -> None:
    rc, lines, output = _run("--in-process")
    assert rc == 0, output
    *cases, verdict = lines
    assert [c["case"] for c in cases] == [c.name for c in gpu_check.CASES], output
    peers = [c for c in cases if gpu_check.CASE_BY_NAME[c["case"]].peer]
    cases = [c for c in cases if c not in peers]
    for c in cases:
        assert c["ok"], (c["case"], c.get("error"), output)
        assert c["backend"] == "gloo" and c["device"] == "cpu"
        assert len(c["losses"]) == 3 and len(c["step_seconds"]) == 3
        assert c["step_s"] > 0 and c["tokens_per_s"] > 0 and 0 < c["mfu"]
        assert c["peak_gpu_gib"] is None and c["peak_host_rss_gib"] > 0  # no GPU: null, RSS instead
        predicted = c["predicted"]
        assert predicted["profile"] == "local_cpu" and predicted["fits"]
        assert predicted["step_s"] > 0 and predicted["allocated_gib"] >= 0
    by_name = {c["case"]: c for c in cases}
    assert by_name["zero3_offload_cpu"]["strategy"] == {"zero_stage": 3, "offload_params": "cpu"}
    assert by_name["zero1_offload_nvme"]["strategy"] == {"zero_stage": 1, "offload_optimizer": "nvme"}
    assert by_name["zero1_recompute_selective"]["strategy"] == {"zero_stage": 1, "activation_checkpointing": "selective"}
    assert verdict["case"] == "gpu_check" and verdict["passed"], output
    assert verdict["cases"] == len(gpu_check.CASES) and not verdict["failed"] and not verdict["disagree"]
    assert all(verdict["max_rel_diff"][c["case"]] <= verdict["rtol"] for c in cases)
    # the peers: the torch FSDP2 loop runs everywhere and computes our losses (same init, data, AdamW
    # and autocast); DeepSpeed is not a dependency, so here it says why it did not run
    by_peer = verdict["peers"]
    assert set(by_peer) == {c["case"] for c in peers}, by_peer
    assert by_peer["fsdp2_zero3"]["ours"] == "zero3" and by_peer["fsdp2_zero3"]["losses_agree"], by_peer
    assert by_peer["fsdp2_zero3"]["max_rel_diff"] < 1e-4 and by_peer["fsdp2_zero3"]["speed_ratio"] > 0
    if importlib.util.find_spec("deepspeed") is None:
        assert all("deepspeed is not installed" in by_peer[c["case"]]["not_run"] for c in peers if c["case"].startswith("deepspeed"))
    assert verdict["reference_relative_drop"] > verdict["reference_drop_needed"]
    assert verdict["predictions_missing"] == []
    assert "GPU GiB" in output  # the measured-vs-predicted table


def test_gpu_mode_path_runs_each_case_in_its_own_process() -> None:
    rc, lines, output = _run("--cases", "zero0")
    assert rc == 0, output
    case, verdict = lines
    assert case["case"] == "zero0" and case["ok"] and verdict["passed"], output


def test_verdict_fails_a_case_that_failed_or_disagrees() -> None:
    rtol = gpu_check.RTOL
    good = [_case(case="zero0"), _case(case="zero1", losses=[6.0, 5.51, 5.01])]
    assert gpu_check.compare(good, rtol)["passed"]

    off = [*good, _case(case="zero2", losses=[6.0, 5.5, 5.5])]  # e.g. a skipped step
    verdict = gpu_check.compare(off, rtol)
    assert not verdict["passed"] and verdict["disagree"] == ["zero2"]
    assert verdict["max_rel_diff"]["zero2"] == pytest.approx(0.1)

    crashed = [*good, {"case": "zero3", "ok": False, "error": "OutOfMemoryError: CUDA out of memory"}]
    verdict = gpu_check.compare(crashed, rtol)
    assert not verdict["passed"] and verdict["failed"] == ["zero3"] and verdict["max_rel_diff"]["zero3"] is None
    assert "NO" in gpu_check.table(crashed)  # a failed row prints without its measurements

    flat = [_case(case="zero0", losses=[6.0, 5.99, 5.98]), _case(case="zero1", losses=[6.0, 5.99, 5.98])]
    verdict = gpu_check.compare(flat, rtol)  # agreement proves nothing if the loss did not move
    assert not verdict["passed"] and not verdict["reference_drop_ok"]

    short = [*good, _case(case="zero2", losses=[6.0, 5.5])]
    verdict = gpu_check.compare(short, rtol)
    assert not verdict["passed"] and verdict["disagree"] == ["zero2"] and verdict["max_rel_diff"]["zero2"] is None
    json.dumps(verdict, allow_nan=False)

    no_reference = [{"case": "zero0", "ok": False, "error": "x"}, _case(case="zero1")]
    assert not gpu_check.compare(no_reference, rtol)["passed"]

    # a variant beside its base: speeds and losses side by side, reported, never failed
    rounds = _case(case="zero2_offload_cpu", tokens_per_s=120.0, step_rounds=8)
    one_call = _case(case="zero2_offload_cpu_one_call", tokens_per_s=100.0, step_rounds=1, losses=[6.0, 5.5, 5.01])
    verdict = gpu_check.compare([*good, rounds, one_call], rtol)
    variant = verdict["variants"]["zero2_offload_cpu_one_call"]
    assert verdict["passed"] and variant["of"] == "zero2_offload_cpu" and variant["step_rounds"] == [8, 1]
    assert variant["speed_ratio"] == 1.2 and variant["max_rel_diff"] == pytest.approx(0.01 / 5.0)
    assert gpu_check.compare(good, rtol)["variants"] == {}  # the base did not run: nothing to compare


def test_a_hanging_case_is_reported_not_waited_for() -> None:
    args = gpu_check.parse_args(["--cpu-dry-run", "--case-timeout", "0.5"])
    result = gpu_check.run_in_child(gpu_check.CASES[0], args)
    assert not result["ok"] and "timed out" in result["error"]


def test_the_planner_counts_what_offload_keeps_on_the_host(tmp_path: Path) -> None:
    """The prediction beside the GPU run's host RSS: ZeRO-2 CPU offload keeps masters and moments (12
    bytes per parameter) plus the fp32 gradient slice and the bf16 upload buffer (4 + 2); NVMe keeps
    the 12 in the file and nothing of it on the host."""
    from dataclasses import asdict

    from lightning_3d.models import GPTConfig

    run = gpu_check.GPU_RUN
    config = GPTConfig(vocab_size=run["vocab"], block_size=run["seq"], n_layer=run["layers"], n_head=run["heads"], n_embd=run["width"])
    psi = config.num_parameters()
    cpu = gpu_check.predict(gpu_check.CASE_BY_NAME["zero2_offload_cpu"], config, run["batch"], "NVIDIA H200", str(tmp_path))
    nvme = gpu_check.predict(gpu_check.CASE_BY_NAME["zero1_offload_nvme"], config, run["batch"], "NVIDIA H200", str(tmp_path))
    assert cpu["host_gib"] * gpu_check.GIB == pytest.approx(18 * psi, rel=1e-3) and cpu["nvme_gib"] == 0, (asdict(config), cpu)
    assert nvme["nvme_gib"] * gpu_check.GIB == pytest.approx(12 * psi, rel=1e-3) and nvme["host_gib"] == 0, nvme


def test_profile_dir_profiles_one_extra_step_per_case_outside_the_timings(tmp_path: Path) -> None:
    rc, lines, output = _run("--in-process", "--cases", "zero1,fsdp2_zero3", "--profile-dir", str(tmp_path))
    assert rc == 0, output
    *cases, verdict = lines
    assert verdict["passed"], output
    for c in cases:  # zero0 (always), zero1, the FSDP2 peer: 3 recorded steps each, the 4th profiled
        assert c["ok"] and len(c["losses"]) == 3 and len(c["step_seconds"]) == 3, (c["case"], output)
        assert c["profile"]["wall_s"] > 0 and "host_syncs" in c["profile"], c
        assert (tmp_path / f"{c['case']}.txt").read_text().startswith(f"{c['case']}: one profiled step")
        assert (tmp_path / f"{c['case']}.json.gz").stat().st_size > 0
    plain_rc, plain, plain_output = _run("--in-process", "--cases", "zero0")
    assert plain_rc == 0, plain_output
    assert plain[0]["losses"] == cases[0]["losses"]  # profiling changed nothing recorded


def test_profile_summary_counts_busy_time_once_and_the_host_syncs() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_profile import busy_seconds, summarize_trace

    assert busy_seconds([(0, 10), (5, 20), (30, 40), (32, 35)]) == pytest.approx(30e-6)  # overlaps count once
    events = [
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 400_000},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 100_000, "dur": 100_000},  # another stream, overlapping
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH", "ts": 600_000, "dur": 100_000},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 0, "dur": 2_000},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 5, "dur": 3_000},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 5, "dur": 9_000},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 9_000},
        {"ph": "X", "cat": "cpu_op", "name": "aten::addmm", "ts": 50, "dur": 100},  # inside mm: the innermost
        {"ph": "i", "name": "[memory]", "ts": 60, "args": {"Total Allocated": 3 * 2**30, "Device Type": 1}},
        {"ph": "i", "name": "[memory]", "ts": 70, "args": {"Total Allocated": 2**30, "Device Type": 1}},
        {"ph": "i", "name": "[memory]", "ts": 500, "args": {"Total Allocated": 2**29, "Device Type": 0}},
    ]
    summary = summarize_trace(events, wall_s=1.0)
    assert summary["peak_cuda_allocated_gib"] == 3.0 and summary["peak_cuda_during"] == "aten::addmm"
    assert summary["peak_cpu_allocated_gib"] == 0.5 and summary["peak_cpu_during"] == "aten::mm"
    assert summary["gpu_busy_s"] == pytest.approx(0.5) and summary["gpu_busy_fraction"] == pytest.approx(0.5)
    assert summary["host_syncs"] == {"cudaStreamSynchronize": {"count": 2, "ms": 5.0}}
    assert list(summary["top_kernels_ms"]) == ["gemm", "Memcpy DtoH"] and summary["top_kernels_ms"]["gemm"] == 500.0


def test_the_planner_predicts_the_measured_fsdp2_peak_on_the_h200() -> None:
    """A measured anchor: the plain FSDP2 loop's peak on the H200 (second session, docs/gpu_runs/
    2026-12-04_h200_session2.jsonl: 49.691 GiB) against the planner's ZeRO-3 prediction for the same
    model, batch and device. Without the fp32 loss's backward buffers the planner said 45.4."""
    from lightning_3d.models import GPTConfig

    run = gpu_check.GPU_RUN
    config = GPTConfig(vocab_size=run["vocab"], block_size=run["seq"], n_layer=run["layers"], n_head=run["heads"], n_embd=run["width"])
    predicted = gpu_check.predict(gpu_check.CASE_BY_NAME["fsdp2_zero3"], config, run["batch"], "NVIDIA H200", str(ROOT))
    assert predicted["allocated_gib"] == pytest.approx(49.691, rel=0.02)
