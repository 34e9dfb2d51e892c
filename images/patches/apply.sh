#!/usr/bin/env bash
# tandem's patches to an engine's environment, each file checked by sha256 before and after
# (SHA256SUMS), applied with GNU patch and no fuzz:
#   images/patches/apply.sh sglang /opt/sglang/lib/python3.12/site-packages
# A file already patched is left as it is; a file of another release (its sha256 neither the
# locked one nor the patched one) stops the script before anything changes. --reverse takes the
# patches back, to the locked files (a benchmark's "before"), by the same checks:
#   images/patches/apply.sh --reverse sglang /opt/sglang/lib/python3.12/site-packages
set -euo pipefail
reverse=0
[ "${1:-}" = --reverse ] && { reverse=1; shift; }
engine=${1:?engine (sglang)} site=${2:?site-packages of the environment}
here=$(cd "$(dirname "$0")" && pwd)
command -v patch >/dev/null 2>&1 || { echo "apply.sh: GNU patch is needed (apt-get install patch)" >&2; exit 1; }
verb=applied flags=()
[ "$reverse" = 1 ] && verb="taken back" flags=(-R)
# reversing: the patched file is the "from" and the locked one the "to"
col_from=4 col_to=5
[ "$reverse" = 1 ] && col_from=5 col_to=4
lines=$(grep -v '^#' "$here/SHA256SUMS" | awk -v e="$engine" -v f="$col_from" -v t="$col_to" '$1 == e { print $2, $3, $f, $t }')
# every file checked before any is changed
todo=()
while read -r file target from to; do
  [ -n "$file" ] || continue
  path="$site/$target"
  [ -f "$path" ] || { echo "apply.sh: $path not found: is $site $engine's site-packages?" >&2; exit 1; }
  have=$(sha256sum "$path" | cut -d' ' -f1)
  if [ "$have" = "$to" ]; then
    echo "apply.sh: $file: already $verb: $path"
    continue
  fi
  [ "$have" = "$from" ] || {
    if [ "$reverse" = 1 ]; then
      echo "apply.sh: $path has sha256 $have, not the $from that $file leaves: not patched by it, nothing to take back" >&2
    else
      echo "apply.sh: $path has sha256 $have, not the $from that $file was made for (another $engine release?)" >&2
    fi
    exit 1
  }
  todo+=("$file $target $to")
done <<<"$lines"
for item in "${todo[@]}"; do
  read -r file target to <<<"$item"
  path="$site/$target"
  patch -p1 --fuzz=0 --no-backup-if-mismatch --quiet "${flags[@]}" -d "$site" <"$here/$file"
  have=$(sha256sum "$path" | cut -d' ' -f1)
  [ "$have" = "$to" ] || { echo "apply.sh: $path after $file ($verb) has sha256 $have, not $to" >&2; exit 1; }
  echo "apply.sh: $file: $verb: $path"
done
echo "apply.sh: $engine: ${#todo[@]} patch(es) $verb"
