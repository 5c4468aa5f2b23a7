# `make train` and `make test` each do the whole set-up on a fresh machine.
# GPU users: create .venv and install their CUDA build of torch first; it is kept.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: setup train test test-slow test-matrix bench bench-peers clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

train: $(STAMP)
	$(PY) recipes/train.py $(ARGS)

# Two pytest processes, one per core (tests/scripts/run_shards.py); ARGS (a file, -k ...) makes it one plain pytest.
SHARDS ?= 2
test: $(STAMP)
ifeq ($(strip $(ARGS)),)
	$(PY) tests/scripts/run_shards.py --shards $(SHARDS) -- -q -m "not slow" --durations=10
else
	$(PY) -m pytest -q -m "not slow" --durations=15 $(ARGS)
endif

# Tests marked slow (more tiny recipes end to end): run before a release; `make test` leaves them out.
test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow $(ARGS)

# The full composition matrix (tests/matrix.py, 6,023 cells): several hours on 2 cores; `make test` runs its pairwise sample.
# In parts: make test-matrix CHUNKS=0-9 LEDGER=docs/matrix_ledger.jsonl (see tests/full_matrix.py).
test-matrix: $(STAMP)
	MATRIX_CHUNKS="$(CHUNKS)" MATRIX_LEDGER="$(LEDGER)" $(PY) -m pytest -q -s tests/full_matrix.py $(ARGS)

bench: $(STAMP)
	$(PY) benchmarks/run.py $(ARGS)

# The stacks users would pick instead (DeepSpeed, torchtitan), in their own environment: .venv is never
# touched. `make bench` runs the peer cases when it exists and reports them as not run otherwise.
PEERS       ?= .venv-peers
PEERS_STAMP := $(PEERS)/.installed
PEER_PKGS   ?= deepspeed==0.19.8 torchtitan==0.3.0 ninja triton

bench-peers: $(PEERS_STAMP)
	$(PY) benchmarks/run.py --cases deepspeed_zero_stages torchtitan_llama torchtitan_pipeline $(ARGS)

$(PEERS_STAMP): pyproject.toml $(STAMP)
	test -x $(PEERS)/bin/python || $(PYTHON) -m venv $(PEERS)
	$(PEERS)/bin/python -m pip install --quiet --upgrade pip
	$(PEERS)/bin/python -c "import torch" 2>/dev/null || $(PEERS)/bin/python -m pip install --quiet "$(TORCH)"
	$(PEERS)/bin/python -m pip install --quiet $(PEER_PKGS) -e .
	touch $(PEERS_STAMP)

clean:
	rm -rf $(VENV) $(PEERS) outputs bench_results .pytest_cache
