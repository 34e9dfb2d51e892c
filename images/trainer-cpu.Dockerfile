# tandem trainer, CPU: the rq worker training LoRA with peft on torch's CPU build.
#
#   images/build-base.sh        # the local Debian base and images/local/ (torch wheel, CA bundle)
#   docker build -f images/trainer-cpu.Dockerfile -t tandem-trainer-cpu:dev .
#
# The build context is the repository root (.dockerignore keeps it small). Dependencies are
# installed before the source is copied, so a source change rebuilds only the last layers.
# Runs `tandem-trainer`; `python -m tandem_trainer.tiny_model /models/tiny` builds the tiny model.
ARG BASE_IMAGE=tandem-base:bookworm

# Local inputs, normalised so that later stages can COPY them whether or not they exist.
FROM ${BASE_IMAGE} AS local
COPY images/local/ /local/
RUN mkdir -p /local/wheels && touch /local/ca-certificates.crt

# Debian + Python 3.11 + the CA bundle of the build host (containers here reach PyPI only with it).
FROM ${BASE_IMAGE} AS os
ENV DEBIAN_FRONTEND=noninteractive LANG=C.UTF-8 \
    PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
    VIRTUAL_ENV=/opt/tandem PATH=/opt/tandem/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends python3 python3-venv ca-certificates >/dev/null \
 && rm -rf /var/lib/apt/lists/*
COPY --from=local /local/ca-certificates.crt /tmp/host-ca.crt
RUN if [ -s /tmp/host-ca.crt ]; then cp /tmp/host-ca.crt /etc/ssl/certs/ca-certificates.crt; fi; rm /tmp/host-ca.crt \
 && useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin tandem \
 && mkdir -p /models /adapters && chown tandem:tandem /models /adapters

# The virtual environment with every third-party dependency (the slow, cached part): exactly
# images/locks/cpu-trainer.txt, every file checked against its sha256 (the pins of images/locks/dev.txt,
# the environment `make test` runs). torch's CPU build comes from images/local/wheels when
# images/build-base.sh put it there (then no other index is asked), else from TORCH_INDEX.
FROM os AS deps
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
COPY --from=local /local/wheels/ /wheels/
COPY images/locks/cpu-trainer.txt /tmp/lock.txt
RUN python3 -m venv /opt/tandem \
 && if ls /wheels/torch-*.whl >/dev/null 2>&1; then index=""; else index="$TORCH_INDEX"; fi \
 && echo "torch from: ${index:-$(ls /wheels/torch-*.whl)}" \
 && pip install -q --require-hashes --find-links /wheels ${index:+--extra-index-url "$index"} -r /tmp/lock.txt \
 && rm /tmp/lock.txt

FROM os
COPY --from=deps /opt/tandem /opt/tandem
COPY shared /src/shared
COPY trainer /src/trainer
RUN pip install -q --no-deps --no-build-isolation /src/shared /src/trainer && rm -rf /src \
 && python -c "import tandem_trainer.main, tandem_trainer.tiny_model"
ENV TANDEM_STORE__ROOT=/adapters TANDEM_GPUS__MODE=cpu TANDEM_WORKER_NAME=trainer \
    HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false HF_HUB_DISABLE_PROGRESS_BARS=1
COPY images/locks/cpu-trainer.txt /opt/locks/cpu-trainer.txt
USER tandem
WORKDIR /home/tandem
# The build fails unless the environment is exactly its lock, imports, and runs unprivileged.
RUN tandem-doctor
# Labels last (VERSION, REVISION, SOURCE, LICENSES, CREATED: from git, by `make images`): a new
# revision rebuilds no other layer.
ARG BASE_IMAGE
ARG VERSION=dev
ARG REVISION=unknown
ARG SOURCE=
ARG LICENSES=NOASSERTION
ARG CREATED=
LABEL org.opencontainers.image.title="tandem-trainer-cpu" \
      org.opencontainers.image.description="tandem trainer (rq worker, GRPO on LoRA with peft), CPU build" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.licenses="${LICENSES}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.base.name="${BASE_IMAGE}"
# Healthy while this worker's liveness key (refreshed every 2 s, TTL 8 s) is in Redis.
HEALTHCHECK --interval=10s --timeout=10s --start-period=120s --retries=3 \
  CMD ["python", "-c", "from tandem import keys; from tandem.settings import TrainerSettings as S; s = S(); raise SystemExit(0 if s.redis.connect().exists(keys.trainer_alive(s.worker_name or '')) else 1)"]
CMD ["tandem-trainer"]
