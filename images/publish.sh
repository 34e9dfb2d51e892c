#!/usr/bin/env bash
# Publish tandem's built images to a registry and say, by digest, what was published; and turn
# that record back into what compose runs. One script for `make publish`, `make up IMAGES_ENV=`,
# .github/workflows/images.yml and gpu.yml:
#
#   images/publish.sh push --registry HOST[:PORT][/PREFIX] [--out DIR] [--local-tag TAG] [--tag TAG]... IMAGE...
#   images/publish.sh compose-env FILE    # FILE (an images.env): the compose variables that pin each image
#   images/publish.sh kustomize FILE OVERLAY OUT   # OUT/kustomization.yaml: OVERLAY with FILE's digests
#
# push: for every IMAGE (a name such as tandem-trainer-cpu; the local image is IMAGE:LOCAL_TAG,
# default dev), first every check, then every push, so one failed check publishes nothing (the
# images' checks at once, then their pushes at once):
#   - the image runs as a user other than root;
#   - its OCI labels (org.opencontainers.image.source, revision, version, licenses, created) are
#     set: `make images` sets them from git;
#   - its in-image check passes: `tandem-doctor` (every environment exactly its lock, importing,
#     unprivileged) in the Python images; the redis, router, rq-dashboard and Prometheus images
#     check their one program;
#   - its software bill of materials is written (CycloneDX JSON, DIR/sbom/IMAGE.cdx.json): the
#     Python packages of the lock files the image carries in /opt/locks (cyclonedx-py, from
#     .venv-tools: `make tools`) and the Debian/Ubuntu packages installed in it (images/sbom.py).
# Then each image is tagged REGISTRY/IMAGE:TAG for every --tag (default sha-<12 hex of HEAD>),
# pushed, and DIR/images.env (default .tandem/publish) gets one `IMAGE=REGISTRY/IMAGE@sha256:...`
# line per image, sorted: the format images.yml's `image-digests` artifact has.
#
# compose-env: each `IMAGE=REF@sha256:<64 hex>` line becomes TANDEM_<IMAGE>_IMAGE=REF@sha256:...
# (tandem-inference-cpu -> TANDEM_INFERENCE_CPU_IMAGE), the variable compose.yaml,
# compose.cpu.yaml and compose.replicas.yaml read for that image's `image:`. A line that is not
# that shape is an error naming it.
#
# kustomize: OUT/kustomization.yaml, a Kubernetes overlay made of OVERLAY (deploy/k8s/overlays/NAME)
# whose `images:` set every image FILE names to REF@sha256:... (`kubectl apply -k OUT`). It matches
# the names OVERLAY gives its images (tandem-inference-cpu on the cpu overlay); an image the overlay
# does not run is left alone by kustomize.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
die() { echo "images/publish.sh: $*" >&2; exit 1; }

# PINNED_NAMES and PINNED_REFS: the images an images.env FILE pins, and their REF@sha256:...
read_pins() {
  local command="$1" file="$2" line
  PINNED_NAMES=() PINNED_REFS=()
  [[ -f "$file" ]] || die "$command: no file $file (an images.env written by \`make publish\` or images.yml)"
  while IFS= read -r line || [[ -n "$line" ]]; do
    [[ -z "$line" || "$line" == \#* ]] && continue
    if [[ ! "$line" =~ ^(tandem-[a-z0-9-]+)=([a-z0-9.:/_-]+@sha256:[0-9a-f]{64})$ ]]; then
      die "$command: $file: '$line' is not IMAGE=REGISTRY/IMAGE@sha256:<64 hex>; write it with \`make publish\` or take images.yml's image-digests artifact"
    fi
    PINNED_NAMES+=("${BASH_REMATCH[1]}") PINNED_REFS+=("${BASH_REMATCH[2]}")
  done <"$file"
  ((${#PINNED_NAMES[@]} > 0)) || die "$command: $file names no image"
}

compose_env() {
  local name i
  read_pins compose-env "$1"
  for i in "${!PINNED_NAMES[@]}"; do
    name="${PINNED_NAMES[$i]^^}"
    echo "${name//-/_}_IMAGE=${PINNED_REFS[$i]}"
  done
}

kustomize_overlay() {
  local file="$1" overlay="$2" out="$3" i ref
  read_pins kustomize "$file"
  [[ -f "$overlay/kustomization.yaml" ]] || die "kustomize: $overlay has no kustomization.yaml (an overlay such as deploy/k8s/overlays/cpu)"
  mkdir -p "$out"
  {
    echo "# $overlay with every image of $file by its digest, written by images/publish.sh kustomize:"
    echo "#   kubectl apply -k $out"
    echo "apiVersion: kustomize.config.k8s.io/v1beta1"
    echo "kind: Kustomization"
    echo "resources:"
    echo "  - $(realpath --relative-to="$out" "$overlay")"
    echo "images:"
    for i in "${!PINNED_NAMES[@]}"; do
      ref="${PINNED_REFS[$i]}"
      printf '  - name: %s\n    newName: %s\n    digest: %s\n' "${PINNED_NAMES[$i]}" "${ref%@*}" "${ref#*@}"
    done
  } >"$out/kustomization.yaml"
  echo "publish: wrote $out/kustomization.yaml ($overlay, ${#PINNED_NAMES[@]} image(s) by digest)"
}

# The command that checks IMAGE from inside it.
in_image_check() {
  case "$1" in
    tandem-redis) echo "redis-server --version" ;;
    tandem-router) echo "haproxy -c -f /etc/tandem/haproxy.cfg" ;;
    tandem-rq-dashboard) echo "rq-dashboard --help" ;;
    tandem-prometheus) echo "promtool check config /etc/tandem/prometheus/prometheus.yml" ;;
    *) echo "tandem-doctor" ;;
  esac
}

