#!/usr/bin/env bash
# CI helper: make `docker compose` (v2, which tandem's compose files need: 2.24 or newer for
# `!reset`) available. Debian bookworm ships only docker-compose 1.29; Debian trixie's
# docker-compose package is v2 (a static Go plugin; seen running on bookworm): this takes it
# from trixie (images/trixie-deb.sh, sha256-checked) and installs the plugin for the current
# user. Idempotent.
#   images/install-compose-v2.sh      # then: docker compose version
set -euo pipefail

if docker compose version >/dev/null 2>&1; then
  docker compose version
  exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$(dirname "$0")/trixie-deb.sh" docker-compose "$work/x"
mkdir -p "$HOME/.docker/cli-plugins"
install -m 0755 "$work/x/usr/libexec/docker/cli-plugins/docker-compose" "$HOME/.docker/cli-plugins/docker-compose"
docker compose version
