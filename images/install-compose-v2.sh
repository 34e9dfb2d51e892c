#!/usr/bin/env bash
# CI helper: make `docker compose` (v2, which tandem's compose files need: 2.24 or newer for
# `!reset`) available. Debian bookworm ships only docker-compose 1.29; Debian trixie's
# docker-compose package is v2 (a static Go plugin; seen running on bookworm): this finds it
# in trixie's Packages index, checks the download against the index's sha256 (a check against
# corruption; the index itself is not signature-checked) and installs the plugin for the
# current user. Idempotent.
#   images/install-compose-v2.sh      # then: docker compose version
set -euo pipefail

if docker compose version >/dev/null 2>&1; then
  docker compose version
  exit 0
fi
need=()
command -v curl >/dev/null || need+=(curl ca-certificates)
command -v xz >/dev/null || need+=(xz-utils)
if ((${#need[@]})); then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
arch=$(dpkg --print-architecture)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
curl -fsS --retry 3 -o "$work/Packages.xz" "$mirror/dists/trixie/main/binary-$arch/Packages.xz"
xz -dc "$work/Packages.xz" > "$work/Packages"
awk '
  /^Package: /  { p = ($2 == "docker-compose") }
  p && /^Filename: / { f = $2 }
  p && /^SHA256: /   { s = $2 }
  /^$/ && p && f { print f, s; exit }' "$work/Packages" > "$work/entry"
read -r file sum < "$work/entry" || true
if [ -z "${file:-}" ] || [ -z "${sum:-}" ]; then
  echo "install-compose-v2: no docker-compose for $arch in trixie's index at $mirror" >&2
  exit 1
fi
echo "install-compose-v2: $file"
curl -fsS --retry 3 -o "$work/compose.deb" "$mirror/$file"
echo "$sum  $work/compose.deb" | sha256sum -c --quiet
dpkg-deb -x "$work/compose.deb" "$work/x"
mkdir -p "$HOME/.docker/cli-plugins"
install -m 0755 "$work/x/usr/libexec/docker/cli-plugins/docker-compose" "$HOME/.docker/cli-plugins/docker-compose"
docker compose version
