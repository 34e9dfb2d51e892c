#!/usr/bin/env bash
# Prepare what the images build from, without a container registry:
#   1. images/local/ (git-ignored): the build host's CA bundle (containers here reach PyPI only
#      with it) and the CPU torch wheel that images/locks/dev.txt pins, fetched by this host's pip
#      (its own configuration, then TORCH_INDEX); without it the images fetch it from TORCH_INDEX;
#   2. the base image, made with debootstrap and imported into docker: Debian bookworm (Python
#      3.11) for the CPU images, or with SUITE=noble Ubuntu 24.04 (Python 3.12) for the GPU images.
# Idempotent: each part is skipped when present.
#   images/build-base.sh [TAG]                        TAG defaults to tandem-base:bookworm
#   SUITE=noble images/build-base.sh tandem-base:noble  # what `make images STACK=gpu` runs
# Env: SUITE (bookworm or noble), DEBIAN_MIRROR (default http://deb.debian.org/debian; for noble
#      UBUNTU_MIRROR, default http://archive.ubuntu.com/ubuntu, checked with the keyring of the
#      `ubuntu-keyring` package), FORCE=1 remakes the base, TORCH_SPEC (default: the torch pin
#      of images/locks/dev.txt; empty: fetch no wheel), TORCH_INDEX (default: PyTorch's CPU index),
#      PIP (default: .venv/bin/pip, else pip3).
set -euo pipefail
cd "$(dirname "$0")/.."

suite="${SUITE:-bookworm}"
# What the host needs, said once up front.
missing=()
command -v docker >/dev/null || missing+=(docker.io)
command -v debootstrap >/dev/null || missing+=(debootstrap)
command -v dpkg-deb >/dev/null || missing+=(dpkg)
if ((${#missing[@]})); then
  echo "build-base: this host lacks ${missing[*]}: run images/install-docker.sh as root (Debian or Ubuntu: it installs docker.io and debootstrap and starts the engine), then images/install-compose-v2.sh" >&2
  exit 1
fi
tag="${1:-tandem-base:$suite}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
debootstrap_args=(--variant=minbase)
if [[ "$suite" == noble ]]; then
  # Ubuntu: its own mirror and keyring, main and universe (python3-venv); older
  # debootstrap releases know noble only through the script all Ubuntu suites share.
  mirror="${UBUNTU_MIRROR:-http://archive.ubuntu.com/ubuntu}"
  # Ubuntu's archive keyring: the host's (package ubuntu-keyring on Ubuntu and Debian 13), else
  # Debian trixie's ubuntu-keyring package fetched into images/local/ (Debian 12 packages none).
  keyring=/usr/share/keyrings/ubuntu-archive-keyring.gpg
  if [[ ! -s "$keyring" ]]; then
    keyring=images/local/ubuntu-keyring/usr/share/keyrings/ubuntu-archive-keyring.gpg
    [[ -s "$keyring" ]] || images/trixie-deb.sh ubuntu-keyring images/local/ubuntu-keyring \
      || { echo "build-base: no Ubuntu archive keyring: install the ubuntu-keyring package, or let images/trixie-deb.sh reach Debian's mirror" >&2; exit 1; }
    keyring="$PWD/$keyring"
  fi
  debootstrap_args+=(--keyring="$keyring" --components=main,universe)
fi
locked_torch="$(sed -n 's/^\(torch==[^ ]*\).*/\1/p' images/locks/dev.txt)"
torch_spec="${TORCH_SPEC-$locked_torch}"   # set and empty: no wheel (the GPU images never use one)
torch_index="${TORCH_INDEX-https://download.pytorch.org/whl/cpu}"
local_dir=images/local

# 1. local build inputs ----------------------------------------------------------
mkdir -p "$local_dir/wheels"
for ca in /etc/ssl/certs/ca-certificates.crt /etc/pki/tls/certs/ca-bundle.crt; do
  if [[ -s "$ca" ]]; then
    cmp -s "$ca" "$local_dir/ca-certificates.crt" || cp "$ca" "$local_dir/ca-certificates.crt"
    break
  fi
done
if [[ -n "$torch_spec" ]] && ! compgen -G "$local_dir/wheels/torch-*.whl" >/dev/null; then
  pip="${PIP:-}"
  [[ -n "$pip" ]] || { [[ -x .venv/bin/pip ]] && pip=.venv/bin/pip; } || pip=pip3
  echo "build-base: fetching a $torch_spec wheel with $pip (local disk first)"
  "$pip" download -q "$torch_spec" --no-deps --only-binary=:all: -d "$local_dir/wheels" \
    ${torch_index:+--extra-index-url "$torch_index"} \
    || echo "build-base: no torch wheel; the images install $torch_spec from ${torch_index:-their pip configuration}" >&2
fi
ls "$local_dir"/wheels/torch-*.whl 2>/dev/null | sed 's/^/build-base: torch wheel /' || true

# 2. the base image ----------------------------------------------------------------
if [[ "${FORCE:-0}" != 1 ]] && docker image inspect "$tag" >/dev/null 2>&1; then
  echo "build-base: $tag exists"
  exit 0
fi

root="$(mktemp -d /tmp/tandem-base.XXXXXX)"
trap 'rm -rf "$root"' EXIT
t0=$SECONDS
echo "build-base: debootstrap $suite into $root"
script=()
[[ "$suite" == noble && ! -e /usr/share/debootstrap/scripts/noble ]] && script=(/usr/share/debootstrap/scripts/gutsy)
debootstrap "${debootstrap_args[@]}" "$suite" "$root" "$mirror" "${script[@]}" >"$root.log" 2>&1 || { tail -20 "$root.log" >&2; exit 1; }
rm -f "$root.log"
# Keep the image small: no apt lists or caches.
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/archives/*.deb
tar -C "$root" -c . | docker import \
  -c 'ENV LANG=C.UTF-8 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  -c 'CMD ["/bin/bash"]' - "$tag" >/dev/null
echo "build-base: $tag built in $((SECONDS - t0)) s"
