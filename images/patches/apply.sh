#!/usr/bin/env bash
# tandem's patches to an engine's environment, each file checked by sha256 before and after
# (SHA256SUMS), applied with GNU patch and no fuzz:
#   images/patches/apply.sh sglang /opt/sglang/lib/python3.12/site-packages
# A file already patched is left as it is; a file of another release (its sha256 neither the
# locked one nor the patched one) stops the script before anything changes.
set -euo pipefail
engine=${1:?engine (sglang)} site=${2:?site-packages of the environment}
here=$(cd "$(dirname "$0")" && pwd)
command -v patch >/dev/null 2>&1 || { echo "apply.sh: GNU patch is needed (apt-get install patch)" >&2; exit 1; }
applied=0
while read -r eng file target before after; do
  [ "$eng" = "$engine" ] || continue
  path="$site/$target"
  [ -f "$path" ] || { echo "apply.sh: $path not found: is $site $engine's site-packages?" >&2; exit 1; }
  have=$(sha256sum "$path" | cut -d' ' -f1)
  if [ "$have" = "$after" ]; then
    echo "apply.sh: $file: already applied to $path"
    continue
  fi
  [ "$have" = "$before" ] || {
    echo "apply.sh: $path has sha256 $have, not the $before that $file was made for (another $engine release?)" >&2
    exit 1
  }
  patch -p1 --fuzz=0 --no-backup-if-mismatch --quiet -d "$site" <"$here/$file"
  have=$(sha256sum "$path" | cut -d' ' -f1)
  [ "$have" = "$after" ] || { echo "apply.sh: $path after $file has sha256 $have, not $after" >&2; exit 1; }
  echo "apply.sh: $file: applied to $path"
  applied=$((applied + 1))
done < <(grep -v '^#' "$here/SHA256SUMS")
echo "apply.sh: $engine: $applied patch(es) applied"
