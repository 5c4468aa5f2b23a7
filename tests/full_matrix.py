"""``make test-matrix``: the full composition matrix (tests/matrix.py, :func:`full_matrix`).

Not collected by ``make test`` (the file name does not start with ``test_``). Cells run in chunks,
one world per chunk, so a cell that kills its world costs only its chunk. Each cell is a test; the
run ends with a summary line (cells, trained, refused, seconds) on stdout.

The whole matrix takes longer than a working session on 2 cores, so it can run in parts:

* ``MATRIX_CHUNKS=0-9,40`` runs only those chunks (indices into :data:`CHUNKS`: two-rank worlds
  first, then four, then eight); the one-process references are computed for their cells only.
* ``MATRIX_LEDGER=path`` appends one JSON line per finished chunk (commit, chunk, world, cells,
  trained, refused, failed cell ids, seconds); ``python -m tests.full_matrix LEDGER`` says which
  chunks have passed and at which commits, and which are still to run.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from lightning_3d.testing.harness import run_on_ranks
from tests.matrix import Cell, cells_by_world, check_cell, full_matrix, refusal, run_references, run_world

CHUNK = 64
ALL_CELLS = full_matrix()
CHUNKS: list[tuple[int, list[Cell]]] = [
    (world, cells[i : i + CHUNK]) for world, cells in sorted(cells_by_world(ALL_CELLS).items()) for i in range(0, len(cells), CHUNK)
]


def selected_chunks(spec: str) -> list[int]:
    """``"0-9,40"`` -> [0, ..., 9, 40]; empty: every chunk."""
    if not spec.strip():
        return list(range(len(CHUNKS)))
    chosen: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.strip().partition("-")
        chosen.update(range(int(first), int(last or first) + 1))
    bad = sorted(i for i in chosen if not 0 <= i < len(CHUNKS))
    if bad:
        raise ValueError(f"MATRIX_CHUNKS={spec!r} names chunks {bad}; there are {len(CHUNKS)} (0-{len(CHUNKS) - 1}).")
    return sorted(chosen)


SELECTED = selected_chunks(os.environ.get("MATRIX_CHUNKS", ""))
CHUNK_OF = {cell: index for index in SELECTED for cell in CHUNKS[index][1]}
CELLS = [cell for index in SELECTED for cell in CHUNKS[index][1]]
LEDGER = os.environ.get("MATRIX_LEDGER", "")
_results: dict[int, Any] = {}
_checked: dict[int, dict[str, Any]] = {}
_outcomes: dict[str, int] = {"trained": 0, "refused": 0}
_started = time.monotonic()


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, cwd=Path(__file__).parent)
        return out.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")
    except OSError:
        return "unknown"


@pytest.fixture(scope="module")
def references() -> dict[str, Any]:
    return run_on_ranks(run_references, 1, [c for c in CELLS if refusal(asdict(c)) is None], timeout=3600)[0]


def _chunk(index: int) -> Any:
    if index not in _results:
        world, cells = CHUNKS[index]
        started = time.monotonic()
        try:
            _results[index] = run_on_ranks(run_world, world, cells, tempfile.mkdtemp(prefix="l3d-matrix-"), timeout=3600)
        except Exception as err:  # noqa: BLE001 - a dead world fails its cells, not the run
            _results[index] = err
        _checked[index] = {"chunk": index, "digest": chunk_digest(index), "world": world, "cells": len(cells), "trained": 0,
                           "refused": 0, "failed": [], "seconds": round(time.monotonic() - started)}
    return _results[index]


def _note(index: int, cell: Cell, outcome: str) -> None:
    """Count the cell for its chunk; the chunk's last cell writes the chunk's ledger line."""
    entry = _checked[index]
    if outcome == "failed":
        entry["failed"].append(cell.id)
    else:
        entry[outcome] += 1
    if LEDGER and entry["trained"] + entry["refused"] + len(entry["failed"]) == entry["cells"]:
        with open(LEDGER, "a") as f:
            f.write(json.dumps({"commit": _commit(), "date": time.strftime("%Y-%m-%d %H:%M"), **entry}) + "\n")


@pytest.mark.parametrize("cell", CELLS, ids=[c.id for c in CELLS])
def test_cell(cell: Cell, references):
    index = CHUNK_OF[cell]
    outcome = _chunk(index)
    result = "failed"
    try:
        if isinstance(outcome, Exception):
            pytest.fail(f"the world of this cell's chunk failed: {outcome}")
        result = check_cell(cell, outcome, references)
        _outcomes[result] += 1
    finally:
        _note(index, cell, result)


def test_summary():
    total = len(CELLS)
    print(
        f"\ncomposition matrix: {total} cells in {len(SELECTED)} of {len(CHUNKS)} chunks, {_outcomes['trained']} trained and "
        f"matched one process, {_outcomes['refused']} refused as expected, {total - sum(_outcomes.values())} failed; "
        f"{time.monotonic() - _started:.0f} s"
    )


def chunk_digest(index: int) -> str:
    """A chunk's cells, fingerprinted: a ledger line counts only for the cells it ran (a new factor or
    layout renumbers every chunk)."""
    ids = [f"{c.id}@{c.compile_backend}" if c.compile != "off" else c.id for c in CHUNKS[index][1]]
    return hashlib.sha1("\n".join(ids).encode()).hexdigest()[:12]


def ledger_report(path: str) -> str:
    """Which chunks have passed (every cell trained or refused as expected), where, and which remain.
    Lines of an earlier matrix (no digest, or another chunk's cells at that number) are not counted."""
    latest: dict[int, dict[str, Any]] = {}
    earlier = 0
    for line in Path(path).read_text().splitlines():
        if line.strip():
            entry = json.loads(line)
            if entry["chunk"] >= len(CHUNKS) or entry.get("digest") != chunk_digest(entry["chunk"]):
                earlier += 1
                continue
            latest[entry["chunk"]] = entry
    passed = {i: e for i, e in latest.items() if not e["failed"]}
    lines = [
        f"{len(passed)} of {len(CHUNKS)} chunks passed ({sum(e['cells'] for e in passed.values())} of {len(ALL_CELLS)} cells: "
        f"{sum(e['trained'] for e in passed.values())} trained, {sum(e['refused'] for e in passed.values())} refused; "
        f"{sum(e['seconds'] for e in passed.values()) / 3600:.1f} h of worlds)"
    ]
    for commit in sorted({e["commit"] for e in latest.values()}):
        lines.append(f"  at {commit}: chunks {_ranges(sorted(i for i, e in latest.items() if e['commit'] == commit))}")
    for i, e in sorted(latest.items()):
        if e["failed"]:
            lines.append(f"  chunk {i} FAILED {len(e['failed'])} cells: {e['failed'][:5]}")
    missing = [i for i in range(len(CHUNKS)) if i not in passed]
    lines.append(f"  still to run: {_ranges(missing) or 'none'}")
    if earlier:
        lines.append(f"  ({earlier} ledger lines are of an earlier matrix, other cells at those chunk numbers: not counted)")
    return "\n".join(lines)


def _ranges(indices: list[int]) -> str:
    parts: list[tuple[int, int]] = []
    for i in indices:
        if parts and parts[-1][1] == i - 1:
            parts[-1] = (parts[-1][0], i)
        else:
            parts.append((i, i))
    return ",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in parts)


if __name__ == "__main__":
    print(ledger_report(sys.argv[1]))
