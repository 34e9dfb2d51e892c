# tandem trainer, GPU: the rq worker training LoRA with Unsloth (peft as the fallback) on CUDA.
#
#   docker build -f images/trainer.Dockerfile -t tandem-trainer:dev \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04 .
#
# torch and Unsloth are pinned here (TORCH_SPEC, UNSLOTH_SPEC); PyPI's torch wheels are CUDA
# builds. NOTE: not yet built here (no registry on the CPU build machine).
ARG BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04

FROM ${BASE_IMAGE} AS os
ENV DEBIAN_FRONTEND=noninteractive LANG=C.UTF-8 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/tandem PATH=/opt/tandem/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
# python3-dev and a compiler: Triton (used by Unsloth) compiles small helpers at run time.
RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends python3 python3-venv python3-dev build-essential git ca-certificates >/dev/null \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -c "import sys; assert sys.version_info >= (3, 11), 'tandem needs Python >= 3.11; use a newer BASE_IMAGE'" \
 && (id tandem >/dev/null 2>&1 || useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin tandem) \
 && mkdir -p /adapters /cache && chown tandem:tandem /adapters /cache

FROM os AS deps
ARG TORCH_SPEC=torch==2.11.0
ARG UNSLOTH_SPEC=unsloth==2026.10.9
COPY shared/pyproject.toml /tmp/pyproject/shared.toml
COPY trainer/pyproject.toml /tmp/pyproject/trainer.toml
RUN python3 -m venv /opt/tandem \
 && pip install -q --upgrade pip setuptools wheel \
 && pip install -q "${TORCH_SPEC}" \
 && python3 -c 'import sys, tomllib; [print(d) for f in sys.argv[1:] for d in tomllib.load(open(f, "rb"))["project"]["dependencies"] if not d.startswith("tandem")]' \
      /tmp/pyproject/shared.toml /tmp/pyproject/trainer.toml > /tmp/requirements.txt \
 && pip install -q -r /tmp/requirements.txt "${UNSLOTH_SPEC}" "${TORCH_SPEC}"

FROM os
COPY --from=deps /opt/tandem /opt/tandem
COPY shared /src/shared
COPY trainer /src/trainer
RUN pip install -q --no-deps --no-build-isolation /src/shared /src/trainer && rm -rf /src \
 && python -c "import tandem_trainer.main"
ENV TANDEM_STORE__ROOT=/adapters TANDEM_WORKER_NAME=trainer HF_HOME=/cache/huggingface \
    TOKENIZERS_PARALLELISM=false HF_HUB_DISABLE_PROGRESS_BARS=1
# Labels last: a new VERSION/REVISION rebuilds no other layer.
ARG BASE_IMAGE
ARG VERSION=dev
ARG REVISION=unknown
LABEL org.opencontainers.image.title="tandem-trainer" \
      org.opencontainers.image.description="tandem trainer (rq worker, GRPO on LoRA with Unsloth), CUDA build" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.base.name="${BASE_IMAGE}"
USER tandem
WORKDIR /home/tandem
# Healthy while this worker's liveness key (refreshed every 2 s, TTL 8 s) is in Redis.
HEALTHCHECK --interval=15s --timeout=10s --start-period=10m --retries=3 \
  CMD ["python", "-c", "from tandem import keys; from tandem.settings import TrainerSettings as S; s = S(); raise SystemExit(0 if s.redis.connect().exists(keys.trainer_alive(s.worker_name or '')) else 1)"]
CMD ["tandem-trainer"]
