#!/usr/bin/env bash
# CI helper: make `docker compose` (v2) available beside docker-compose 1.29, so the e2e tier
# runs with both CLIs. Debian bookworm ships only 1.29; Debian trixie's docker-compose package
# is v2 (a static plugin binary): this fetches it through the Packages index, checks its sha256
# and installs the plugin for the current user. Idempotent; needs only curl, xz and dpkg-deb.
#   images/install-compose-v2.sh      # then: docker compose version
set -euo pipefail

if docker compose version >/dev/null 2>&1; then
  echo "install-compose-v2: $(docker compose version)"
  exit 0
fi
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
curl -fsS --retry 3 -o "$work/Packages.xz" "$mirror/dists/trixie/main/binary-amd64/Packages.xz"
read -r file sum < <(xz -dc "$work/Packages.xz" | awk '
  /^Package: /  { p = ($2 == "docker-compose") }
  p && /^Filename: / { f = $2 }
  p && /^SHA256: /   { s = $2 }
  /^$/ && p && f { print f, s; exit }')
[ -n "${file:-}" ] || { echo "install-compose-v2: no docker-compose in trixie's index" >&2; exit 1; }
echo "install-compose-v2: $file"
curl -fsS --retry 3 -o "$work/compose.deb" "$mirror/$file"
echo "$sum  $work/compose.deb" | sha256sum -c --quiet
dpkg-deb -x "$work/compose.deb" "$work/x"
mkdir -p "$HOME/.docker/cli-plugins"
install -m 0755 "$work/x/usr/libexec/docker/cli-plugins/docker-compose" "$HOME/.docker/cli-plugins/docker-compose"
echo "install-compose-v2: $(docker compose version)"
