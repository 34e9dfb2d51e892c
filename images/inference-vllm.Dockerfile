# tandem inference with vLLM, GPU: vLLM in its own venv (/opt/vllm) and tandem's controller and
# gateway in another (/opt/tandem), each installed with --require-hashes from its lock file
# (images/locks/vllm.txt, tandem.txt), on the same plain Ubuntu 24.04 base with Python 3.12 as
# images/inference.Dockerfile (SGLang's). vLLM's pins clash with SGLang's (torch, transformers,
# flashinfer, xgrammar, openai, compressed-tensors), so the two engines never share an image.
# `tandem-inference` starts and supervises `vllm serve` (TANDEM_ENGINE__KIND=vllm) on the
# container's loopback and talks to it over HTTP only.
#
#   docker build -f images/inference-vllm.Dockerfile -t tandem-inference-vllm:dev .
#   ENGINE=vllm make images STACK=gpu          # the base and the GPU images, vLLM's inference image
#   docker run --rm tandem-inference-vllm:dev tandem-doctor     # the environments against their locks
#
# BASE_IMAGE: as for images/inference.Dockerfile (python3 3.12, glibc 2.34 or newer).
ARG BASE_IMAGE=tandem-base:noble

# Local inputs, normalised so that the next stage can COPY them whether or not they exist.
FROM ${BASE_IMAGE} AS local
COPY images/local/ /local/
RUN touch /local/ca-certificates.crt

FROM ${BASE_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive LANG=C.UTF-8 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
# Python 3.12 with its headers and a C/C++ compiler: Triton (and vLLM's and FlashInfer's JIT
# kernels) compile small helpers at run time. The build host's CA bundle replaces the image's when there is one
# (containers here reach PyPI only with it).
COPY --from=local /local/ca-certificates.crt /tmp/host-ca.crt
RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends python3 python3-venv python3-dev gcc g++ libc6-dev ca-certificates >/dev/null \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb \
 && if [ -s /tmp/host-ca.crt ]; then cp /tmp/host-ca.crt /etc/ssl/certs/ca-certificates.crt; fi && rm /tmp/host-ca.crt \
 && python3 -c "import sys; v = sys.version.split()[0]; assert sys.version_info[:2] == (3, 12), 'the locks are for Python 3.12; BASE_IMAGE has ' + v" \
 && (id tandem >/dev/null 2>&1 || useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin tandem) \
 && mkdir -p /adapters /cache /logs && chown tandem:tandem /adapters /cache /logs

# vLLM's environment: one layer, every file checked against the lock's sha256, wheels only.
# --no-deps: the lock is the whole environment.
COPY images/locks/vllm.txt /opt/locks/vllm.txt
RUN python3 -m venv /opt/vllm \
 && /opt/vllm/bin/pip install -q --no-deps --require-hashes --only-binary :all: -r /opt/locks/vllm.txt

# tandem's environment (no torch), then tandem itself from the source tree.
COPY images/locks/tandem.txt /opt/locks/tandem.txt
RUN python3 -m venv /opt/tandem \
 && /opt/tandem/bin/pip install -q --no-deps --require-hashes --only-binary :all: -r /opt/locks/tandem.txt
COPY shared /src/shared
COPY inference /src/inference
RUN /opt/tandem/bin/pip install -q --no-deps --no-build-isolation /src/shared /src/inference && rm -rf /src

# tandem's venv first on PATH; vLLM is started by absolute path (TANDEM_ENGINE__VLLM_PYTHON).
# TANDEM_HEALTHCHECK is what HEALTHCHECK runs (and what tandem-doctor prints): the gateway's
# readiness, i.e. vLLM healthy and the controller reconciled. vLLM's caches (torch.compile,
# FlashInfer's JIT) go under the writable cache volume.
ENV VIRTUAL_ENV=/opt/tandem PATH=/opt/tandem/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    TANDEM_ENGINE__KIND=vllm TANDEM_ENGINE__VLLM_PYTHON=/opt/vllm/bin/python \
    VLLM_CACHE_ROOT=/cache/vllm VLLM_NO_USAGE_STATS=1 \
    TANDEM_STORE__ROOT=/adapters TANDEM_GATEWAY__HOST=0.0.0.0 HF_HOME=/cache/huggingface \
    TANDEM_HEALTHCHECK="python -c \"import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/ready' % os.environ.get('TANDEM_GATEWAY__PORT', '8000'), timeout=4)\""
USER tandem
WORKDIR /home/tandem
# The build fails unless both environments are exactly their locks, import, and run unprivileged.
RUN tandem-doctor
# Labels last (VERSION, REVISION, SOURCE, LICENSES, CREATED: from git, by `make images`): a new
# revision rebuilds no other layer.
ARG BASE_IMAGE
ARG VERSION=dev
ARG REVISION=unknown
ARG SOURCE=
ARG LICENSES=NOASSERTION
ARG CREATED=
LABEL org.opencontainers.image.title="tandem-inference-vllm" \
      org.opencontainers.image.description="tandem inference: vLLM engine + controller + OpenAI gateway (CUDA)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.licenses="${LICENSES}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.base.name="${BASE_IMAGE}"
EXPOSE 8000
# vLLM loads the model, compiles it and captures CUDA graphs before /ready answers: minutes.
HEALTHCHECK --interval=15s --timeout=5s --start-period=15m --retries=3 \
  CMD ["sh", "-c", "eval \"$TANDEM_HEALTHCHECK\""]
CMD ["tandem-inference"]
