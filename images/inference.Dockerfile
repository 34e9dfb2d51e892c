# tandem inference, GPU: SGLang (from its own pinned image, its own Python) plus tandem's
# controller and gateway in a separate venv (/opt/tandem). `tandem-inference` starts and
# supervises `python -m sglang.launch_server` (TANDEM_ENGINE__KIND=sglang) and talks to it over
# HTTP only, so the two environments never share a package.
#
#   docker build -f images/inference.Dockerfile -t tandem-inference:dev \
#     --build-arg BASE_IMAGE=lmsysorg/sglang:v0.5.12-cu129 .
#
# NOTE: written against the SGLang 0.5.12 API (docs in sglang-api.md); not yet built here (no
# registry on the CPU build machine). SGLANG_PYTHON is checked at build time.
ARG BASE_IMAGE=lmsysorg/sglang:v0.5.12-cu129

FROM ${BASE_IMAGE}
ARG BASE_IMAGE
ARG SGLANG_PYTHON=/usr/bin/python3
ARG TANDEM_PYTHON=3.11
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TANDEM_ENGINE__KIND=sglang TANDEM_ENGINE__SGLANG_PYTHON=${SGLANG_PYTHON} \
    TANDEM_STORE__ROOT=/adapters TANDEM_GATEWAY__HOST=0.0.0.0 HF_HOME=/cache/huggingface

# SGLang's interpreter must import sglang; tandem gets its own venv (Python >= 3.11; uv brings
# one when the image's is older).
RUN "${SGLANG_PYTHON}" -c "import sglang; print('sglang', sglang.__version__)" \
 && "${SGLANG_PYTHON}" -m pip install -q uv \
 && "${SGLANG_PYTHON}" -m uv venv --python "${TANDEM_PYTHON}" /opt/tandem \
 && (id tandem >/dev/null 2>&1 || useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin tandem) \
 && mkdir -p /adapters /cache /logs && chown tandem:tandem /adapters /cache /logs

# Dependencies first (cached), then the source.
COPY shared/pyproject.toml /tmp/pyproject/shared.toml
COPY inference/pyproject.toml /tmp/pyproject/inference.toml
RUN /opt/tandem/bin/python -c 'import sys, tomllib; [print(d) for f in sys.argv[1:] for d in tomllib.load(open(f, "rb"))["project"]["dependencies"] if not d.startswith("tandem")]' \
      /tmp/pyproject/shared.toml /tmp/pyproject/inference.toml > /tmp/requirements.txt \
 && "${SGLANG_PYTHON}" -m uv pip install -q --python /opt/tandem/bin/python -r /tmp/requirements.txt setuptools
COPY shared /src/shared
COPY inference /src/inference
RUN "${SGLANG_PYTHON}" -m uv pip install -q --python /opt/tandem/bin/python --no-deps --no-build-isolation \
      /src/shared /src/inference && rm -rf /src \
 && /opt/tandem/bin/python -c "import tandem_inference.main, tandem_inference.launcher"

# tandem's venv first on PATH; SGLang is started by absolute path (TANDEM_ENGINE__SGLANG_PYTHON).
ENV VIRTUAL_ENV=/opt/tandem PATH=/opt/tandem/bin:${PATH}
# Labels last: a new VERSION/REVISION rebuilds no other layer.
ARG VERSION=dev
ARG REVISION=unknown
LABEL org.opencontainers.image.title="tandem-inference" \
      org.opencontainers.image.description="tandem inference: SGLang engine + controller + OpenAI gateway" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.base.name="${BASE_IMAGE}"
USER tandem
WORKDIR /home/tandem
EXPOSE 8000
# The gateway's readiness: SGLang healthy and the controller reconciled. Boot takes minutes.
HEALTHCHECK --interval=15s --timeout=5s --start-period=15m --retries=3 \
  CMD ["/opt/tandem/bin/python", "-c", "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/ready', timeout=4)"]
CMD ["tandem-inference"]
