#!/usr/bin/env bash
# Run a command inside a tandem image as if it were a local process of this host, for scripts
# that start tandem's services as local processes (bench/gpu/gpu_check.py and its --tandem-python /
# --trainer-python interpreters, tandem.dev.stack):
#
#   images/run-in-image.sh IMAGE COMMAND [ARGS...]
#   images/run-in-image.sh --wrapper IMAGE PATH    # write PATH: an "interpreter" = python in IMAGE
#
# The container gets the host's network (the services meet on loopback ports) and IPC, the
# current directory mounted at the same path (state directories, models and the adapter store
# are host paths), this user's uid/gid, and this process's TANDEM_*, HF_*, CUDA_*, OMP_*, MKL_*,
# TOKENIZERS_*, PYTHONUNBUFFERED variables. GPUs: DOCKER_GPUS (default `all`; empty = none).
# SIGTERM reaches the command (docker run proxies it); containers carry the label
# tandem.run-in-image, so `docker ps -aq --filter label=tandem.run-in-image | xargs -r docker rm -f`
# removes any that a SIGKILL left behind.
set -euo pipefail

if [[ "${1:-}" == --wrapper ]]; then
  [[ $# -eq 3 ]] || { echo "usage: $0 --wrapper IMAGE PATH" >&2; exit 2; }
  self="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
  printf '#!/bin/sh\nexec %q %q python "$@"\n' "$self" "$2" >"$3"
  chmod +x "$3"
  exit 0
fi
[[ $# -ge 2 ]] || { echo "usage: $0 IMAGE COMMAND [ARGS...]" >&2; exit 2; }
image="$1"
shift

env_args=()
while read -r name; do
  case "$name" in
    TANDEM_* | HF_* | CUDA_* | OMP_* | MKL_* | TOKENIZERS_* | PYTHONUNBUFFERED) env_args+=(-e "$name") ;;
  esac
done < <(compgen -e)
gpu_args=()
if [[ -n "${DOCKER_GPUS-all}" ]]; then
  gpu_args=(--gpus "${DOCKER_GPUS-all}")
fi

exec docker run --rm --init --label tandem.run-in-image=1 \
  --network host --ipc host "${gpu_args[@]}" \
  --user "$(id -u):$(id -g)" -e HOME=/tmp \
  -v "$PWD:$PWD" -w "$PWD" \
  "${env_args[@]}" "$image" "$@"
