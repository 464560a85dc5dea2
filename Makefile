# Two commands on a fresh machine: `make run` (set up, generate with the built-in k3-gsm8k model) and
# `make test` (set up with the test extras, lint, run the suite). CI runs `make test` via .ci/run.
PYTHON ?= python3
VENV ?= .venv
PROMPT ?= Natalia sold clips to 48 of her friends in April,

.PHONY: run test bench

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml $(VENV)/.installed
	$(VENV)/bin/pip install -q -e '.[test]'
	# SGLang's frontend and bench_serving, the client under test: without its deps (they pin a CUDA torch).
	$(VENV)/bin/pip install -q --no-deps sglang==0.5.23
	touch $@

run: $(VENV)/.installed
	$(VENV)/bin/radixk3 generate "$(PROMPT)" --max-new-tokens 24

test: $(VENV)/.installed-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python -m pytest
