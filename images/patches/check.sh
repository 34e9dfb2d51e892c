#!/usr/bin/env bash
# Each of an engine's patches (SHA256SUMS) against the file it was made for: the engine's locked
# wheel downloaded (pip --require-hashes: its sha256 from images/locks/<engine>.txt), the files
# the patches change taken out of it, and apply.sh run on them, which checks both sha256s.
#   images/patches/check.sh sglang
set -euo pipefail
engine=${1:?engine (sglang)}
here=$(cd "$(dirname "$0")" && pwd)
lock="$here/../locks/$engine.txt"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# the engine's own pin, with its hashes, out of the lock
python3 - "$lock" "$engine" >"$work/req.txt" <<'PY'
import re
import sys

lock, name = open(sys.argv[1]).read(), sys.argv[2]
pin = re.search(rf"^{re.escape(name)}==\S+(?: \\\n\s+--hash=sha256:[0-9a-f]{{64}})+", lock, re.M)
if pin is None:
    sys.exit(f"check.sh: no {name} pin in {sys.argv[1]}")
print(pin.group(0))
PY
echo "check.sh: $(head -1 "$work/req.txt" | cut -d' ' -f1): downloading the locked wheel ..."
python3 -m pip download -q --no-deps --require-hashes --only-binary :all: --implementation cp \
  --python-version 3.12 --abi cp312 --platform manylinux_2_34_x86_64 -d "$work/wheel" -r "$work/req.txt"
mkdir "$work/site"
targets=$(grep -v '^#' "$here/SHA256SUMS" | awk -v e="$engine" '$1 == e { print $3 }')
# shellcheck disable=SC2086
python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2], sys.argv[3:])' \
  "$work"/wheel/*.whl "$work/site" $targets
"$here/apply.sh" "$engine" "$work/site"
