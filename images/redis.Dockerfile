# Redis for machines without a container registry: Debian bookworm's redis-server (7.0) on the
# local base (images/build-base.sh). Where a registry is reachable compose.yaml uses the pinned
# upstream image instead (REDIS_IMAGE); both run the same command line from compose.yaml.
ARG BASE_IMAGE=tandem-base:bookworm
FROM ${BASE_IMAGE}
ARG BASE_IMAGE
LABEL org.opencontainers.image.title="tandem-redis" \
      org.opencontainers.image.description="redis-server from Debian bookworm, for tandem's CPU stack" \
      org.opencontainers.image.base.name="${BASE_IMAGE}"
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /data && chown redis:redis /data
USER redis
WORKDIR /data
VOLUME /data
EXPOSE 6379
HEALTHCHECK --interval=5s --timeout=3s --retries=5 CMD ["redis-cli", "ping"]
CMD ["redis-server", "--appendonly", "yes", "--dir", "/data"]
