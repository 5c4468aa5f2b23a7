"""Peak resident memory of ``export_hf`` in a fresh process (used by tests/test_hf_export.py).

Usage: python export_memory.py CHECKPOINT OUT_DIR MAX_SHARD_SIZE

Exports twice: the first run pays one-time costs (imports, transformers' model classes built on the
meta device); before the second the kernel's peak-RSS counter is reset (``/proc/self/clear_refs``),
so the second measures the streaming itself. Prints one JSON line (bytes).
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def main() -> None:
    checkpoint, out, size = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    import torch  # noqa: F401 - imported before the baseline on purpose

    from lightning_3d.checkpoint.hf_export import export_hf

    start_rss = _status("VmRSS")
    t0 = time.perf_counter()
    export_hf(checkpoint, out / "first", max_shard_size=size)
    first_seconds = time.perf_counter() - t0
    first_peak = _status("VmHWM")
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    t0 = time.perf_counter()
    result = export_hf(checkpoint, out / "second", max_shard_size=size)
    second_seconds = time.perf_counter() - t0
    print(json.dumps({
        "first_growth": first_peak - start_rss,
        "first_seconds": first_seconds,
        "growth": _status("VmHWM") - before,
        "seconds": second_seconds,
        "files": result["files"],
        "bytes": result["bytes"],
    }))


if __name__ == "__main__":
    main()
