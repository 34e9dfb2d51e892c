# Prometheus for the container stacks (compose's `metrics` profile): the base's own distribution
# package (Debian bookworm's, Ubuntu's on the GPU base) on the local base (images/build-base.sh), with
# tandem's scrape configuration and alert rules, both checked by promtool while the image builds (and
# the rules' tests, alerts.test.yml, run).
ARG BASE_IMAGE=tandem-base:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /prometheus && chown prometheus:prometheus /prometheus
COPY images/prometheus/ /etc/tandem/prometheus/
RUN promtool check config /etc/tandem/prometheus/prometheus.yml \
 && promtool check rules /etc/tandem/prometheus/alerts.yml \
 && promtool test rules /etc/tandem/prometheus/alerts.test.yml
USER prometheus
WORKDIR /prometheus
VOLUME /prometheus
EXPOSE 9090
# Labels last (VERSION, REVISION, SOURCE, LICENSES, CREATED: from git, by `make images`): a new
# revision rebuilds no other layer.
ARG BASE_IMAGE
ARG VERSION=dev
ARG REVISION=unknown
ARG SOURCE=
ARG LICENSES=NOASSERTION
ARG CREATED=
LABEL org.opencontainers.image.title="tandem-prometheus" \
      org.opencontainers.image.description="Prometheus scraping tandem's services" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.licenses="${LICENSES}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.base.name="${BASE_IMAGE}"
CMD ["prometheus", "--config.file=/etc/tandem/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus", \
     "--storage.tsdb.retention.time=15d", "--web.listen-address=0.0.0.0:9090"]
