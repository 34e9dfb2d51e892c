# Redis for machines without a container registry: Debian bookworm's redis-server (7.0) on the
# local base (images/build-base.sh). Where a registry is reachable compose.yaml uses the pinned
# upstream image instead (REDIS_IMAGE); both run the same command line from compose.yaml, whose
# entrypoint (deploy/k8s/base/redis.yaml's on Kubernetes) gives Redis its passwords and the user of
# each role on stdin. Those users need Redis 7.0 or newer: bookworm's is 7.0.
ARG BASE_IMAGE=tandem-base:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /data && chown redis:redis /data
USER redis
WORKDIR /data
VOLUME /data
EXPOSE 6379
HEALTHCHECK --interval=5s --timeout=3s --retries=5 CMD ["redis-cli", "ping"]
# Labels last (VERSION, REVISION, SOURCE, LICENSES, CREATED: from git, by `make images`): a new
# revision rebuilds no other layer.
ARG BASE_IMAGE
ARG VERSION=dev
ARG REVISION=unknown
ARG SOURCE=
ARG LICENSES=NOASSERTION
ARG CREATED=
LABEL org.opencontainers.image.title="tandem-redis" \
      org.opencontainers.image.description="redis-server from Debian bookworm, for tandem's CPU stack" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.licenses="${LICENSES}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.base.name="${BASE_IMAGE}"
CMD ["redis-server", "--appendonly", "yes", "--dir", "/data"]
