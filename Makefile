# The two README commands: `make bench` (main job) and `make test`; CI also runs `make lint` and `make test-floor`.
# Both venvs hold the `plots` extra (matplotlib), so `make bench` ends with its report image and the tests draw one;
# the benchmark itself runs without it (it then says how to get the plots).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0

# test-floor: the tests marked `floor` (pytest -m floor: those that exercise our dependencies), in a second venv
# holding the lowest version of every requirement pyproject.toml allows (.ci/floor_constraints.py turns each `>=X`
# into `==X`; torch 2.11 is a CUDA build from PyPI, ~1.7 GB).
FLOOR_VENV  ?= .venv-floor
FLOOR_PY    := $(FLOOR_VENV)/bin/python

.PHONY: bench test lint test-floor setup

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test,plots]"
	touch $@

setup: $(VENV)/.installed

bench: $(VENV)/.installed
	$(PY) -m bench run $(ARGS)

# Where CI is set (.ci/run sets it) the `slow` tests run too; elsewhere `make test` leaves them out. TEST_WORKERS
# pytest-xdist processes, a file each at a time (module fixtures built once; files sharing a costly session fixture
# run together, heaviest first: tests/conftest.py): on CI's 2 cores the suite is mostly
# one-threaded Python and compiles, so 2 workers keep both cores busy; TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2
XDIST        := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)
test: $(VENV)/.installed
	$(PY) -m pytest -q $(XDIST) $(if $(CI),,-m "not gpu and not slow") $(ARGS)

lint: $(VENV)/.installed
	$(PY) -m ruff check .

# No build isolation, so that the package is built with the floor's setuptools too (setuptools < 70.1 needs wheel).
$(FLOOR_VENV)/.installed: pyproject.toml .ci/floor_constraints.py
	rm -rf $(FLOOR_VENV)
	$(PYTHON) -m venv $(FLOOR_VENV)
	$(PYTHON) .ci/floor_constraints.py pyproject.toml > $(FLOOR_VENV)/constraints.txt
	$(FLOOR_PY) -m pip install -q --upgrade pip
	$(FLOOR_PY) -m pip install -q -c $(FLOOR_VENV)/constraints.txt setuptools wheel
	$(FLOOR_PY) -m pip install -q -c $(FLOOR_VENV)/constraints.txt --no-build-isolation -e ".[test,plots]"
	touch $@

test-floor: $(FLOOR_VENV)/.installed
	$(FLOOR_PY) -m pip list --format=freeze | grep -iE "^($$(cut -d= -f1 $(FLOOR_VENV)/constraints.txt | paste -sd'|'))=="
	$(FLOOR_PY) -m pytest -q $(XDIST) -m "floor and not gpu" $(ARGS)
