# rq-dashboard for the `monitoring` profile: rq's web UI for the train queue, installed once at
# build time and run as an unprivileged user. Its Redis URL (with the password) comes from the
# environment (RQ_DASHBOARD_REDIS_URL), never from a command line; jobs are shown with rq's
# JSON serializer, as tandem writes them.
#
#   docker build -f images/rq-dashboard.Dockerfile -t tandem-rq-dashboard:dev .
#
# A Debian or Ubuntu base (Python 3.11 or 3.12, BASE_IMAGE); its environment is images/locks/rq-dashboard.txt,
# hash-checked, whose rq and redis are the versions tandem's images use (compiled with dev.txt as
# constraints), so the dashboard reads the jobs they write.
ARG BASE_IMAGE=tandem-base:bookworm

# Local inputs, normalised so that the next stage can COPY them whether or not they exist.
FROM ${BASE_IMAGE} AS local
COPY images/local/ /local/
RUN touch /local/ca-certificates.crt

FROM ${BASE_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive LANG=C.UTF-8 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
    PATH=/opt/rq-dashboard/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    RQ_DASHBOARD_JSON=1
RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends python3 python3-venv ca-certificates >/dev/null \
 && rm -rf /var/lib/apt/lists/*
COPY --from=local /local/ca-certificates.crt /tmp/host-ca.crt
# The lock stays in /opt/locks: the image's SBOM lists its packages from it (images/publish.sh).
COPY images/locks/rq-dashboard.txt /opt/locks/rq-dashboard.txt
RUN if [ -s /tmp/host-ca.crt ]; then cp /tmp/host-ca.crt /etc/ssl/certs/ca-certificates.crt; fi; rm /tmp/host-ca.crt \
 && python3 -m venv /opt/rq-dashboard \
 && pip install -q --require-hashes -r /opt/locks/rq-dashboard.txt \
 && rq-dashboard --help >/dev/null \
 && useradd --uid 10002 --user-group --no-create-home --shell /usr/sbin/nologin dashboard
USER dashboard
EXPOSE 9181
HEALTHCHECK --interval=10s --timeout=5s --retries=3 \
  CMD ["python3", "-c", "import urllib.request as u; u.urlopen('http://127.0.0.1:9181/', timeout=4)"]
# Labels last (VERSION, REVISION, SOURCE, LICENSES, CREATED: from git, by `make images`): a new
# revision rebuilds no other layer.
ARG BASE_IMAGE
ARG VERSION=dev
ARG REVISION=unknown
ARG SOURCE=
ARG LICENSES=NOASSERTION
ARG CREATED=
LABEL org.opencontainers.image.title="tandem-rq-dashboard" \
      org.opencontainers.image.description="rq-dashboard for tandem's train queue (monitoring profile)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.licenses="${LICENSES}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.base.name="${BASE_IMAGE}"
CMD ["rq-dashboard", "--bind", "0.0.0.0", "--port", "9181"]
