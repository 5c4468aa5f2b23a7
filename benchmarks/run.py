"""`make bench`: run benchmark cases, print one JSON line per case, append them to bench_results/.

    python benchmarks/run.py                       # every case
    python benchmarks/run.py --cases dp2_vs_ddp --steps 50 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cases import CASES  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--steps", type=int, default=30, help="measured steps per run (after warm-up)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs per side; the median is kept")
    parser.add_argument("--out", type=Path, default=Path("bench_results/results.jsonl"))
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.cases:
        start = time.perf_counter()
        result = CASES[name](args.steps, args.repeats)
        result["wall_s"] = round(time.perf_counter() - start, 1)
        line = json.dumps(result)
        print(line, flush=True)
        with args.out.open("a") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
