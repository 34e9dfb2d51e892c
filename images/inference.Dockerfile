# tandem inference, GPU: SGLang in its own venv (/opt/sglang) and tandem's controller and
# gateway in another (/opt/tandem), each installed with --require-hashes from its lock file
# (images/locks/sglang.txt, tandem.txt), on a plain Ubuntu 24.04 base with Python 3.12. CUDA's
# user space comes from the NVIDIA wheels torch depends on; the driver comes from the host
# through the NVIDIA Container Toolkit. `tandem-inference` starts and supervises
# `python -m sglang.launch_server` (TANDEM_ENGINE__KIND=sglang) on the container's loopback and
# talks to it over HTTP only, so the two environments never share a package.
#
#   make images STACK=gpu                      # the base (images/build-base.sh) and both GPU images
#   docker build -f images/inference.Dockerfile -t tandem-inference:dev .
#   docker run --rm tandem-inference:dev tandem-doctor     # the environments against their locks
#
# BASE_IMAGE: the local debootstrap base by default; any Debian/Ubuntu image whose python3 is 3.12
# and whose glibc is 2.34 or newer fits the locks (e.g. ubuntu:24.04, an nvidia/cuda
# *-ubuntu24.04 image, an lmsysorg/sglang image on Ubuntu 24.04).
ARG BASE_IMAGE=tandem-base:noble

# Local inputs, normalised so that the next stage can COPY them whether or not they exist.
FROM ${BASE_IMAGE} AS local
COPY images/local/ /local/
RUN touch /local/ca-certificates.crt

FROM ${BASE_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive LANG=C.UTF-8 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
# Python 3.12 with its headers and a C/C++ compiler: Triton (and SGLang's JIT kernels) compile
# small helpers at run time. The build host's CA bundle replaces the image's when there is one
# (containers here reach PyPI only with it).
COPY --from=local /local/ca-certificates.crt /tmp/host-ca.crt
RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends python3 python3-venv python3-dev gcc g++ libc6-dev ca-certificates patch >/dev/null \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb \
 && if [ -s /tmp/host-ca.crt ]; then cp /tmp/host-ca.crt /etc/ssl/certs/ca-certificates.crt; fi && rm /tmp/host-ca.crt \
 && python3 -c "import sys; v = sys.version.split()[0]; assert sys.version_info[:2] == (3, 12), 'the locks are for Python 3.12; BASE_IMAGE has ' + v" \
 && (id tandem >/dev/null 2>&1 || useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin tandem) \
 && mkdir -p /adapters /cache /logs && chown tandem:tandem /adapters /cache /logs

# SGLang's environment: one layer, every file checked against the lock's sha256, wheels only.
# --no-deps: the lock is the whole environment (it leaves out what images/locks/sglang.overrides says).
COPY images/locks/sglang.txt /opt/locks/sglang.txt
RUN python3 -m venv /opt/sglang \
 && /opt/sglang/bin/pip install -q --no-deps --require-hashes --only-binary :all: -r /opt/locks/sglang.txt
# tandem's patches to SGLang (images/patches/: an adapter copied into its GPU slot at load time,
# engine.eager_adapter_slot; prefill graphs from one token, engine.prefill_graphs_from_one_token),
# each file checked by sha256 before and after.
COPY images/patches /opt/patches
RUN /opt/patches/apply.sh sglang /opt/sglang/lib/python3.12/site-packages

# tandem's environment (no torch), then tandem itself from the source tree.
COPY images/locks/tandem.txt /opt/locks/tandem.txt
RUN python3 -m venv /opt/tandem \
 && /opt/tandem/bin/pip install -q --no-deps --require-hashes --only-binary :all: -r /opt/locks/tandem.txt
COPY shared /src/shared
COPY inference /src/inference
RUN /opt/tandem/bin/pip install -q --no-deps --no-build-isolation /src/shared /src/inference && rm -rf /src

# tandem's venv first on PATH; SGLang is started by absolute path (TANDEM_ENGINE__SGLANG_PYTHON).
# TANDEM_HEALTHCHECK is what HEALTHCHECK runs (and what tandem-doctor prints): the gateway's
# readiness, i.e. SGLang healthy and the controller reconciled.
ENV VIRTUAL_ENV=/opt/tandem PATH=/opt/tandem/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    TANDEM_ENGINE__KIND=sglang TANDEM_ENGINE__SGLANG_PYTHON=/opt/sglang/bin/python \
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
LABEL org.opencontainers.image.title="tandem-inference" \
      org.opencontainers.image.description="tandem inference: SGLang engine + controller + OpenAI gateway (CUDA)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.licenses="${LICENSES}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.base.name="${BASE_IMAGE}"
EXPOSE 8000
# SGLang loads the model and captures CUDA graphs before /ready answers: minutes.
HEALTHCHECK --interval=15s --timeout=5s --start-period=15m --retries=3 \
  CMD ["sh", "-c", "eval \"$TANDEM_HEALTHCHECK\""]
CMD ["tandem-inference"]
