#!/usr/bin/env bash
# CI helper: make a docker engine answer. Installs docker.io and debootstrap from Debian/Ubuntu
# when they are missing, and starts dockerd in the background when no engine answers; waits
# until it does. Needs root. Idempotent. Docker Compose v2: images/install-compose-v2.sh.
#   images/install-docker.sh        # dockerd's log: /tmp/dockerd.log (DOCKERD_LOG)
set -euo pipefail

log="${DOCKERD_LOG:-/tmp/dockerd.log}"
need=()
command -v docker >/dev/null || need+=(docker.io)
command -v dockerd >/dev/null || need+=(docker.io)
command -v debootstrap >/dev/null || need+=(debootstrap)
if ((${#need[@]})); then
  echo "install-docker: apt-get install ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq $(printf '%s\n' "${need[@]}" | sort -u) >/dev/null
fi

if docker info >/dev/null 2>&1; then
  echo "install-docker: the docker engine answers ($(docker version --format '{{.Server.Version}}'))"
  exit 0
fi
echo "install-docker: starting dockerd (log: $log)"
nohup dockerd >"$log" 2>&1 &
for _ in $(seq 60); do
  if docker info >/dev/null 2>&1; then
    echo "install-docker: dockerd $(docker version --format '{{.Server.Version}}') is up"
    exit 0
  fi
  sleep 1
done
echo "install-docker: dockerd did not answer within 60 s; last lines of $log:" >&2
tail -20 "$log" >&2
exit 1
