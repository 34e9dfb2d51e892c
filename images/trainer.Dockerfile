# tandem trainer, GPU: the rq worker training LoRA with Unsloth (peft as the fallback) on CUDA.
# Its environment (/opt/trainer) is installed with --require-hashes from images/locks/trainer.txt
# on a plain Ubuntu 24.04 base with Python 3.12. CUDA's user space comes from the NVIDIA wheels
# torch depends on; the driver comes from the host through the NVIDIA Container Toolkit.
#
#   make images STACK=gpu                      # the base (images/build-base.sh) and both GPU images
#   docker build -f images/trainer.Dockerfile -t tandem-trainer:dev .
#   docker run --rm tandem-trainer:dev tandem-doctor       # the environment against its lock
#
# BASE_IMAGE: the local debootstrap base by default; any Debian/Ubuntu image whose python3 is 3.12
# and whose glibc is 2.34 or newer fits the lock (e.g. ubuntu:24.04, an nvidia/cuda *-ubuntu24.04 image).
ARG BASE_IMAGE=tandem-base:noble

# Local inputs, normalised so that the next stage can COPY them whether or not they exist.
FROM ${BASE_IMAGE} AS local
COPY images/local/ /local/
RUN touch /local/ca-certificates.crt

FROM ${BASE_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive LANG=C.UTF-8 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
# Python 3.12 with its headers and a C compiler: Triton (used by Unsloth) compiles small helpers
# at run time. The build host's CA bundle replaces the image's when there is one (containers
# here reach PyPI only with it).
COPY --from=local /local/ca-certificates.crt /tmp/host-ca.crt
RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev ca-certificates >/dev/null \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb \
 && if [ -s /tmp/host-ca.crt ]; then cp /tmp/host-ca.crt /etc/ssl/certs/ca-certificates.crt; fi && rm /tmp/host-ca.crt \
 && python3 -c "import sys; v = sys.version.split()[0]; assert sys.version_info[:2] == (3, 12), 'the lock is for Python 3.12; BASE_IMAGE has ' + v" \
 && (id tandem >/dev/null 2>&1 || useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin tandem) \
 && mkdir -p /adapters /cache && chown tandem:tandem /adapters /cache

# The environment: one layer, every file checked against the lock's sha256, wheels only.
# --no-deps: the lock is the whole environment (it leaves out what images/locks/trainer.overrides says).
COPY images/locks/trainer.txt /opt/locks/trainer.txt
RUN python3 -m venv /opt/trainer \
 && /opt/trainer/bin/pip install -q --no-deps --require-hashes --only-binary :all: -r /opt/locks/trainer.txt
COPY shared /src/shared
COPY trainer /src/trainer
RUN /opt/trainer/bin/pip install -q --no-deps --no-build-isolation /src/shared /src/trainer && rm -rf /src

# TANDEM_HEALTHCHECK is what HEALTHCHECK runs (and what tandem-doctor prints): healthy while this
# worker's liveness key (refreshed every 2 s, TTL 8 s) is in Redis.
ENV VIRTUAL_ENV=/opt/trainer PATH=/opt/trainer/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    TANDEM_STORE__ROOT=/adapters TANDEM_WORKER_NAME=trainer HF_HOME=/cache/huggingface \
    TOKENIZERS_PARALLELISM=false HF_HUB_DISABLE_PROGRESS_BARS=1 \
    TANDEM_HEALTHCHECK="python -c \"from tandem import keys; from tandem.settings import TrainerSettings as S; s = S(); raise SystemExit(0 if s.redis.connect().exists(keys.trainer_alive(s.worker_name or '')) else 1)\""
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
LABEL org.opencontainers.image.title="tandem-trainer" \
      org.opencontainers.image.description="tandem trainer (rq worker, GRPO on LoRA with Unsloth), CUDA build" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.licenses="${LICENSES}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.base.name="${BASE_IMAGE}"
HEALTHCHECK --interval=15s --timeout=10s --start-period=10m --retries=3 \
  CMD ["sh", "-c", "eval \"$TANDEM_HEALTHCHECK\""]
CMD ["tandem-trainer"]
