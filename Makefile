# `make train` and `make test` each do the whole set-up on a fresh machine.
# GPU users: create .venv and install their CUDA build of torch first; it is kept.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: setup train test test-slow test-matrix bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

train: $(STAMP)
	$(PY) recipes/train.py $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow" --durations=15 $(ARGS)

# Tests marked slow (more tiny recipes end to end): run before a release; `make test` leaves them out.
test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow $(ARGS)

# The full composition matrix (tests/matrix.py, 4,591 cells): several hours on 2 cores; `make test` runs its pairwise sample.
test-matrix: $(STAMP)
	$(PY) -m pytest -q -s tests/full_matrix.py $(ARGS)

bench: $(STAMP)
	$(PY) benchmarks/run.py $(ARGS)

clean:
	rm -rf $(VENV) outputs bench_results .pytest_cache
