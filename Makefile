# `make demo` and `make test` work on a fresh machine with Python 3.11: they build .venv first.
# `make bench` also installs the bench extra (Orbax), then runs benchmarks/run.py $(BENCH_ARGS).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
BENCH_STAMP := $(VENV)/.bench-stamp
PYTEST_ARGS ?= -n 2
BENCH_ARGS ?=

.PHONY: demo test lint bench venv clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test]'
	touch $@

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[bench]'
	touch $@

venv: $(STAMP)

demo: $(STAMP)
	$(PY) examples/guide.py

test: $(STAMP)
	$(PY) -m ruff check jaxckpt tests examples
	$(PY) -m pytest $(PYTEST_ARGS)

bench: $(BENCH_STAMP)
	$(PY) benchmarks/run.py $(BENCH_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check jaxckpt tests examples
	$(PY) -m ruff format --check jaxckpt tests examples

clean:
	rm -rf $(VENV) demo_ckpts
