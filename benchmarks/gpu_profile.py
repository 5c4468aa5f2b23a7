"""One extra step of a GPU check case under ``torch.profiler``, kept out of the case's timings: where
the step's wall time goes (GPU busy vs idle, the kernels and host calls that take it, the host
synchronizations that drain the launch queue). ``gpu_check.py --profile-dir DIR`` runs it for every
case it runs and writes ``DIR/<case>.txt`` (tables), ``DIR/<case>.json.gz`` (a Chrome trace) and a
``profile`` entry in the case's result.
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

# Host calls that wait for the device: each one empties the launch queue, and the GPU then idles
# while the host launches the next kernels. (Prefixes: "cudaMemcpy" takes in cudaMemcpyAsync, which
# waits too where the host side is pageable memory; the counts are an upper bound on those.)
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``[start, end)`` intervals (microseconds in, seconds out)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total / 1e6


def summarize_trace(events: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """GPU busy time (union of kernel and copy intervals on every stream), the host's synchronizing
    calls by name (count, total ms) and the largest kernels by total time."""
    device = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    busy = busy_seconds([(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in device])
    syncs: dict[str, list[float]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "cuda_runtime" and str(e.get("name", "")).startswith(SYNC_CALLS):
            syncs.setdefault(e["name"], []).append(float(e.get("dur", 0)) / 1e3)
    kernels: dict[str, float] = {}
    for e in device:
        kernels[e["name"]] = kernels.get(e["name"], 0.0) + float(e.get("dur", 0)) / 1e3
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:12]
    return {
        **memory_peaks(events),
        "wall_s": round(wall_s, 4),
        "gpu_busy_s": round(busy, 4),
        "gpu_busy_fraction": round(busy / wall_s, 3) if wall_s else None,
        "host_syncs": {name: {"count": len(v), "ms": round(sum(v), 2)} for name, v in sorted(syncs.items())},
        "top_kernels_ms": {name[:90]: round(ms, 2) for name, ms in top},
    }


def memory_peaks(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Per device (``cpu``, ``cuda``), the allocator's largest "Total Allocated" during the profiled step
    (all live tensors, what was allocated before the step included), and the innermost operator that
    was running when it was reached: where a step's memory peaks, on the CPU as on a GPU."""
    ops = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    peaks: dict[str, tuple[float, float]] = {}
    for e in events:
        if e.get("name") != "[memory]" or "Total Allocated" not in e.get("args", {}):
            continue
        kind = "cuda" if int(e["args"].get("Device Type", 0)) == 1 else "cpu"
        total = float(e["args"]["Total Allocated"])
        if total > peaks.get(kind, (-1.0, 0.0))[0]:
            peaks[kind] = (total, float(e["ts"]))
    out: dict[str, Any] = {}
    for kind, (total, ts) in sorted(peaks.items()):
        around = [o for o in ops if float(o["ts"]) <= ts <= float(o["ts"]) + float(o.get("dur", 0))]
        inner = min(around, key=lambda o: float(o.get("dur", 0)), default=None)
        out[f"peak_{kind}_allocated_gib"] = round(total / 2**30, 3)
        out[f"peak_{kind}_during"] = inner["name"] if inner else None
    return out


class StepProfile:
    """Profiles from ``begin()`` to ``end()`` (one step, the device synchronized at both ends) and
    writes what it saw under ``directory`` as ``<case>.txt`` and ``<case>.json.gz``."""

    def __init__(self, directory: str, case: str, gpu: bool) -> None:
        self.directory = Path(directory)
        self.case = case
        self.gpu = gpu
        self.summary: Optional[dict[str, Any]] = None
        self._profiler: Any = None
        self._start = 0.0

    def _sync(self) -> None:
        if self.gpu:
            import torch

            torch.cuda.synchronize()

    def begin(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.gpu else [])
        self._sync()
        self._profiler = profile(activities=activities, record_shapes=False, with_stack=False, profile_memory=True)
        self._profiler.__enter__()
        self._start = time.perf_counter()

    @property
    def active(self) -> bool:
        return self._profiler is not None and self.summary is None

    def end(self) -> dict[str, Any]:
        self._sync()
        wall = time.perf_counter() - self._start
        self._profiler.__exit__(None, None, None)
        self.directory.mkdir(parents=True, exist_ok=True)
        averages = self._profiler.key_averages()
        by = "self_cuda_time_total" if self.gpu else "self_cpu_time_total"
        tables = [
            f"{self.case}: one profiled step, {wall:.4f} s wall",
            averages.table(sort_by=by, row_limit=40),
            averages.table(sort_by="self_cpu_time_total", row_limit=25),
        ]
        with tempfile.TemporaryDirectory() as tmp:
            raw = os.path.join(tmp, "trace.json")
            self._profiler.export_chrome_trace(raw)
            with open(raw, "rb") as f:
                data = f.read()
        events = json.loads(data).get("traceEvents", [])
        self.summary = summarize_trace(events, wall)
        with gzip.open(self.directory / f"{self.case}.json.gz", "wb") as f:
            f.write(data)
        (self.directory / f"{self.case}.txt").write_text("\n\n".join([*tables, json.dumps(self.summary, indent=1)]) + "\n")
        return self.summary
