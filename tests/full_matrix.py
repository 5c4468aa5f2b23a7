"""``make test-matrix``: the full composition matrix (tests/matrix.py, :func:`full_matrix`).

Not collected by ``make test`` (the file name does not start with ``test_``). Cells run in chunks,
one world per chunk, so a cell that kills its world costs only its chunk. Each cell is a test; the
run ends with a summary line (cells, trained, refused, seconds) on stdout.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import asdict
from typing import Any

import pytest

from lightning_3d.testing.harness import run_on_ranks
from tests.matrix import Cell, cells_by_world, check_cell, full_matrix, refusal, run_references, run_world

CHUNK = 64
CELLS = full_matrix()
CHUNKS: list[tuple[int, list[Cell]]] = [
    (world, cells[i : i + CHUNK]) for world, cells in sorted(cells_by_world(CELLS).items()) for i in range(0, len(cells), CHUNK)
]
CHUNK_OF = {cell: index for index, (_, cells) in enumerate(CHUNKS) for cell in cells}
_results: dict[int, Any] = {}
_outcomes: dict[str, int] = {"trained": 0, "refused": 0}
_started = time.monotonic()


@pytest.fixture(scope="module")
def references() -> dict[str, Any]:
    return run_on_ranks(run_references, 1, [c for c in CELLS if refusal(asdict(c)) is None], timeout=3600)[0]


def _chunk(index: int) -> Any:
    if index not in _results:
        world, cells = CHUNKS[index]
        try:
            _results[index] = run_on_ranks(run_world, world, cells, tempfile.mkdtemp(prefix="l3d-matrix-"), timeout=3600)
        except Exception as err:  # noqa: BLE001 - a dead world fails its cells, not the run
            _results[index] = err
    return _results[index]


@pytest.mark.parametrize("cell", CELLS, ids=[c.id for c in CELLS])
def test_cell(cell: Cell, references):
    outcome = _chunk(CHUNK_OF[cell])
    if isinstance(outcome, Exception):
        pytest.fail(f"the world of this cell's chunk failed: {outcome}")
    _outcomes[check_cell(cell, outcome, references)] += 1


def test_summary():
    total = len(CELLS)
    print(
        f"\ncomposition matrix: {total} cells, {_outcomes['trained']} trained and matched one process, "
        f"{_outcomes['refused']} refused as expected, {total - sum(_outcomes.values())} failed; "
        f"{time.monotonic() - _started:.0f} s"
    )
