#!/usr/bin/env bash
# Fetch one package of Debian trixie into a folder, unpacked: for what a Debian 12 host lacks and
# tandem's build needs (Compose v2's plugin, Ubuntu's archive keyring). Finds the package in
# trixie's Packages index, checks the download against the index's sha256 (a check against
# corruption; the index itself is not signature-checked) and unpacks it with dpkg-deb.
#   images/trixie-deb.sh PACKAGE DIR      # then: DIR/usr/...
set -euo pipefail
package="$1" dest="$2"
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
awk -v want="$package" '
  /^Package: /  { p = ($2 == want) }
  p && /^Filename: / { f = $2 }
  p && /^SHA256: /   { s = $2 }
  /^$/ && p && f { print f, s; exit }' "$work/Packages" > "$work/entry"
read -r file sum < "$work/entry" || true
if [ -z "${file:-}" ] || [ -z "${sum:-}" ]; then
  echo "trixie-deb: no $package for $arch in trixie's index at $mirror" >&2
  exit 1
fi
echo "trixie-deb: $file"
curl -fsS --retry 3 -o "$work/package.deb" "$mirror/$file"
echo "$sum  $work/package.deb" | sha256sum -c --quiet
dpkg-deb -x "$work/package.deb" "$dest"
