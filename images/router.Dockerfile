# The router in front of the inference replicas: HAProxy from the base's Debian, running
# images/router/haproxy.cfg as the haproxy user. It finds the replicas by DNS (ROUTER_REPLICAS:
# compose's service name, or a Kubernetes headless service) and sends each request to one whose
# /ready answers 200.
ARG BASE_IMAGE=tandem-base:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends haproxy >/dev/null \
 && rm -rf /var/lib/apt/lists/*
COPY images/router/haproxy.cfg /etc/tandem/haproxy.cfg
ENV ROUTER_BIND=0.0.0.0 \
    ROUTER_PORT=8000 \
    ROUTER_REPLICAS=inference \
    ROUTER_REPLICA_PORT=8000 \
    ROUTER_MAX_REPLICAS=16
USER haproxy
EXPOSE 8000
RUN haproxy -c -f /etc/tandem/haproxy.cfg
# Labels last (VERSION, REVISION, SOURCE, LICENSES, CREATED: from git, by `make images`): a new
# revision rebuilds no other layer.
ARG BASE_IMAGE
ARG VERSION=dev
ARG REVISION=unknown
ARG SOURCE=
ARG LICENSES=NOASSERTION
ARG CREATED=
LABEL org.opencontainers.image.title="tandem-router" \
      org.opencontainers.image.description="HAProxy in front of tandem's inference replicas" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.licenses="${LICENSES}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.base.name="${BASE_IMAGE}"
CMD ["haproxy", "-db", "-W", "-f", "/etc/tandem/haproxy.cfg"]
