# `make demo` and `make test` work on a fresh machine with Python 3.11: they build .venv first.
# `make bench` also installs the bench extra (Orbax), then runs benchmarks/run.py $(BENCH_ARGS).
# `make dist` builds the sdist and wheel into dist/ (the dist extra: build, twine) and checks them;
# `make smoke` installs that wheel, and a copy of the checkout (`pip install ".[flax]"`, as from a clone),
# each into a fresh virtualenv outside the checkout, and uses them from there.
# `make lint` checks style (ruff), types (mypy, configured in pyproject.toml: zero errors) and the layers'
# import directions (import-linter's contract in pyproject.toml).
# `make docs` also installs the docs extra (Sphinx, MyST, furo), then builds the site into
# docs/_build/html strictly: a warning, a broken link or an unresolved reference fails it.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
BENCH_STAMP := $(VENV)/.bench-stamp
DIST_STAMP := $(VENV)/.dist-stamp
DOCS_STAMP := $(VENV)/.docs-stamp
PYTEST_ARGS ?= -n 2
BENCH_ARGS ?=

.PHONY: demo test lint bench venv clean dist smoke stress docs

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test]'
	touch $@

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[bench]'
	touch $@

$(DIST_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dist]'
	touch $@

$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[docs]'
	touch $@

venv: $(STAMP)

demo: $(STAMP)
	$(PY) examples/guide.py

test: $(STAMP)
	$(PY) -m ruff check jaxckpt tests examples
	$(PY) -m pytest $(PYTEST_ARGS)

# The reliability tests' stress variants tenfold (CI runs them once over): kills, damaged copies, fuzz cases.
stress: $(STAMP)
	JAXCKPT_STRESS_SCALE=10 $(PY) -m pytest -m stress -q -rA -n 2 -p no:randomly

bench: $(BENCH_STAMP)
	$(PY) benchmarks/run.py $(BENCH_ARGS)

# The build runs in an isolated environment with the setuptools pinned in constraints.txt; any
# warning in its output (a deprecated setting, a file left out) fails the target.
dist: $(DIST_STAMP)
	rm -rf dist build jaxckpt.egg-info
	env -u PYTHONDONTWRITEBYTECODE PIP_CONSTRAINT=$(CURDIR)/constraints.txt $(PY) -m build --outdir dist . > $(VENV)/build.log 2>&1 \
		|| { cat $(VENV)/build.log; exit 1; }
	@if grep -i warn $(VENV)/build.log | grep -qvE '^(copying|adding|creating) '; then \
		cat $(VENV)/build.log; echo 'make dist: the build warned (above); fix it' >&2; exit 1; fi
	$(PY) -m twine check --strict dist/*
	$(PY) -m zipfile -l dist/*.whl

# -E: read every page afresh (docstrings change without the pages changing); -n: every reference must resolve.
docs: $(DOCS_STAMP)
	$(PY) -m sphinx -E -W --keep-going -n -q -b html docs docs/_build/html

smoke:
	PYTHON=$(PYTHON) bash scripts/smoke_wheel.sh

lint: $(STAMP)
	$(PY) -m ruff check jaxckpt tests examples benchmarks scripts docs
	# docs/: conf.py only; the pages' examples keep their aligned comments (they run in tests/test_docs.py).
	$(PY) -m ruff format --check jaxckpt tests examples benchmarks scripts docs/conf.py
	$(PY) -m mypy
	$(VENV)/bin/lint-imports --no-cache

clean:
	rm -rf $(VENV) demo_ckpts dist build docs/_build