LABELS=(org.opencontainers.image.source org.opencontainers.image.revision org.opencontainers.image.version
  org.opencontainers.image.licenses org.opencontainers.image.created)

check_image() {
  local image="$1" local_ref="$2" user label value check out
  docker image inspect "$local_ref" >/dev/null 2>&1 \
    || die "$local_ref: no such local image; build it first (make images STACK=cpu|gpu, or make publish, which builds)"
  user="$(docker image inspect --format '{{.Config.User}}' "$local_ref")"
  if [[ -z "$user" || "$user" == root || "$user" == 0 || "$user" == 0:* ]]; then
    die "$local_ref runs as root (USER '${user}'): tandem's images run unprivileged; not publishing"
  fi
  for label in "${LABELS[@]}"; do
    value="$(docker image inspect --format "{{index .Config.Labels \"$label\"}}" "$local_ref")"
    if [[ -z "$value" || "$value" == unknown || "$value" == "<no value>" ]]; then
      die "$local_ref has no $label label ('$value'); build it with \`make images\` (which sets the labels from git) or pass --build-arg, then publish"
    fi
  done
  check="$(in_image_check "$image")"
  echo "publish: $local_ref: $check"
  # shellcheck disable=SC2086  # the check is a command line
  if ! out="$(docker run --rm --network none "$local_ref" $check 2>&1)"; then
    echo "$out" >&2
    die "$local_ref: its in-image check \`$check\` failed (above); not publishing"
  fi
  echo "$out" | tail -n 1
}

sbom() {
  local image="$1" local_ref="$2" out="$3" tool="$4" version tmp locks lock os
  version="$(docker image inspect --format '{{index .Config.Labels "org.opencontainers.image.version"}}' "$local_ref")"
  tmp="$(mktemp -d)"
  local -a python=()
  locks="$(docker run --rm --network none "$local_ref" sh -c 'ls /opt/locks/*.txt 2>/dev/null || true')"
  if [[ -n "$locks" ]]; then
    # Every Python environment of the image in one BOM: its locks, concatenated.
    for lock in $locks; do
      docker run --rm --network none "$local_ref" cat "$lock" >>"$tmp/requirements.txt"
    done
    "$tool" requirements --output-reproducible --of JSON -o "$tmp/python.json" "$tmp/requirements.txt"
    python=(--python "$tmp/python.json")
  fi
  os="$(docker run --rm --network none "$local_ref" sh -c '. /etc/os-release && echo "$ID:$VERSION_CODENAME"')"
  docker run --rm --network none "$local_ref" dpkg-query -W -f '${Package}\t${Version}\t${Architecture}\n' >"$tmp/packages.tsv"
  "$(dirname "$tool")/python" "$here/sbom.py" "$image" "$version" --os "$os" --packages "$tmp/packages.tsv" "${python[@]}" >"$out"
  echo "publish: $image: SBOM ($(wc -l <"$tmp/packages.tsv") $os packages${locks:+; Python: $(echo "$locks" | xargs -n1 basename | paste -sd' ')}) -> $out"
  rm -rf "$tmp"
}

check_and_sbom() {
  local image="$1" local_tag="$2" out="$3" tool="$4"
  check_image "$image" "$image:$local_tag"
  sbom "$image" "$image:$local_tag" "$out/sbom/$image.cdx.json" "$tool"
}

# Push IMAGE:LOCAL_TAG as REGISTRY/IMAGE:TAG for every TAG; its images.env line in $JOBS/IMAGE.line.
push_image() {
  local image="$1" local_ref="$1:$2" registry="$3" tag digest="" line started=$SECONDS
  shift 3
  for tag in "$@"; do
    docker tag "$local_ref" "$registry/$image:$tag"
    line="$(docker push "$registry/$image:$tag" | tail -n 1)"
    [[ "$line" =~ digest:\ (sha256:[0-9a-f]{64}) ]] || die "push $registry/$image:$tag: no digest in docker's answer: $line"
    [[ -z "$digest" || "$digest" == "${BASH_REMATCH[1]}" ]] \
      || die "push $registry/$image: tag $tag got ${BASH_REMATCH[1]}, an earlier tag $digest"
    digest="${BASH_REMATCH[1]}"
  done
  echo "publish: $registry/$image@$digest (tags: $*; pushed in $((SECONDS - started)) s)"
  echo "$image=$registry/$image@$digest" >"$JOBS/$image.line"
}

# each_image WHY FUNC ARGS... -- IMAGE...: `FUNC IMAGE ARGS...` for every image at once (a check
# is mostly imports and a push mostly compression, one core each: one after the other they took
# twice as long on 2 cores), each one's output shown after, in the images' order; dies naming
# every image whose FUNC failed, and WHY.
each_image() {
  local why="$1" func="$2" image
  shift 2
  local -a args=() pids=() failed=()
  while [[ "$1" != -- ]]; do args+=("$1"); shift; done
  shift
  for image in "$@"; do
    ( "$func" "$image" "${args[@]}" ) >"$JOBS/$image.out" 2>"$JOBS/$image.err" &
    pids+=($!)
  done
  local i=0
  for image in "$@"; do
    wait "${pids[$i]}" || failed+=("$image")
    cat "$JOBS/$image.out"
    cat "$JOBS/$image.err" >&2
    i=$((i + 1))
  done
  ((${#failed[@]} == 0)) || die "${failed[*]}: failed (above); $why"
}

push() {
  local registry="" out=".tandem/publish" local_tag="dev" tool="${SBOM_TOOL:-.venv-tools/bin/cyclonedx-py}"
  local -a tags=() images=()
  while (($#)); do
    case "$1" in
      --registry) registry="${2:?--registry needs HOST[:PORT][/PREFIX]}"; shift 2 ;;
      --out) out="${2:?--out needs a directory}"; shift 2 ;;
      --local-tag) local_tag="${2:?--local-tag needs a tag}"; shift 2 ;;
      --tag) tags+=("${2:?--tag needs a tag}"); shift 2 ;;
      -*) die "push: unknown option $1" ;;
      *) images+=("$1"); shift ;;
    esac
  done
  [[ -n "$registry" ]] || die "push: give --registry HOST[:PORT][/PREFIX], e.g. ghcr.io/acme or 127.0.0.1:5000"
  registry="${registry%/}"
  [[ "$registry" =~ ^[a-z0-9.-]+(:[0-9]+)?(/[a-z0-9._/-]+)?$ ]] \
    || die "push: --registry '$registry' is not HOST[:PORT][/PREFIX] in lower case (e.g. ghcr.io/acme, 127.0.0.1:5000/tandem)"
  ((${#images[@]})) || die "push: name the images to publish (e.g. tandem-inference-cpu tandem-trainer-cpu)"
  [[ -x "$tool" ]] || die "push: no SBOM tool at $tool: run \`make tools\` (.venv-tools from images/locks/tools.txt), or set SBOM_TOOL"
  if ((${#tags[@]} == 0)); then
    tags=("sha-$(git rev-parse --short=12 HEAD)") || die "push: no --tag and no git revision to name one after"
  fi
  mkdir -p "$out/sbom"

  local image started=$SECONDS
  for image in "${images[@]}"; do
    [[ "$image" =~ ^tandem-[a-z0-9-]+$ ]] || die "push: '$image' is not an image name such as tandem-trainer-cpu"
  done
  JOBS="$(mktemp -d)"
  trap 'rm -rf "$JOBS"' EXIT
  each_image "nothing is pushed" check_and_sbom "$local_tag" "$out" "$tool" -- "${images[@]}"
  echo "publish: ${#images[@]} image(s) checked, SBOMs written in $((SECONDS - started)) s; pushing"
  started=$SECONDS
  each_image "no images.env is written" push_image "$local_tag" "$registry" "${tags[@]}" -- "${images[@]}"
  echo "publish: ${#images[@]} image(s) pushed in $((SECONDS - started)) s"

  local -a lines=()
  for image in "${images[@]}"; do
    lines+=("$(cat "$JOBS/$image.line")")
  done
  printf '%s\n' "${lines[@]}" | sort >"$out/images.env"
  echo "publish: wrote $out/images.env"
}

case "${1:-}" in
  push) shift; push "$@" ;;
  compose-env) [[ $# -eq 2 ]] || die "usage: $0 compose-env FILE"; compose_env "$2" ;;
  kustomize) [[ $# -eq 4 ]] || die "usage: $0 kustomize FILE OVERLAY OUT"; kustomize_overlay "$2" "$3" "$4" ;;
  *) echo "usage: $0 push --registry HOST[:PORT][/PREFIX] [--out DIR] [--local-tag TAG] [--tag TAG]... IMAGE..." >&2
     echo "       $0 compose-env FILE" >&2
     echo "       $0 kustomize FILE OVERLAY OUT" >&2
     exit 2 ;;
esac
