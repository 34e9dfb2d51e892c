# tandem inference, CPU: the transformers engine (`tandem-engine`) and the controller + gateway
# (`tandem-inference`) in one image; compose runs them as two services.
#
#   images/build-base.sh        # the local Debian base and images/local/ (torch wheel, CA bundle)
#   docker build -f images/inference-cpu.Dockerfile -t tandem-inference-cpu:dev .
#
# The build context is the repository root (.dockerignore keeps it small). Dependencies are
# installed before the source is copied, so a source change rebuilds only the last layers.
# Default command: `tandem-inference` (the gateway on TANDEM_GATEWAY__PORT, 8000).
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
# images/locks/cpu-inference.txt, every file checked against its sha256 (the pins of images/locks/dev.txt,
# the environment `make test` runs). torch's CPU build comes from images/local/wheels when
# images/build-base.sh put it there (then no other index is asked), else from TORCH_INDEX.
FROM os AS deps
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
COPY --from=local /local/wheels/ /wheels/
COPY images/locks/cpu-inference.txt /tmp/lock.txt
RUN python3 -m venv /opt/tandem \
 && if ls /wheels/torch-*.whl >/dev/null 2>&1; then index=""; else index="$TORCH_INDEX"; fi \
 && echo "torch from: ${index:-$(ls /wheels/torch-*.whl)}" \
 && pip install -q --require-hashes --find-links /wheels ${index:+--extra-index-url "$index"} -r /tmp/lock.txt \
 && rm /tmp/lock.txt

FROM os
COPY --from=deps /opt/tandem /opt/tandem
COPY shared /src/shared
COPY inference /src/inference
RUN pip install -q --no-deps --no-build-isolation "/src/shared" "/src/inference[engine]" && rm -rf /src \
 && python -c "import tandem_inference.main, tandem_inference.engines.transformers.server"
ENV TANDEM_STORE__ROOT=/adapters TANDEM_GPUS__MODE=cpu TANDEM_ENGINE__KIND=transformers \
    TANDEM_ENGINE__DEVICE=cpu TANDEM_ENGINE__HOST=0.0.0.0 TANDEM_GATEWAY__HOST=0.0.0.0 \
    HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false HF_HUB_DISABLE_PROGRESS_BARS=1
COPY images/locks/cpu-inference.txt /opt/locks/cpu-inference.txt
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
LABEL org.opencontainers.image.title="tandem-inference-cpu" \
      org.opencontainers.image.description="tandem inference (transformers engine, controller, OpenAI gateway), CPU build" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.licenses="${LICENSES}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.base.name="${BASE_IMAGE}"
EXPOSE 8000 30000
# The gateway's readiness: engine reachable and the controller caught up with the registry.
# The engine service overrides it with the engine's /health (compose.cpu.yaml).
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/ready' % os.environ.get('TANDEM_GATEWAY__PORT', '8000'), timeout=4)"]
CMD ["tandem-inference"]
