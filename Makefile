# `make demo` and `make test` do all set-up themselves on a fresh clone (Python 3.11+ with venv).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: all install demo test lint typecheck validate pytest bench clean

all: test

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/idemproxy demo

lint: $(STAMP)
	$(VENV)/bin/ruff check idemproxy tests bench

typecheck: $(STAMP)
	$(VENV)/bin/mypy --strict idemproxy

# Dockerfile, compose file and Kubernetes manifests, offline (alert rules and dashboard: tests/test_deploy.py).
validate: $(STAMP)
	$(VENV)/bin/hadolint --failure-threshold warning Dockerfile
	$(VENV)/bin/check-jsonschema --builtin-schema vendor.compose-spec docker-compose.yml
	$(VENV)/bin/kubernetes-validate --strict --quiet deploy/k8s/*.yaml

pytest: $(STAMP)
	$(PY) -m pytest

# The whole suite: lint, types, deployment files, then every test (real Redis/PostgreSQL started by the run
# when none is configured).
test: lint typecheck validate pytest

bench: $(STAMP)
	$(PY) bench/run.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
