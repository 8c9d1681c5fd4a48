# `make demo` and `make test` do all set-up themselves on a fresh clone (Python 3.11+ with venv).
# The demo needs only the runtime (~100 MB with pip); the test toolchain (servers, linters, validators) is
# installed only for the targets that use it. Each install has its own stamp, redone when pyproject.toml changes.
VENV ?= .venv
PY := $(VENV)/bin/python
RUNTIME := $(VENV)/.installed-runtime
STAMP := $(VENV)/.installed-test

.PHONY: all install demo test lint typecheck validate pytest bench clean

all: test

$(VENV)/bin/python:
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(RUNTIME): pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install --quiet -e .
	touch $(RUNTIME)

$(STAMP): pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP) $(RUNTIME)

install: $(RUNTIME)

demo: $(RUNTIME)
	$(VENV)/bin/idemproxy demo

lint: $(STAMP)
	$(VENV)/bin/ruff check idemproxy tests bench

typecheck: $(STAMP)
	$(VENV)/bin/mypy --strict --explicit-package-bases idemproxy tests bench

# Dockerfile, compose file and Kubernetes manifests, offline (alert rules and dashboard: tests/test_deploy.py).
validate: $(STAMP)
	$(VENV)/bin/hadolint --failure-threshold warning Dockerfile
	$(VENV)/bin/check-jsonschema --builtin-schema vendor.compose-spec docker-compose.yml
	$(VENV)/bin/kubernetes-validate --strict --quiet deploy/k8s/*.yaml

# Two pytest-xdist workers: most of the suite waits (on a store's timeout, a lease, a process starting), so two
# halve its time even on a 2-core machine. Each worker starts its own throwaway servers and takes its own ports.
PYTEST_WORKERS ?= 2

# tests.leakcheck: a test that leaves a socket open errors in its own teardown, with the stack that made it,
# instead of an unclosed-socket warning failing whichever later test the garbage collector runs in.
pytest: $(STAMP)
	$(PY) -m pytest -n $(PYTEST_WORKERS) -p tests.leakcheck

# The whole suite: lint, types, deployment files, then every test (real Redis/PostgreSQL started by the run
# when none is configured).
test: lint typecheck validate pytest

# wrk drives the load (Debian's package; installed here when missing and we are root).
BENCH := $(VENV)/.installed-bench

$(BENCH): pyproject.toml $(STAMP)
	$(PY) -m pip install --quiet -e '.[test,bench]'
	touch $(BENCH)

bench: $(BENCH)
	command -v wrk >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get install -y -qq wrk; } || \
		{ echo "bench needs wrk (apt-get install wrk)"; exit 1; }
	$(PY) bench/run.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
