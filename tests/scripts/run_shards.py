"""``make test``: the suite as two pytest processes at once, one per core.

A single pytest left a third of this 2-core machine idle (measured over a whole run: 31% idle):
single-process tests use one core, subprocess jobs sleep while their ranks import torch, the fault
tests wait on deadlines. Two processes, each given whole test files (a file's module-scoped worlds
stay in one process), fill that time. Files are dealt longest first to the shard with the least
work so far, by the seconds recorded in ``tests/file_seconds.json`` (a file not listed counts as
``DEFAULT_S``); ``--record JUNIT...`` rewrites that table from a run's ``--junitxml`` files, and
``--junit-dir DIR`` has each shard write ``DIR/shardK.xml`` for it.

    python tests/scripts/run_shards.py [--shards N] -- PYTEST_ARGS...

Each shard's output goes to its own log; when all are done the logs are printed in full, one after
the other, and the exit status is the first failing shard's (1 for one killed by a signal). Any other pytest arguments (a file, -k)
belong in a plain ``pytest`` call: ``make test ARGS=...`` makes one.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
TABLE = TESTS / "file_seconds.json"
DEFAULT_S = 10.0


def test_files() -> list[str]:
    return sorted(str(p.relative_to(TESTS.parent)) for p in TESTS.glob("test_*.py"))


def deal(files: list[str], seconds: dict[str, float], shards: int) -> list[list[str]]:
    """Longest first, each to the shard with the least recorded work so far (LPT scheduling)."""
    loads = [0.0] * shards
    dealt: list[list[str]] = [[] for _ in range(shards)]
    for f in sorted(files, key=lambda f: (-seconds.get(f, DEFAULT_S), f)):
        k = loads.index(min(loads))
        dealt[k].append(f)
        loads[k] += seconds.get(f, DEFAULT_S)
    return dealt


def record(junits: list[str]) -> None:
    per_file: dict[str, float] = defaultdict(float)
    for junit in junits:
        for case in ET.parse(junit).iter("testcase"):
            per_file["tests/" + case.get("classname", "").split(".")[-1] + ".py"] += float(case.get("time", 0))
    TABLE.write_text(json.dumps({f: round(s, 1) for f, s in sorted(per_file.items())}, indent=1) + "\n")
    print(f"wrote {TABLE} ({len(per_file)} files, {sum(per_file.values()):.0f} s)")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--record", metavar="JUNIT", nargs="+", help="rewrite tests/file_seconds.json from pytest --junitxml files")
    parser.add_argument("--junit-dir", metavar="DIR", help="each shard writes DIR/shardK.xml (for --record)")
    ours, pytest_args = _split(argv)
    args = parser.parse_args(ours)
    if args.record:
        record(args.record)
        return 0
    seconds = json.loads(TABLE.read_text()) if TABLE.exists() else {}
    groups = [g for g in deal(test_files(), seconds, max(1, args.shards)) if g]
    logs = Path(tempfile.mkdtemp(prefix="l3d-shards-"))
    started = time.monotonic()
    procs = []
    for k, files in enumerate(groups):
        log = open(logs / f"shard{k}.log", "w")
        junit = [f"--junitxml={Path(args.junit_dir).resolve() / f'shard{k}.xml'}"] if args.junit_dir else []
        cmd = [sys.executable, "-m", "pytest", *pytest_args, *junit, "-p", "no:cacheprovider", f"--basetemp={logs / f'tmp{k}'}", *files]
        procs.append((k, files, log, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=TESTS.parent)))
        print(f"shard {k}: {len(files)} files, about {sum(seconds.get(f, DEFAULT_S) for f in files):.0f} s recorded; log {log.name}", flush=True)
    codes = []
    for k, files, log, proc in procs:
        codes.append(proc.wait())
        log.close()
        print(f"shard {k} ended (exit {codes[-1]}) at {time.monotonic() - started:.0f} s", flush=True)
    for k, files, log, proc in procs:
        print(f"\n===== shard {k} of {len(procs)}: {' '.join(Path(f).stem for f in files)} =====")
        print(Path(log.name).read_text(), end="")
    print(f"\n{len(procs)} shards, {time.monotonic() - started:.0f} s; exit codes {codes}")
    if any(codes):
        print(f"logs and each shard's pytest base temp kept in {logs}")
    else:  # printed in full above; the base temps hold every test's files
        shutil.rmtree(logs, ignore_errors=True)
    # the first failure's code; a shard killed by a signal (negative) fails too, which max() would hide
    return next((code if code > 0 else 1 for code in codes if code), 0)


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    """This script's arguments, and pytest's after ``--``."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
