"""The composition matrix in ``make test``: the pairwise covering array of tests/matrix.py.

Every pair of factor values (layout, ZeRO stage, precision, accumulation, recompute, offload,
sequence parallel, clipping, masked targets, ragged last batch, unused/frozen parameters, a second
optimizer, resume under another layout) meets in at least one cell; each cell trains and matches
one process, or is refused before step 1 with the expected message. ``make test-matrix`` runs the
larger set (tests/test_matrix_full.py). How to read a failure: docs/testing.md.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import pytest

from lightning_3d.testing.harness import run_on_ranks
from tests.matrix import Cell, cells_by_world, check_cell, covering_array, refusal, run_references, run_world

# Compiled cells with Dynamo's capture and graph breaks but no AOTAutograd ("eager" backend): 40% less than
# aot_eager of what compiling adds here (make test's budget); tests/test_compile.py and make test-matrix (aot_eager) cover
# AOTAutograd's graphs, MATRIX_COMPILE_BACKEND another backend.
SAMPLE_BACKEND = os.environ.get("MATRIX_COMPILE_BACKEND", "eager")
CELLS = [replace(c, compile_backend=SAMPLE_BACKEND) if c.compile != "off" else c for c in covering_array(strength=2)]
WORLDS = cells_by_world(CELLS)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[int, list[Any]]:
    tmp = str(tmp_path_factory.mktemp("matrix"))
    return {world: run_on_ranks(run_world, world, cells, tmp, timeout=1500) for world, cells in sorted(WORLDS.items())}


@pytest.fixture(scope="module")
def references() -> dict[str, Any]:
    return run_on_ranks(run_references, 1, [c for c in CELLS if refusal(c.__dict__) is None], timeout=900)[0]


def test_the_sample_covers_every_pair_of_values():
    from dataclasses import asdict
    from itertools import combinations

    from tests.matrix import FACTORS

    covered = {pair for cell in CELLS for pair in combinations([(n, getattr(cell, n)) for n in FACTORS], 2)}
    names = list(FACTORS)
    for a, b in combinations(names, 2):
        for va in FACTORS[a]:
            for vb in FACTORS[b]:
                pair = ((a, va), (b, vb))
                refused = refusal(dict(pair)) is not None
                assert refused or pair in covered, f"pair {pair} is in no cell"


@pytest.mark.parametrize("cell", CELLS, ids=[c.id for c in CELLS])
def test_cell(cell: Cell, outcomes, references):
    check_cell(cell, outcomes[cell.world], references)
