# The README commands: `make bench` (main job), `make test` and `make lint`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0

.PHONY: bench test lint setup

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

setup: $(VENV)/.installed

bench: $(VENV)/.installed
	$(PY) -m bench.run $(ARGS)

test: $(VENV)/.installed
	$(PY) -m pytest -q $(ARGS)

lint: $(VENV)/.installed
	$(PY) -m ruff check .
